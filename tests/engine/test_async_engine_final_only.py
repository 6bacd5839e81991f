"""``AsyncEngine.generate(final_only=True)``: the caller gets the finished output alone, the same
totals as the streamed run, and leaving early still aborts the request and frees its blocks."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmctl.engine.async_engine import AsyncEngine, Mailbox
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams


@pytest.fixture
def async_engine(stories_dir):
    engine = AsyncEngine(LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)).start()
    yield engine
    engine.shutdown()


def _collect(async_engine: AsyncEngine, params: SamplingParams, final_only: bool) -> list:
    async def main():
        return [out async for out in async_engine.generate("Once upon a time", params, final_only=final_only)]

    return asyncio.run(main())


def test_final_only_yields_the_finished_output_with_the_streamed_totals(async_engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    streamed = _collect(async_engine, params, final_only=False)
    posts: list[int] = []
    post = Mailbox.post
    monkeypatch.setattr(Mailbox, "post", lambda self, items: posts.append(len(items)) or post(self, items))
    (final,) = _collect(async_engine, params, final_only=True)
    assert posts == [1]  # the event loop was handed one output, once
    assert len(streamed) == 24 and final.finished
    last = streamed[-1].outputs[0]
    got = final.outputs[0]
    assert got.token_ids == last.token_ids and got.text == last.text == "".join(
        out.outputs[0].delta_text for out in streamed
    )
    assert got.logprobs == last.logprobs and got.finish_reason == "length"


def test_leaving_a_final_only_request_aborts_it_and_frees_its_blocks(async_engine):
    engine = async_engine.engine

    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        task = asyncio.ensure_future(anext(async_engine.generate("Once upon a time", params, final_only=True)))
        deadline = time.time() + 30
        while time.time() < deadline and engine.stats.generation_tokens_total < 5:  # decoding, nothing handed over
            await asyncio.sleep(0.005)
        assert not task.done()
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.time() + 10  # the abort runs in a worker thread
    while time.time() < deadline and engine.stats.requests_finished["abort"] < 1:
        time.sleep(0.01)
    with async_engine.lock:
        assert not engine.requests
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats.requests_finished["abort"] == 1


def test_fail_ends_a_request_with_the_error_and_aborts_it(async_engine):
    engine = async_engine.engine

    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        outputs = async_engine.generate("Once upon a time", params)
        first = await anext(outputs)
        async_engine.fail(first.request_id, RuntimeError("drain cut short"))
        with pytest.raises(RuntimeError, match="drain cut short"):
            async for _ in outputs:
                pass

    asyncio.run(main())
    deadline = time.time() + 10
    while time.time() < deadline and engine.stats.requests_finished["abort"] < 1:
        time.sleep(0.01)
    with async_engine.lock:
        assert not engine.requests
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
