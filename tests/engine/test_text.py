"""Incremental detokenization, stop strings and stop tokens through the engine."""

from __future__ import annotations

import json

import pytest

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams
from llmctl.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine(stories_dir):
    return LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)


def test_multibyte_characters_are_never_split(stories_dir):
    tok = Tokenizer.from_dir(stories_dir)
    text = "Lily said 你好 and ☃ café 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # byte-fallback pieces: characters span several tokens
    stream = tok.decode_stream([1])
    deltas = [stream.step(t) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # held back while a character was incomplete


def stream_all(engine: LLMEngine, prompt: str, params: SamplingParams):
    engine.add_request(prompt, params)
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    return deltas, final


def test_stop_string_truncates_and_is_never_streamed(engine):
    deltas, final = stream_all(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=30, stop=["girl"]))
    out = final.outputs[0]
    assert out.text == ", there was a little "
    assert out.finish_reason == "stop" and out.stop_reason == "girl"
    assert "".join(deltas) == out.text
    assert all("gir" not in d for d in deltas)


def test_stop_string_can_be_included(engine):
    (out,) = engine.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0, max_tokens=30, stop=["Lily", "park"], include_stop_str_in_output=True),
    )
    assert out.outputs[0].text == ", there was a little girl named Lily"


def test_stop_token_id(engine):
    tok = engine.tokenizer
    lily = tok.encode("Lily", add_special_tokens=False)
    (out,) = engine.generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[lily[0]])
    )
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == lily[0]
    assert out.outputs[0].token_ids[-1] == lily[0]


def test_eos_from_generation_config_finishes_unless_ignored(stories_dir, tmp_path):
    # stories260k separates stories with <s> (id 1); declaring it an EOS in generation_config.json
    # (a list, as Llama 3 checkpoints do) must end generation there.
    model_dir = tmp_path / "stories"
    model_dir.mkdir()
    for f in stories_dir.iterdir():
        (model_dir / f.name).symlink_to(f)
    (model_dir / "generation_config.json").unlink()
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 1]}))
    engine = LLMEngine(model=str(model_dir), kv_cache_memory=4 << 20)
    (out,) = engine.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=400))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == 1
    assert "Once upon a time" not in out.outputs[0].text
    (out,) = engine.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == engine.max_model_len == 512


def test_logprobs_through_engine(engine):
    (out,) = engine.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    o = out.outputs[0]
    assert len(o.logprobs) == 5 and all(lp <= 0 for lp in o.logprobs)
    for token, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs):
        assert len(top) == 3 and next(iter(top)) == token  # greedy: the chosen token is the most likely
        assert top[token] == pytest.approx(lp)


def test_prompt_ending_inside_a_character_is_not_repeated(stories_dir):
    tok = Tokenizer.from_dir(stories_dir)
    ids = tok.encode("Lily said 你好", add_special_tokens=False)
    # cut the prompt inside the last character: its remaining byte tokens are "generated"
    for cut in range(len(ids) - 2, len(ids)):
        stream = tok.decode_stream(ids[:cut])
        # a run of byte-fallback tokens is held until it closes (flush, or a non-byte token)
        generated = "".join(stream.step(t) for t in ids[cut:]) + stream.flush()
        assert generated == "好", (cut, generated)
