"""Clients that go away free their KV blocks at once; 200 concurrent requests all succeed and
each answer equals the offline engine's for the same seed."""

from __future__ import annotations

import asyncio

import httpx
import openai
from server_helpers import API_KEY, scrape, wait_until

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

ABORTED = 'llmctl:request_success_total{"finished_reason": "abort", "model_name": "stories"}'
LENGTH = 'llmctl:request_success_total{"finished_reason": "length", "model_name": "stories"}'


def engine_idle(http: httpx.Client) -> bool:
    metrics = scrape(http)
    return (
        metrics["llmctl:kv_cache_usage_perc"]["llmctl:kv_cache_usage_perc"] == 0
        and metrics["llmctl:num_requests_running"]["llmctl:num_requests_running"] == 0
        and metrics["llmctl:num_requests_waiting"]["llmctl:num_requests_waiting"] == 0
    )


def test_dropped_streams_free_their_blocks(stories_server, http):
    before = scrape(http)["llmctl:request_success"]
    aborted_before, length_before = before[ABORTED], before.get(LENGTH, 0.0)
    body = {
        "model": "stories",
        "prompt": "Once upon a time",
        "max_tokens": 500,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
    }

    async def drop_mid_stream(client: httpx.AsyncClient, i: int) -> int:
        events = 0
        async with client.stream("POST", "/v1/completions", json={**body, "seed": i}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
        return events

    async def main() -> list[int]:
        async with httpx.AsyncClient(
            base_url=stories_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        ) as client:
            return await asyncio.gather(*(drop_mid_stream(client, i) for i in range(20)))

    assert asyncio.run(main()) == [3] * 20
    wait_until(lambda: engine_idle(http))
    # Each dropped stream is aborted, unless the engine ran it to its end before the server saw the
    # client go (500 tokens of this 260K-parameter model take well under a second): every one is
    # accounted for, at least one of them aborted, and no block is left behind.
    after = scrape(http)["llmctl:request_success"]
    aborted, finished = after[ABORTED] - aborted_before, after.get(LENGTH, 0.0) - length_before
    assert aborted + finished == 20 and aborted >= 1
    stats = http.get("/v1/engine/stats").json()
    assert stats["kv"]["used"] == stats["kv"]["shared"] == 0 and stats["requests"] == []
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ", there was a little"


def test_a_client_that_gives_up_waiting_aborts_its_request(stories_server, http):
    aborted_before = scrape(http)["llmctl:request_success"][ABORTED]
    body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "n": 4}
    with httpx.Client(
        base_url=stories_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.05
    ) as impatient:
        try:
            impatient.post("/v1/completions", json=body)
        except httpx.ReadTimeout:
            pass
        else:
            raise AssertionError("the request finished before the client gave up; make it longer")
    wait_until(lambda: engine_idle(http))
    assert scrape(http)["llmctl:request_success"][ABORTED] - aborted_before == 1


def load_params(i: int) -> dict:
    """Greedy and seeded sampling, mixed, with different lengths and stop strings."""
    params = {"max_tokens": 8 + i % 9}
    if i % 2:
        params |= {"temperature": 0}
    else:
        params |= {"temperature": 0.9, "top_p": 0.9, "seed": 1000 + i}
    if i % 5 == 0:
        params["stop"] = ["."]
    return params


def test_200_concurrent_requests_equal_the_offline_engine(stories_server, stories_dir):
    subjects = ["a little girl", "a big dog", "Tom", "the sun", "a red ball", "Lily and Ben", "a cat", "the park"]
    prompts = [f"Once upon a time, {subjects[i % len(subjects)]} {'went' if i % 3 else 'saw'}" for i in range(200)]

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=stories_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(
                *(
                    client.completions.create(model="stories", prompt=p, user=f"user{i % 4}", **load_params(i))
                    for i, p in enumerate(prompts)
                )
            )

    answers = asyncio.run(main())  # any error raises here: max_retries=0 hides nothing
    offline = LLMEngine(model=str(stories_dir), kv_cache_memory=64 << 20).generate(
        prompts, [SamplingParams(**load_params(i)) for i in range(200)]
    )
    assert [a.choices[0].text for a in answers] == [o.outputs[0].text for o in offline]
    assert [a.choices[0].finish_reason for a in answers] == [o.outputs[0].finish_reason for o in offline]
    assert [a.usage.completion_tokens for a in answers] == [len(o.outputs[0].token_ids) for o in offline]
