"""lm-evaluation-harness's ``local-completions`` model against a real ``llmctl serve``: the two
local tasks of ``benchmarks/quality/lm_eval_run.py`` on a few items of the random-weight model, offline
(lm-eval tokenizes through the server's ``/tokenize`` and ``/detokenize``).

What lm-eval computed is checked against the server asked directly with the official ``openai``
client: each choice's loglikelihood is the sum of the continuation's prompt logprobs, and each
generation is the greedy completion cut at the task's stop strings."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import REPO_ROOT

TASKS_DIR = REPO_ROOT / "benchmarks" / "data" / "lm_eval"
LIMIT = 3
pytestmark = pytest.mark.slow  # lm-eval's import and set-up take most of its ~30 s on a quiet machine


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        "tiny-random-llama", "--max-model-len", "256", "--kv-cache-memory", "32MiB", "--dtype", "float32"
    )


@pytest.fixture(scope="module")
def evaluated(server, monkeypatch_module):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch_module.chdir(REPO_ROOT)  # the task configs name their data relative to the repository
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch_module.setenv(name, "1")
    model_args = (
        f"base_url={server.base_url}/completions,model=tiny-random-llama,tokenizer_backend=remote,"
        "tokenized_requests=True,num_concurrent=2,max_retries=1,max_length=256"
    )
    return simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["llmctl_mc", "llmctl_qa"],
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        limit=LIMIT,
        batch_size=4,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def tokenize(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_loglikelihoods_are_the_servers_prompt_logprobs(evaluated, server, client):
    samples = evaluated["samples"]["llmctl_mc"]
    assert len(samples) == LIMIT
    for sample in samples:
        for (context, continuation), (loglikelihood, is_greedy) in zip(
            sample["arguments"], (r[0] for r in sample["resps"])
        ):
            context_ids, whole_ids = tokenize(server, context), tokenize(server, context + continuation)
            scored = (
                client.completions.create(
                    model="tiny-random-llama", prompt=whole_ids, echo=True, max_tokens=0, logprobs=1
                )
                .choices[0]
                .logprobs
            )
            start = len(context_ids)  # lm-eval splits context and continuation tokens this way
            assert loglikelihood == pytest.approx(sum(scored.token_logprobs[start:]), abs=1e-4)
            greedy = all(
                lp == max(top.values()) for lp, top in zip(scored.token_logprobs[start:], scored.top_logprobs[start:])
            )
            assert is_greedy == greedy
    acc = evaluated["results"]["llmctl_mc"]["acc,none"]
    assert 0 <= acc <= 1


def test_generations_are_the_greedy_completions(evaluated, server, client):
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    samples = evaluated["samples"]["llmctl_qa"]
    assert len(samples) == LIMIT
    for sample in samples:
        context, gen_kwargs = sample["arguments"][0]
        stop = [*gen_kwargs["until"], info["eos_token"]]  # lm-eval adds the EOS text to the stop strings
        direct = client.completions.create(
            model="tiny-random-llama",
            prompt=tokenize(server, context),
            temperature=0,
            max_tokens=gen_kwargs["max_gen_toks"],
            stop=stop,
        )
        assert sample["resps"][0][0] == direct.choices[0].text
    assert "exact_match,first_word" in evaluated["results"]["llmctl_qa"]


def test_tokenizer_endpoints_round_trip(server):
    text = "Once upon a time, 世界 🙂"
    tokens = tokenize(server, text)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"] == text
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == 256
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 2
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
