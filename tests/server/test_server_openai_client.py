"""The official ``openai`` client against a real ``llmctl serve``: completions and chat, streaming
and not, with the sampling parameters the API promises."""

from __future__ import annotations

import openai
import pytest
from server_helpers import API_KEY

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

STORY = ", there was a little girl named Lily. She loved to play outside in the park. One day,"


@pytest.fixture(scope="module")
def client(stories_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=stories_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_client(chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=chat_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tiny_engine() -> LLMEngine:
    """The embedded model offline, to check what the chat server answers."""
    return LLMEngine(model="tiny-random-llama", max_model_len=64, kv_cache_memory=16 << 20)


# ---- completions ---------------------------------------------------------------------------------
def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories"]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_greedy_completion_is_the_reference_story(client, stories_dir):
    for model in ("stories", str(stories_dir)):  # the served name and the path it was loaded from
        r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=30, temperature=0)
        assert r.object == "text_completion"
        assert r.choices[0].text == STORY
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 30, 35)


def test_streamed_completion_arrives_token_by_token(client):
    stream = client.completions.create(
        model="stories",
        prompt="Once upon a time",
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == STORY
    assert len(text_chunks) >= 20  # streamed as produced, not in one piece
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


def test_default_max_tokens_is_16_and_token_prompts_work(client):
    r = client.completions.create(model="stories", prompt="Once upon a time", temperature=0)
    assert r.usage.completion_tokens == 16 and STORY.startswith(r.choices[0].text)
    by_ids = client.completions.create(model="stories", prompt=[1, 403, 407, 261, 378], temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_n_and_seed_are_reproducible(client):
    def sample() -> list[str]:
        r = client.completions.create(
            model="stories", prompt="Once upon a time", n=3, seed=7, temperature=1.0, max_tokens=12, user="alice"
        )
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1  # sample i uses seed + i


def test_stop_strings_end_the_text_before_them(client):
    r = client.completions.create(
        model="stories", prompt="Once upon a time", max_tokens=30, temperature=0, stop=["Lily", "park"]
    )
    choice = r.choices[0]
    assert choice.text == ", there was a little girl named "
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "Lily"
    stream = client.completions.create(
        model="stories", prompt="Once upon a time", max_tokens=30, temperature=0, stop="park", stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == STORY[: STORY.index("park")]


def test_logprobs_in_the_completions_format(client):
    r = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text == STORY[: len(choice.text)]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and top[token] == logprob == max(top.values()) <= 0  # greedy picks the top one
    stream = client.completions.create(
        model="stories", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    streamed = [t for c in stream for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_several_prompts_and_echo(client):
    r = client.completions.create(
        model="stories", prompt=["Once upon a time", "Lily went"], n=2, max_tokens=4, temperature=0
    )
    by_index = {c.index: c.text for c in r.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] == ", there was a"  # prompt 0, samples 0 and 1
    assert by_index[2] == by_index[3] != by_index[0]
    echoed = client.completions.create(
        model="stories", prompt="Once upon a time", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Once upon a time, there was a"
    stream = client.completions.create(
        model="stories", prompt="Once upon a time", max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == echoed.choices[0].text


def test_cached_prompt_tokens_are_reported(client):
    prompt = "The old lighthouse keeper counted the waves every night. " * 6  # several KV blocks
    first = client.completions.create(model="stories", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="stories", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and first.usage.prompt_tokens - 16 <= cached < first.usage.prompt_tokens


def test_chat_on_a_base_model_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}])
    assert error.value.status_code == 400
    assert "no chat template" in error.value.message and "base model" in error.value.message


# ---- chat ----------------------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "Tell me about the engine."},
]


def offline_chat(engine: LLMEngine, params: SamplingParams):
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    return engine.generate([prompt], params)[0]


def test_chat_completion_matches_the_offline_engine(chat_client, tiny_engine):
    r = chat_client.chat.completions.create(model="tiny-random-llama", messages=MESSAGES, max_tokens=8, temperature=0)
    expected = offline_chat(tiny_engine, SamplingParams(max_tokens=8, temperature=0))
    assert r.object == "chat.completion"
    message = r.choices[0].message
    assert message.role == "assistant" and message.content == expected.outputs[0].text
    assert r.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_chat(chat_client):
    kwargs = dict(model="tiny-random-llama", messages=MESSAGES, max_tokens=8, temperature=0)
    whole = chat_client.chat.completions.create(**kwargs)
    chunks = list(chat_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_answers_use_the_context_left_by_default(chat_client):
    r = chat_client.chat.completions.create(
        model="tiny-random-llama", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 64  # the server's --max-model-len
    capped = chat_client.chat.completions.create(
        model="tiny-random-llama",
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert capped.usage.completion_tokens == 3


def test_chat_logprobs_and_seeded_samples(chat_client, tiny_engine):
    r = chat_client.chat.completions.create(
        model="tiny-random-llama",
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    expected = offline_chat(tiny_engine, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3))
    assert [c.logprob for c in content] == pytest.approx(expected.outputs[0].logprobs)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)

    def sample() -> list[str]:
        s = chat_client.chat.completions.create(
            model="tiny-random-llama",
            messages=MESSAGES,
            max_tokens=6,
            temperature=1.0,
            n=2,
            seed=11,
            extra_body={"ignore_eos": True},
        )
        return [c.message.content for c in sorted(s.choices, key=lambda c: c.index)]

    first = sample()
    assert len(first) == 2 and sample() == first
    seeded = offline_chat(tiny_engine, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True))
    assert [o.text for o in seeded.outputs] == first
