"""The serving side of a generation: one prompt read straight from the engine's stream, several
merged, a response that is not streamed handed its finished outputs alone, failures and
cancellation that free every block, and SSE events byte for byte their chunk's JSON."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams
from llmctl.server.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionStreamChoice,
    DeltaMessage,
)
from llmctl.server.serving import ChunkEvents, Generation, sse

PROMPTS = ["Once upon a time", "The little dog"]


@pytest.fixture(scope="module")
def async_engine(stories_dir):
    engine = AsyncEngine(LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(stories_dir) -> dict[str, str]:
    """Each prompt's greedy text from the offline engine, one prompt at a time."""
    engine = LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0, max_tokens=20)
    return {p: engine.generate([engine.tokenizer.encode(p)], params)[0].outputs[0].text for p in PROMPTS}


def _token_ids(async_engine: AsyncEngine, prompts: list[str]) -> list[list[int]]:
    return [async_engine.engine.tokenizer.encode(p) for p in prompts]


def _idle(async_engine: AsyncEngine) -> bool:
    engine = async_engine.engine
    with async_engine.lock:
        return not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _wait_until_idle(async_engine: AsyncEngine) -> None:
    """Aborts run in worker threads: every request gone and every block free, within a moment."""
    deadline = time.time() + 10
    while time.time() < deadline and not _idle(async_engine):
        time.sleep(0.01)
    assert _idle(async_engine), "a request or its blocks outlived its generation"


async def _idle_while_the_loop_runs(async_engine: AsyncEngine) -> None:
    """As ``_wait_until_idle``, before the event loop ends (which would close every stream left open)."""
    deadline = time.time() + 10
    while time.time() < deadline and not await asyncio.to_thread(_idle, async_engine):
        await asyncio.sleep(0.01)
    assert await asyncio.to_thread(_idle, async_engine), "a request or its blocks outlived its generation"


@pytest.mark.parametrize(("prompts", "n"), [(PROMPTS[:1], 1), (PROMPTS[:1], 2), (PROMPTS, 1), (PROMPTS, 2)])
def test_streamed_choices_match_the_offline_engine(async_engine, expected, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=20, n=n)

    async def main() -> dict[tuple[int, int], str]:
        generation = Generation(async_engine, _token_ids(async_engine, prompts), params, "cmpl-t", None)
        texts: dict[tuple[int, int], str] = {}
        try:
            await generation.started()
            async for i, out in generation.outputs():
                for c in out.outputs:
                    texts[i, c.index] = texts.get((i, c.index), "") + c.delta_text
        finally:
            generation.cancel()
        assert generation.usage().completion_tokens == 20 * n * len(prompts)
        return texts

    texts = asyncio.run(main())
    assert texts == {(i, k): expected[p] for i, p in enumerate(prompts) for k in range(n)}
    _wait_until_idle(async_engine)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS])
def test_a_response_that_is_not_streamed_gets_the_finished_outputs(async_engine, expected, prompts):
    params = SamplingParams(temperature=0, max_tokens=20)

    async def main() -> dict[int, str]:
        generation = Generation(
            async_engine, _token_ids(async_engine, prompts), params, "cmpl-f", None, final_only=True
        )
        try:
            await generation.started()
            final = await generation.finish()
        finally:
            generation.cancel()
        assert all(out.finished for out in final.values())
        return {i: out.outputs[0].text for i, out in final.items()}

    assert asyncio.run(main()) == {i: expected[p] for i, p in enumerate(prompts)}
    _wait_until_idle(async_engine)


@pytest.mark.parametrize("final_only", [False, True])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS])
def test_fail_ends_the_stream_with_the_error_and_aborts(async_engine, prompts, final_only):
    """A drain cut short fails the requests at once, even those that hand over only their end."""
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    error = APIError(503, "the drain was cut short", type="server_error", code="shutting_down")
    engine = async_engine.engine

    async def main() -> None:
        generation = Generation(
            async_engine, _token_ids(async_engine, prompts), params, "cmpl-x", None, final_only=final_only
        )
        outputs = generation.outputs()
        try:
            pending = asyncio.ensure_future(anext(outputs))
            while engine.stats.generation_tokens_total < 5 * len(prompts) or not engine.requests:
                await asyncio.sleep(0.005)
            generation.fail(error)
            with pytest.raises(APIError) as raised:
                await pending
                async for _ in outputs:
                    pass
            assert raised.value is error
        finally:
            generation.cancel()
        await _idle_while_the_loop_runs(async_engine)

    aborted = engine.stats.requests_finished["abort"]
    asyncio.run(main())
    assert engine.stats.requests_finished["abort"] == aborted + len(prompts)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS])
def test_cancel_between_outputs_aborts_and_frees_the_blocks(async_engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main() -> None:
        generation = Generation(async_engine, _token_ids(async_engine, prompts), params, "cmpl-c", None)
        await generation.started()
        async for _i, out in generation.outputs():
            if len(out.outputs[0].token_ids) >= 3:
                break
        generation.cancel()  # the response closed with the requests still running
        await _idle_while_the_loop_runs(async_engine)

    finished = async_engine.engine.stats.requests_finished["abort"]
    asyncio.run(main())
    assert async_engine.engine.stats.requests_finished["abort"] == finished + len(prompts)


def test_cancel_before_the_stream_starts_adds_nothing(async_engine):
    async def main() -> None:
        added = async_engine.engine.stats.requests_added_total
        generation = Generation(async_engine, _token_ids(async_engine, PROMPTS[:1]), SamplingParams(), "cmpl-n", None)
        generation.cancel()
        await asyncio.sleep(0.05)
        assert async_engine.engine.stats.requests_added_total == added

    asyncio.run(main())


def test_chunk_events_are_the_whole_chunks_json():
    chat = ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[])
    choices = [
        ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None),
        ChatStreamChoice(
            index=1,
            delta=DeltaMessage(reasoning_content="hm", tool_calls=[{"index": 0, "function": {"arguments": '{"a"'}}]),
            finish_reason="tool_calls",
            stop_reason=None,
        ),
    ]
    for choice in choices:
        whole = ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[choice])
        assert ChunkEvents(chat).event(choice) == sse(whole.to_json())
    completion = CompletionChunk(id="cmpl-1", created=7, model="m", choices=[])
    choice = CompletionStreamChoice(
        index=3,
        text='a "quoted" é',
        logprobs=CompletionLogprobs(tokens=["a"], token_logprobs=[-0.5], top_logprobs=[{"a": -0.5}], text_offset=[0]),
        finish_reason="stop",
        stop_reason="\n",
    )
    whole = CompletionChunk(id="cmpl-1", created=7, model="m", choices=[choice])
    assert ChunkEvents(completion).event(choice) == sse(whole.to_json())
