"""A fault while turning one request's tokens into output fails that request alone: finish_reason
"error" with the cause in RequestOutput.error, its blocks freed, the others' text unchanged, and
the engine goes on serving."""

from __future__ import annotations

import asyncio

import pytest

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "The cat sat", "Lily went to the park", "One day"]
BAD = 2


class ExplodingDetokenizer:
    """Wraps a real detokenizer and raises on its third token."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, 0

    def step(self, token_id: int) -> str:
        self.steps += 1
        if self.steps == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte (injected)")
        return self.inner.step(token_id)

    def flush(self) -> str:
        return self.inner.flush()


@pytest.fixture
def engine(stories_dir, monkeypatch):
    engine = LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)
    bad_prompt = engine.tokenizer.encode(PROMPTS[BAD])
    real = engine.tokenizer.decode_stream

    def decode_stream(prompt_token_ids, skip_special_tokens=True):
        inner = real(prompt_token_ids, skip_special_tokens)
        return ExplodingDetokenizer(inner) if list(prompt_token_ids) == bad_prompt else inner

    monkeypatch.setattr(engine.tokenizer, "decode_stream", decode_stream)
    return engine


def expected_texts(stories_dir, params) -> list[str]:
    clean = LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)
    return [o.outputs[0].text for o in clean.generate(PROMPTS, params)]


def test_raising_detokenizer_fails_only_its_request(engine, stories_dir):
    params = SamplingParams(temperature=0, max_tokens=12, stop=["zzz"])
    want = expected_texts(stories_dir, params)
    outs = engine.generate(PROMPTS, params)
    bad = outs[BAD]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "UnicodeDecodeError" in bad.error and "injected" in bad.error
    assert len(bad.outputs[0].token_ids) == 3  # it stopped at the step that failed
    for i, out in enumerate(outs):
        if i != BAD:
            assert out.error is None and out.outputs[0].finish_reason == "length"
            assert out.outputs[0].text == want[i]
    counters = engine.counters()
    assert counters.kv_free_blocks == counters.kv_num_blocks
    assert counters.requests_finished["error"] == 1 and counters.requests_finished["length"] == 3
    assert not engine.has_unfinished()
    (again,) = engine.generate([PROMPTS[0]], params)  # the engine still serves
    assert again.outputs[0].text == want[0]


def test_async_engine_stays_alive_after_a_request_fails(engine):
    async_engine = AsyncEngine(engine).start()

    async def run(prompt: str):
        final = None
        async for out in async_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8)):
            final = out
        return final

    async def main():
        return await asyncio.gather(*(run(p) for p in PROMPTS))

    try:
        outs = asyncio.run(main())
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "length", "error", "length"]
        assert not async_engine.is_dead and async_engine.dead_error is None
        after = asyncio.run(run(PROMPTS[0]))
        assert after.outputs[0].finish_reason == "length"
        assert async_engine.counters().kv_free_blocks == async_engine.counters().kv_num_blocks
    finally:
        async_engine.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop re-raises
def test_a_model_fault_stops_the_loop_and_says_why(engine, monkeypatch):
    async_engine = AsyncEngine(engine).start()

    def broken(sched):
        raise RuntimeError("device lost (injected)")

    monkeypatch.setattr(engine.runner, "execute", broken)

    async def main():
        async for _ in async_engine.generate(PROMPTS[0], SamplingParams(max_tokens=4)):
            pass

    try:
        with pytest.raises(Exception, match="device lost"):
            asyncio.run(main())
        assert async_engine.is_dead and "device lost" in async_engine.dead_error
    finally:
        async_engine.shutdown()
