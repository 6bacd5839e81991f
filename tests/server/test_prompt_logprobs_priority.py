"""vLLM's ``prompt_logprobs`` and ``priority`` request fields against a real ``llmctl serve``, through
the official ``openai`` client (``extra_body``): the prompt's scores in vLLM's wire format, equal to
those echo + logprobs gives, and a waiting request with a lower ``priority`` started first."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch
from server_helpers import API_KEY, scrape, wait_until

PROMPT = "Once upon a time, the little dog said: “Héllo, 世界!”"


@pytest.fixture(scope="module")
def client(stories_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=stories_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_client(chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=chat_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def check_vllm_format(prompt_logprobs: list, num_prompt_tokens: int, num_top: int) -> None:
    """null first, then per position the prompt's own token (first key) and the top ``num_top``."""
    assert len(prompt_logprobs) == num_prompt_tokens and prompt_logprobs[0] is None
    for entry in prompt_logprobs[1:]:
        assert num_top <= len(entry) <= num_top + 1 or (num_top == 0 and len(entry) == 1)
        for token_id, logprob in entry.items():
            assert token_id.isdigit() and set(logprob) == {"logprob", "rank", "decoded_token"}
            assert logprob["logprob"] <= 0 and isinstance(logprob["decoded_token"], str)
        alternatives = sorted(entry.values(), key=lambda lp: -lp["logprob"])[:num_top]
        assert [lp["rank"] for lp in alternatives] == list(range(1, len(alternatives) + 1))


def test_completions_prompt_logprobs_equal_echo_logprobs(client):
    out = client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    choice = out.choices[0].model_dump()
    prompt_logprobs = choice["prompt_logprobs"]
    check_vllm_format(prompt_logprobs, out.usage.prompt_tokens, 2)
    echoed = client.completions.create(
        model="stories", prompt=PROMPT, echo=True, max_tokens=0, logprobs=2, temperature=0
    ).choices[0]
    assert echoed.model_dump()["prompt_logprobs"] is None  # only when asked
    lp = echoed.logprobs
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        own = next(iter(entry.values()))  # vLLM lists the prompt's own token first
        assert own["logprob"] == pytest.approx(lp.token_logprobs[position], abs=1e-6)
        assert sorted(v["logprob"] for v in entry.values()) == pytest.approx(
            sorted(lp.top_logprobs[position].values()), abs=1e-6
        )
        names = {v["decoded_token"] for v in entry.values()}  # echo's keys, but for "token_id:N" renames
        assert names >= {name for name in lp.top_logprobs[position] if not name.startswith("token_id:")}
        best = max(entry.values(), key=lambda v: v["logprob"])
        assert best["rank"] == 1 and (own["rank"] is None or own["rank"] >= 1)


def test_ranks_are_the_models(client, stories_dir):
    """A token's rank is its place in transformers' distribution (fp32); a prompt token ranked past
    the engine's top 20 has rank null."""
    from transformers import AutoModelForCausalLM

    from llmctl.tokenizer import Tokenizer

    prompt_ids = Tokenizer.from_dir(stories_dir).encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        rows = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, :-1].float(), dim=-1)
    out = client.completions.create(model="stories", prompt=prompt_ids, max_tokens=1, extra_body={"prompt_logprobs": 1})
    prompt_logprobs = out.model_dump()["choices"][0]["prompt_logprobs"]
    nulls = 0
    for row, token_id, entry in zip(rows, prompt_ids[1:], prompt_logprobs[1:]):
        want = 1 + int((row > row[token_id]).sum())
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(row[token_id].item(), abs=1e-4)
        assert own["rank"] == (want if want <= 20 else None)
        nulls += own["rank"] is None
        assert entry[str(int(row.argmax()))]["rank"] == 1
    assert 0 < nulls < len(prompt_ids) - 1  # this prompt has tokens on both sides of the cap


def test_prompt_logprobs_with_echo_n_and_several_prompts(client):
    """Each count keeps its own size: echo's logprobs 1, prompt_logprobs 3; every choice of a prompt
    carries that prompt's list."""
    prompts = ["The cat sat", "Lily went to the park and"]
    out = client.completions.create(
        model="stories",
        prompt=prompts,
        n=2,
        echo=True,
        logprobs=1,
        max_tokens=2,
        temperature=0.8,
        seed=3,
        extra_body={"prompt_logprobs": 3},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    lists = [c.model_dump()["prompt_logprobs"] for c in out.choices]
    assert lists[0] == lists[1] and lists[2] == lists[3] and lists[0] != lists[2]
    for i, choice in enumerate(out.choices):
        alone = client.completions.create(model="stories", prompt=prompts[i // 2], max_tokens=1, logprobs=1)
        num_prompt_tokens = alone.usage.prompt_tokens
        check_vllm_format(lists[i], num_prompt_tokens, 3)
        echoed = choice.logprobs
        assert echoed.token_logprobs[0] is None
        for position in range(1, num_prompt_tokens):
            assert 1 <= len(echoed.top_logprobs[position]) <= 2  # echo's own count, not prompt_logprobs'
            own = next(iter(lists[i][position].values()))
            assert own["logprob"] == pytest.approx(echoed.token_logprobs[position], abs=1e-6)


def test_chat_prompt_logprobs_are_on_the_response(chat_client):
    out = chat_client.chat.completions.create(
        model="tiny-random-llama",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=2,
        n=2,
        extra_body={"prompt_logprobs": 0},
    )
    body = out.model_dump()
    check_vllm_format(body["prompt_logprobs"], out.usage.prompt_tokens, 0)
    assert all("prompt_logprobs" not in c for c in body["choices"])
    plain = chat_client.chat.completions.create(
        model="tiny-random-llama", messages=[{"role": "user", "content": "hello there"}], max_tokens=1
    )
    assert plain.model_dump()["prompt_logprobs"] is None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": "1"}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ({"priority": "high"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"priority": None}, "priority"),
        ({"priority": False}, "priority"),
    ],
)
def test_bad_values_are_400s_naming_the_field(http, extra, param):
    for path, body in (
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):
        response = http.post(path, json={"model": "stories", **body, **extra})
        assert response.status_code == 400, (path, extra, response.text)
        assert response.json()["error"]["param"] == param, (path, response.json())
    wait_until(lambda: scrape(http)["llmctl:kv_cache_usage_perc"]["llmctl:kv_cache_usage_perc"] == 0)


# long requests that keep the one seat busy for a while (~0.25 s each on a fast CPU): all of them queued
# before the two under test arrive, so a busy machine's slow polling still finds both waiting
BLOCKERS = 32


def test_lower_priority_value_starts_first(start_server, stories_dir):
    """One sequence at a time: while long priority-0 requests hold the seat and wait for it, a
    priority 5 request is queued, then a -5 one; the -5 one gets its first token first (FCFS would
    have started the 5 one), and both after the blocker that was running."""
    server = start_server(
        str(stories_dir), "--max-num-seqs", "1", "--kv-cache-memory", "16MiB", "--served-model-name", "stories"
    )
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    first_token: dict[str, float] = {}

    def run(name: str, max_tokens: int, priority: int) -> None:
        stream = client.completions.create(
            model="stories",
            prompt="Once upon a time",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "priority": priority},
        )
        for _ in stream:
            first_token.setdefault(name, time.monotonic())

    with httpx.Client(base_url=server.url, timeout=60) as http:

        def priorities(*states: str) -> list[int]:
            stats = http.get("/v1/engine/stats").json()
            return sorted(r["priority"] for r in stats["requests"] if r["state"] in states)

        threads = [threading.Thread(target=run, args=(f"blocker{i}", 480, 0)) for i in range(BLOCKERS)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(priorities("waiting")) >= BLOCKERS - 1)
        for name, priority in (("late", 5), ("early", -5)):  # arrival order: 5 first
            threads.append(threading.Thread(target=run, args=(name, 4, priority)))
            threads[-1].start()
            # seen in the engine, or already answering: the -5 one takes the seat as soon as the
            # running blocker ends, which on a fast CPU can fall between two polls
            wait_until(lambda p=priority, n=name: p in priorities("waiting", "running") or n in first_token)
        assert 5 in priorities("waiting")  # the 5 one, queued first, still waits once the -5 one is in
        for thread in threads:
            thread.join(120)
        assert len(first_token) == BLOCKERS + 2
        assert min(first_token.values()) < first_token["early"] < first_token["late"]
        wait_until(lambda: scrape(http)["llmctl:kv_cache_usage_perc"]["llmctl:kv_cache_usage_perc"] == 0)
