"""The engine loop in a thread with asyncio streams: concurrent streams, early close = abort."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import InvalidRequestError
from llmctl.sampling_params import SamplingParams

EXPECTED = ", there was a little girl named Lily. She loved to play outside in the park. One day,"


@pytest.fixture
def async_engine(stories_dir):
    engine = AsyncEngine(LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)).start()
    yield engine
    engine.shutdown()


def test_concurrent_streams_and_early_close(async_engine):
    async def consume(n_tokens: int | None):
        text = ""
        # A client that goes away asks for far more tokens than it reads: a fast engine must not
        # finish it before the close arrives (30 tokens of stories260k take ~25 ms).
        params = SamplingParams(temperature=0, max_tokens=30 if n_tokens is None else 400, ignore_eos=n_tokens is not None)
        gen = async_engine.generate("Once upon a time", params)
        async for out in gen:
            text += out.outputs[0].delta_text
            if n_tokens is not None and len(out.outputs[0].token_ids) >= n_tokens:
                await gen.aclose()  # the client went away
                break
        return text

    async def main():
        results = await asyncio.gather(*(consume(None if i % 2 else 3) for i in range(8)))
        return results

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i % 2:
            assert text == EXPECTED
        else:
            assert EXPECTED.startswith(text) and len(text) < len(EXPECTED)
    engine = async_engine.engine
    deadline = time.time() + 10  # aborts run in worker threads: give them a moment
    while time.time() < deadline and engine.stats.requests_finished["abort"] < 4:
        time.sleep(0.01)
    with async_engine.lock:
        assert not engine.requests
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats.requests_finished["abort"] == 4


def test_invalid_request_raises_immediately(async_engine):
    async def main():
        with pytest.raises(InvalidRequestError):
            async for _ in async_engine.generate("", SamplingParams()):
                pass

    asyncio.run(main())
    snapshot = async_engine.stats_snapshot()
    assert snapshot["kv"]["free"] == snapshot["kv"]["num_blocks"]
