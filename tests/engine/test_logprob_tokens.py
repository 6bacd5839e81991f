"""Logprob token strings that add up, on a byte-fallback tokenizer (stories260k)
and a byte-level BPE one (the embedded model), with CJK and emoji prompts whose characters span
several tokens: completions ``tokens`` concatenate to the text, ``text_offset`` stays inside it,
``top_logprobs`` has one distinct key per candidate, chat ``bytes`` join to the UTF-8 text."""

from __future__ import annotations

import pytest
from tokenizer_factory import byte_level_bpe

from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.outputs import CompletionOutput
from llmctl.sampling_params import SamplingParams
from llmctl.server.logprobs import LogprobsFormatter
from llmctl.tokenizer import Tokenizer

PROMPTS = ["中文：猫", "Lily said 你好 🙂", "🐱🚀", "日本語の"]


@pytest.fixture(scope="module", params=["byte_fallback", "byte_level"])
def engine(request, stories_dir) -> LLMEngine:
    model = str(stories_dir) if request.param == "byte_fallback" else "tiny-random-llama"
    return LLMEngine(model=model, kv_cache_memory=8 << 20, max_model_len=128)


def generations(engine: LLMEngine, **params):
    sampling = SamplingParams(max_tokens=12, logprobs=5, ignore_eos=True, **params)
    return engine.generate(PROMPTS, sampling)


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 2.0, "seed": 7, "n": 3}], ids=str)
def test_completion_tokens_concatenate_to_the_text(engine, params):
    fmt = LogprobsFormatter(engine.tokenizer)
    for out in generations(engine, **params):
        for c in out.outputs:
            logprobs = fmt.completion(c, fmt.texts(out.prompt_token_ids, True), len(c.token_ids))
            assert "".join(logprobs.tokens) == c.text
            assert len(logprobs.tokens) == len(c.token_ids) == len(logprobs.text_offset)
            for offset, token in zip(logprobs.text_offset, logprobs.tokens):
                assert c.text[offset : offset + len(token)] == token and offset <= len(c.text)
            for position, top in enumerate(logprobs.top_logprobs):
                candidates = set(c.top_logprobs[position]) | {c.token_ids[position]}
                assert len(top) == len(candidates) >= 5  # one distinct key per candidate


def test_streamed_completion_tokens_concatenate_too(engine):
    """The same, chunk by chunk, as the server streams them."""
    fmt = LogprobsFormatter(engine.tokenizer)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=12, logprobs=2, temperature=1.5, seed=3))
        texts, tokens, text = None, [], ""
        while engine.has_unfinished():
            for out in engine.step():
                c = out.outputs[0]
                texts = texts or fmt.texts(out.prompt_token_ids, True)
                tokens += fmt.completion(c, texts, len(c.token_ids)).tokens
                text += c.delta_text
        assert "".join(tokens) == text


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 2.0, "seed": 11, "n": 3}], ids=str)
def test_chat_bytes_join_to_the_utf8_text(engine, params):
    fmt = LogprobsFormatter(engine.tokenizer)
    for out in generations(engine, **params):
        for c in out.outputs:
            content = fmt.chat(c, fmt.texts(out.prompt_token_ids, True), len(c.token_ids), True).content
            joined = b"".join(bytes(entry.bytes or []) for entry in content)
            # bytes that never form a character are U+FFFD in the text, exactly as decode does
            assert (
                joined.decode("utf-8", errors="replace") == c.text.lstrip(" ")
                or joined.decode("utf-8", errors="replace") == c.text
            )
            if "\ufffd" not in c.text:
                assert joined == c.text.encode("utf-8") or joined == c.text.lstrip(" ").encode("utf-8")
            for entry in content:
                names = [alt.token for alt in entry.top_logprobs]
                assert len(names) == len(set(names))


@pytest.fixture(scope="module", params=["byte_fallback", "byte_level"])
def tok(request, stories_dir) -> Tokenizer:
    return Tokenizer.from_dir(stories_dir) if request.param == "byte_fallback" else byte_level_bpe()


def as_output(tok: Tokenizer, prompt: list[int], text: str, top: int) -> CompletionOutput:
    """A finished choice that generated ``text``, each token's alternatives the next ids."""
    ids = tok.encode(text, add_special_tokens=False)
    stream = tok.decode_stream(prompt)
    produced = "".join(stream.step(t) for t in ids) + stream.flush()
    tops = [{(t + k) % tok.vocab_size: -1.0 - k for k in range(top)} for t in ids]
    return CompletionOutput(
        index=0, text=produced, token_ids=ids, finish_reason="length", logprobs=[-1.0] * len(ids), top_logprobs=tops
    )


@pytest.mark.parametrize("text", ["中文：猫", " 你好 🙂 done", "🐱🚀日本語", " café — «ok» 🙂"])
def test_characters_split_over_byte_tokens(tok, text):
    """The issue's case: CJK and emoji whose bytes are spread over several tokens."""
    fmt = LogprobsFormatter(tok)
    prompt = tok.encode("Lily said")
    c = as_output(tok, prompt, text, top=5)
    assert any("\ufffd" in tok.decode([t]) for t in c.token_ids)  # a character really is split
    logprobs = fmt.completion(c, fmt.texts(prompt, True), len(c.token_ids))
    assert "".join(logprobs.tokens) == c.text and c.text.strip() == text.strip()
    assert all(offset <= len(c.text) for offset in logprobs.text_offset)
    assert all(len(top) == 5 for top in logprobs.top_logprobs)  # distinct keys, the chosen one among them
    assert any(key.startswith("bytes:\\x") for top in logprobs.top_logprobs for key in top)
    content = fmt.chat(c, fmt.texts(prompt, True), len(c.token_ids), True).content
    assert b"".join(bytes(entry.bytes) for entry in content) == c.text.encode("utf-8")
    assert all(len({alt.token for alt in entry.top_logprobs}) == 5 for entry in content)
    partial = [entry for entry in content if entry.token.startswith("bytes:")]
    assert partial and all(entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes) for entry in partial)
