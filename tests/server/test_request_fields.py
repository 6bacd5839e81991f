"""The request fields of the issue, each checked for its effect end to end with the official ``openai``
client against a real ``llmctl serve`` of the random-weight model, on a KV pool small enough
(16 blocks of 16 tokens) that concurrent constrained requests get preempted.

Seeded sampling is batch-invariant, so "the same request alone" is the reference for what a
request must answer when batched, prefix-cached or preempted."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from server_helpers import scrape, wait_until
from structured_schemas import PERSON

from llmctl.models.embedded import embedded_tokenizer

MODEL = "tiny-random-llama"
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
EOS = min(embedded_tokenizer().eos_token_ids)
FORCED = embedded_tokenizer().encode(" engine", add_special_tokens=False)[0]
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(start_server):
    # 16 blocks x 16 tokens (a tiny-random-llama block is 256 KiB in fp32)
    return start_server(MODEL, "--max-model-len", "256", "--kv-cache-memory", "4MiB", "--dtype", "float32")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def chat(client, **kwargs):
    kwargs.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, **kwargs)


def test_stop_token_ids_and_min_tokens(client):
    r = chat(client, max_tokens=10, logit_bias={str(FORCED): 100}, extra_body={"stop_token_ids": [FORCED]})
    choice = r.choices[0]
    assert (choice.finish_reason, choice.stop_reason, r.usage.completion_tokens) == ("stop", FORCED, 1)
    held = chat(
        client, max_tokens=10, logit_bias={str(FORCED): 100}, extra_body={"stop_token_ids": [FORCED], "min_tokens": 3}
    )
    assert held.usage.completion_tokens == 4 and held.choices[0].stop_reason == FORCED


def test_ignore_eos_and_max_completion_tokens(client):
    eos_forced = dict(logit_bias={str(EOS): 100}, temperature=0)
    assert chat(client, max_tokens=10, **eos_forced).usage.completion_tokens == 1
    r = chat(client, max_completion_tokens=6, max_tokens=50, extra_body={"ignore_eos": True}, **eos_forced)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (6, "length")  # max_completion_tokens wins


def test_include_usage_with_n_and_structured_output(client):
    kwargs = dict(response_format=PERSON_FORMAT, n=2, seed=3, max_tokens=150)
    whole = chat(client, **kwargs)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {c.index: c.message.content for c in whole.choices}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_top_logprobs_on_chat_stream_as_they_come(client):
    kwargs = dict(max_tokens=6, logprobs=True, top_logprobs=4, seed=2, extra_body={"ignore_eos": True})
    whole = chat(client, **kwargs).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in chat(client, stream=True, **kwargs)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
    assert all(len(e.top_logprobs) == 4 for e in streamed)


def test_structured_outputs_hit_the_prefix_cache(client):
    kwargs = dict(
        response_format=PERSON_FORMAT,
        seed=8,
        max_tokens=150,
        messages=[{"role": "user", "content": "A person, please."}],
    )
    first, second = chat(client, **kwargs), chat(client, **kwargs)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    jsonschema.validate(json.loads(second.choices[0].message.content), PERSON)


def test_structured_outputs_survive_preemption(client, server):
    """Six constrained requests need more than the pool's 16 blocks at once: some are preempted and
    recomputed; each still answers exactly what it answers alone, valid under the schema."""
    requests = [
        dict(
            response_format=PERSON_FORMAT,
            seed=40 + i,
            max_tokens=150,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"Person number {i}, please."}],
        )
        for i in range(6)
    ]
    alone = [chat(client, **kwargs).choices[0].message.content for kwargs in requests]
    with httpx.Client(base_url=server.url) as http:
        before = scrape(http)["llmctl:num_preemptions"]["llmctl:num_preemptions_total"]
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda kwargs: chat(client, **kwargs).choices[0].message.content, requests))
        after = scrape(http)["llmctl:num_preemptions"]["llmctl:num_preemptions_total"]
        assert after > before
        assert together == alone
        for text in together:
            jsonschema.validate(json.loads(text), PERSON)
        wait_until(lambda: scrape(http)["llmctl:kv_cache_usage_perc"]["llmctl:kv_cache_usage_perc"] == 0)


# ---- vLLM's other sampling controls: allowed_token_ids, bad_words, truncate_prompt_tokens ----------


def completion(client, prompt, **extra_body):
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, **extra_body},
    ).choices[0]


def test_allowed_token_ids_is_all_that_is_sampled(client):
    allowed = embedded_tokenizer().encode(" cat dog engine", add_special_tokens=False)
    r = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=16,
        n=3,
        seed=4,
        temperature=1.5,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    texts = {embedded_tokenizer().decode([t]) for t in allowed}  # whole ASCII tokens: one text each
    for choice in r.choices:
        assert len(choice.logprobs.tokens) == 16 and set(choice.logprobs.tokens) <= texts, choice.logprobs.tokens
    assert len({c.text for c in r.choices}) > 1  # sampled, not one forced token


def test_bad_words_are_never_generated(client):
    tokenizer = embedded_tokenizer()
    free = completion(client, "Once upon a time")
    word = "".join(free.logprobs.tokens[:2])  # the first two tokens, as one (multi-token) word
    banned = completion(client, "Once upon a time", bad_words=[word])
    ids = tokenizer.encode(banned.text, add_special_tokens=False)
    word_ids = tokenizer.encode(word, add_special_tokens=False)
    assert not any(ids[i : i + len(word_ids)] == word_ids for i in range(len(ids)))
    assert banned.text != free.text


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    tokenizer = embedded_tokenizer()
    prompt = tokenizer.encode("One two three four five six seven eight nine ten", add_special_tokens=False)
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True},
    )
    short = client.completions.create(
        model=MODEL, prompt=prompt[-5:], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == short.choices[0].text
    answer = chat(client, max_tokens=4, extra_body={"truncate_prompt_tokens": 3})
    assert answer.usage.prompt_tokens == 3


@pytest.mark.parametrize(
    "extra_body, param",
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),  # the whole vocabulary: past the engine's cap
        ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ({"logits_processors": ["my.module:Processor"]}, "logits_processors"),
        ({"echo": True}, "echo"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_what_would_change_the_output_unimplemented_is_refused_not_ignored(client, extra_body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, max_tokens=2, extra_body=extra_body)
    assert refused.value.body["param"] == param
