"""``/v1/completions`` with ``echo`` and ``logprobs`` scores the prompt as vLLM does (what
lm-evaluation-harness's ``local-completions`` loglikelihood sends: ``echo: true, max_tokens: 0,
logprobs: 1``): the official ``openai`` client against a real server on stories260k, checked
against the engine's ``prompt_logprobs`` and transformers' log_softmax (fp32)."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from server_helpers import API_KEY

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams
from llmctl.tokenizer import Tokenizer

PROMPT = "Once upon a time, the little dog said: “Héllo, 世界!”"


@pytest.fixture(scope="module")
def client(stories_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=stories_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def prompt_ids(stories_dir) -> list[int]:
    return Tokenizer.from_dir(stories_dir).encode(PROMPT)


@pytest.fixture(scope="module")
def hf_logprobs(stories_dir, prompt_ids) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is transformers' distribution over prompt token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, :-1].float(), dim=-1)


def test_max_tokens_0_scores_the_prompt_only(client, prompt_ids, hf_logprobs):
    out = client.completions.create(model="stories", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1, temperature=0)
    choice, lp = out.choices[0], out.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt_ids)
    assert "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [hf_logprobs[i, token].item() for i, token in enumerate(prompt_ids[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for i, top in enumerate(lp.top_logprobs[1:]):  # the prompt's own token and the most likely one
        best = hf_logprobs[i].max().item()
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(best, abs=1e-4)
        assert lp.token_logprobs[i + 1] in top.values()


def test_echo_with_generation_puts_the_prompt_first(client, stories_dir, prompt_ids):
    out = client.completions.create(model="stories", prompt=PROMPT, echo=True, max_tokens=6, logprobs=3, temperature=0)
    choice, lp = out.choices[0], out.choices[0].logprobs
    plain = client.completions.create(model="stories", prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0)
    generated = plain.choices[0]
    assert choice.text == PROMPT + generated.text
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(prompt_ids) + len(generated.logprobs.tokens)
    assert lp.tokens[len(prompt_ids) :] == generated.logprobs.tokens
    assert lp.token_logprobs[len(prompt_ids) :] == generated.logprobs.token_logprobs
    assert lp.text_offset[len(prompt_ids) :] == [len(PROMPT) + o for o in generated.logprobs.text_offset]
    engine = LLMEngine(model=str(stories_dir), dtype="float32", kv_cache_memory=8 << 20)
    (ref,) = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    for position, entry in enumerate(ref.prompt_logprobs[1:], start=1):
        assert lp.token_logprobs[position] == pytest.approx(entry[prompt_ids[position]], abs=1e-5)
        assert sorted(lp.top_logprobs[position].values()) == pytest.approx(sorted(entry.values()), abs=1e-5)
    assert math.fsum(lp.token_logprobs[1:]) < 0


def test_several_prompts_keep_their_own_scores(client):
    prompts = ["The cat sat", "Lily went to the park and"]
    out = client.completions.create(model="stories", prompt=prompts, echo=True, max_tokens=0, logprobs=0)
    for prompt, choice in zip(prompts, out.choices):
        assert choice.text == prompt and "".join(choice.logprobs.tokens) == prompt
        assert choice.logprobs.token_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])


def streamed(chunks) -> dict[int, dict]:
    """Per choice index: the streamed text, logprobs lists and finish reason, joined as a client would."""
    joined: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            entry = joined.setdefault(
                choice.index,
                {
                    "text": "",
                    "tokens": [],
                    "token_logprobs": [],
                    "top_logprobs": [],
                    "text_offset": [],
                    "finish_reason": None,
                },
            )
            entry["text"] += choice.text
            entry["finish_reason"] = choice.finish_reason or entry["finish_reason"]
            if choice.logprobs is not None:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    entry[key] += getattr(choice.logprobs, key)
    joined[-1] = {"usage": usage}
    return joined


def whole(choice) -> dict:
    lp = choice.logprobs
    return {
        "text": choice.text,
        "tokens": lp.tokens,
        "token_logprobs": lp.token_logprobs,
        "top_logprobs": lp.top_logprobs,
        "text_offset": lp.text_offset,
        "finish_reason": choice.finish_reason,
    }


@pytest.mark.parametrize("max_tokens", [0, 1, 7])
def test_streamed_echo_with_logprobs_equals_the_whole_answer(client, prompt_ids, max_tokens):
    """The prompt streams first (its text and scores), then the generated tokens, as in vLLM."""
    kwargs = dict(
        model="stories",
        prompt=[PROMPT, "The cat sat"],
        echo=True,
        max_tokens=max_tokens,
        logprobs=2,
        temperature=0,
        n=2,
    )
    expected = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    joined = streamed(chunks)
    assert sorted(k for k in joined if k >= 0) == [0, 1, 2, 3]
    for choice in expected.choices:
        got, want = joined[choice.index], whole(choice)
        # the same numbers up to float rounding (another batch may round a matmul differently)
        assert got.pop("token_logprobs") == pytest.approx(want.pop("token_logprobs"), abs=1e-4)
        got_top, want_top = got.pop("top_logprobs"), want.pop("top_logprobs")
        assert [top and sorted(top) for top in got_top] == [top and sorted(top) for top in want_top]
        for top, expected_top in zip(got_top[1:], want_top[1:]):
            assert top == pytest.approx(expected_top, abs=1e-4)
        assert got == want
    assert joined[0]["text"].startswith(PROMPT) and len(joined[0]["tokens"]) == len(prompt_ids) + max_tokens
    first = next(c for c in chunks if c.choices and c.choices[0].index == 0)
    assert first.choices[0].text.startswith(PROMPT)  # the prompt comes first, whole
    assert joined[-1]["usage"].completion_tokens == expected.usage.completion_tokens == 4 * max_tokens


def test_streamed_echo_without_logprobs(client):
    kwargs = dict(model="stories", prompt=PROMPT, echo=True, max_tokens=5, temperature=0)
    expected = client.completions.create(**kwargs).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == expected
    assert expected.startswith(PROMPT) and len(expected) > len(PROMPT)


def test_max_tokens_0_without_echo_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        client.completions.create(model="stories", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        client.completions.create(model="stories", prompt="hi", max_tokens=0, stream=True)


def test_token_id_prompts_as_lm_eval_sends_them(client, prompt_ids, hf_logprobs):
    out = client.completions.create(
        model="stories",
        prompt=[prompt_ids, prompt_ids[:5]],
        echo=True,
        max_tokens=0,
        logprobs=1,
        temperature=0,
        seed=1234,
    )
    full, short = out.choices
    want = [hf_logprobs[i, token].item() for i, token in enumerate(prompt_ids[1:])]
    assert full.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert short.logprobs.token_logprobs[1:] == pytest.approx(want[:4], abs=1e-4)
    assert full.text == PROMPT and "".join(short.logprobs.tokens) == short.text


def test_tokenizer_endpoints_need_the_api_key_and_match_the_engine(stories_server, prompt_ids):
    import httpx

    with httpx.Client(base_url=stories_server.url, timeout=60) as http:
        assert http.post("/tokenize", json={"prompt": PROMPT}).status_code == 401
        assert http.get("/tokenizer_info").status_code == 401
        http.headers["Authorization"] = f"Bearer {API_KEY}"
        body = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert body["tokens"] == prompt_ids and body["count"] == len(prompt_ids)  # what a text prompt becomes
        assert http.post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"].endswith(PROMPT)
        assert http.post("/tokenize", json={"prompt": PROMPT, "model": "other"}).status_code == 404
        refused = http.post("/tokenize", json={"prompt": PROMPT, "messages": []})
        assert refused.status_code == 400 and "either prompt or messages" in refused.json()["error"]["message"]
