"""The streaming detokenizer cannot raise and adds up to the tokenizer's own ``decode``, on a
byte-level BPE (GPT-2/Llama 3/Qwen style) and a SentencePiece byte-fallback tokenizer
(stories260k, Llama 2 style), for any token ids, special tokens and prompt context included."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_factory import MIXED_TEXT, byte_level_bpe

from llmctl.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok(request, stories_dir) -> Tokenizer:
    return byte_level_bpe() if request.param == "byte_level" else Tokenizer.from_dir(stories_dir)


def streamed(tok: Tokenizer, context: list[int], generated: list[int], skip: bool) -> tuple[list[str], str]:
    stream = tok.decode_stream(context, skip_special_tokens=skip)
    return [stream.step(t) for t in generated], stream.flush()


def token_ids(tok: Tokenizer, max_size: int) -> st.SearchStrategy[list[int]]:
    """Any id, with extra weight on the ids that make decoding hard: byte tokens, special tokens,
    and the tokens of multi-byte text."""
    hard = sorted(
        set(tok.byte_fallback_tokens) | tok.special_token_ids | set(tok.encode(MIXED_TEXT, add_special_tokens=False))
    )
    one = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(hard))
    return st.lists(one, max_size=max_size)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_deltas_add_up_to_decode(tok, data, skip):
    generated = data.draw(token_ids(tok, 40), label="generated")
    deltas, rest = streamed(tok, [], generated, skip)
    assert "".join(deltas) + rest == tok.decode(generated, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_deltas_after_a_prompt_context(tok, data, skip):
    """After a prompt that ends on a whole character (as every text prompt does), the deltas are
    exactly what the generated ids add to the prompt's decoded text."""
    context = data.draw(token_ids(tok, IncrementalDetokenizer.PROMPT_CONTEXT - 1), label="context")
    context.append(tok.encode(" the", add_special_tokens=False)[-1])
    generated = data.draw(token_ids(tok, 30), label="generated")
    deltas, rest = streamed(tok, context, generated, skip)
    full = tok.decode(context + generated, skip_special_tokens=skip)
    before = tok.decode(context, skip_special_tokens=skip)
    assert full.startswith(before)
    assert "".join(deltas) + rest == full[len(before) :]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_any_prompt_context_never_raises(tok, data, skip):
    """A token-id prompt may end inside a character; the generated ids that complete it emit the
    character whole (not repeated), and the text is still a suffix of the full decode."""
    context = data.draw(token_ids(tok, IncrementalDetokenizer.PROMPT_CONTEXT), label="context")
    generated = data.draw(token_ids(tok, 30), label="generated")
    deltas, rest = streamed(tok, context, generated, skip)
    full = tok.decode(context + generated, skip_special_tokens=skip)
    assert full.endswith("".join(deltas) + rest)


def test_clean_prompt_text_is_a_prefix(tok):
    prompt = tok.encode("Once upon a time", add_special_tokens=False)
    generated = tok.encode(" 猫在桌子上 🙂 done", add_special_tokens=False)
    deltas, rest = streamed(tok, prompt, generated, True)
    assert "".join(deltas) + rest == tok.decode(prompt + generated)[len(tok.decode(prompt)) :]
    assert "\ufffd" not in "".join(deltas) + rest


def test_bytes_that_never_complete_become_replacement_characters(tok):
    """A lone lead byte followed by ASCII: the full decode shows U+FFFD, and so does the stream,
    once the next token proves the character can never complete."""
    lead = _token_with_bytes(tok, b"\xe4")
    after = tok.encode("ok", add_special_tokens=False)
    deltas, rest = streamed(tok, [], [lead, *after], True)
    assert deltas[0] == ""  # held back: it could still become a character
    assert "".join(deltas) + rest == tok.decode([lead, *after]) and "\ufffd" in "".join(deltas)
    deltas, rest = streamed(tok, [], [lead], True)
    assert deltas == [""] and rest == tok.decode([lead]) == "\ufffd"  # flushed at the end


def _token_with_bytes(tok: Tokenizer, raw: bytes) -> int:
    if tok.byte_fallback_tokens:
        return next(i for i, b in tok.byte_fallback_tokens.items() if bytes([b]) == raw)
    from tokenizers.pre_tokenizers import ByteLevel  # noqa: F401  (the alphabet maps byte 0xE4 to 'ä')

    return tok.backend.token_to_id("ä")


def test_sequence_that_crashed_decode_stream(stories_dir):
    """tokenizers' DecodeStream raised 'Invalid prefix encountered' on this (a run of
    byte tokens that turns invalid after a complete character was already streamed)."""
    tok = Tokenizer.from_dir(stories_dir)
    ids = [153, 226, 502, 75, 46, 70, 29, 2, 332, 67, 370, 46, 221, 481, 72, 204, 316, 315, 30, 227, 496, 182]
    deltas, rest = streamed(tok, tok.encode("Once upon a time"), ids, True)
    full = tok.decode(tok.encode("Once upon a time") + ids)
    assert "".join(deltas) + rest == full[len(tok.decode(tok.encode("Once upon a time"))) :]
