"""Many models behind one ``llmctl serve``: requests pick a model by name, each loads on its first
request, unloads after its keep-alive (or at once with ``keep_alive: 0``), the least recently used
idle one is evicted when a new one does not fit ``--memory-budget`` (never a busy one), a model
that fails to load errors its own requests only, and ``llmctl ps`` / ``llmctl stop`` manage them.
Real servers, the real ``openai`` and ``ollama`` clients, the real CLI."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import wait_until
from typer.testing import CliRunner

from llmctl.cli import app

pytestmark = pytest.mark.timeout(600)


def status(server) -> dict[str, dict]:
    models = httpx.get(f"{server.base_url}/models/status", timeout=30).json()["models"]
    return {m["name"]: m for m in models}


def loaded(server) -> set[str]:
    return {name for name, m in status(server).items() if m["loaded"]}


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})
    return result.exit_code, re.sub(r"\x1b\[[0-9;]*m", "", result.output)


class Stream:
    """A long streamed completion in a thread, held open until ``close``."""

    def __init__(self, server, model: str, max_tokens: int, **extra) -> None:
        self.first = threading.Event()
        self.done = threading.Event()
        self.events: list[dict] = []
        self._stop = threading.Event()
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True}
        body |= {"stream": True, "temperature": 0, **extra}
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()
        assert self.first.wait(120), "the stream never started"

    def _run(self, server, body: dict) -> None:
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))
                    self.first.set()
                if self._stop.is_set():
                    break
        self.done.set()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=120)


# ---- one server: three models on the command line and a config file, one of them broken ----------
@pytest.fixture(scope="module")
def many(start_server, stories_dir, tiny_chat_model, tmp_path_factory):
    config = tmp_path_factory.mktemp("many") / "models.yaml"
    config.write_text(
        f"models:\n"
        f"  - name: chat\n    model: {tiny_chat_model}\n    max_model_len: 128\n"
        f"  - name: random\n    model: tiny-random-llama\n    max-model-len: 1024\n    dtype: float32\n"
    )
    return start_server(
        f"stories={stories_dir}", "broken=/nonexistent/model-dir", "--config", str(config), "--kv-cache-memory", "16MiB"
    )


def test_every_model_is_listed_and_none_loads_before_it_is_asked_for(many):
    models = openai.OpenAI(base_url=many.base_url, api_key="none").models.list()
    assert [m.id for m in models.data] == ["stories", "broken", "chat", "random"]
    assert all(m.model_dump()["loaded"] is False for m in models.data)
    assert loaded(many) == set()
    tags = ollama.Client(host=many.url).list()
    assert {m.model for m in tags.models} == {"stories", "broken", "chat", "random"}
    assert ollama.Client(host=many.url).ps().models == []


def test_requests_pick_the_model_by_name_and_load_it_on_first_use(many):
    client = openai.OpenAI(base_url=many.base_url, api_key="none")
    answer = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert answer.model == "stories" and "there was" in answer.choices[0].text
    assert loaded(many) == {"stories"}  # the others are still not loaded
    reply = ollama.Client(host=many.url).chat(
        model="chat:latest", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4}
    )
    assert reply.done and reply.eval_count == 4
    assert loaded(many) == {"stories", "chat"}
    running = ollama.Client(host=many.url).ps().models
    assert {m.model for m in running} == {"stories", "chat"}
    assert all(m.expires_at.year < 9999 for m in running)  # 5 minutes from now, not "never"
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3
    )
    assert chat.model == "chat" and chat.usage.completion_tokens == 3
    # the wait for each load is in /metrics and in the engine stats; the second request did not wait
    with httpx.Client(base_url=many.url, timeout=30) as http:
        metrics = {
            (sample.name, sample.labels.get("model_name")): sample.value
            for family in text_string_to_metric_families(http.get("/metrics").text)
            for sample in family.samples
            if "le" not in sample.labels and "reason" not in sample.labels
        }
        stats = http.get("/v1/engine/stats", params={"model": "stories", "max_steps": 0}).json()
    assert metrics["llmctl:model_load_wait_seconds_count", "stories"] == 1
    assert metrics["llmctl:model_load_wait_seconds_count", "chat"] == 1
    assert metrics["llmctl:model_load_wait_seconds_sum", "chat"] > 0
    assert metrics["llmctl:model_loaded", "chat"] == 1 and metrics["llmctl:model_loaded", "random"] == 0
    # every loaded model's engine metrics, one family each, a series per model
    assert metrics["llmctl:generation_tokens_total", "stories"] == 8
    assert metrics["llmctl:generation_tokens_total", "chat"] == 7
    assert stats["server"]["served_model_name"] == "stories" and stats["kv"]["usage"] >= 0
    by_name = {m["name"]: m for m in stats["server"]["models"]}
    assert by_name["stories"]["loads"] == 1 and by_name["stories"]["last_load_s"] > 0


def test_an_unknown_model_is_each_apis_404(many):
    with pytest.raises(openai.NotFoundError) as caught:
        openai.OpenAI(base_url=many.base_url, api_key="none").completions.create(
            model="gpt-4o", prompt="hi", max_tokens=1
        )
    assert caught.value.body["code"] == "model_not_found" and "stories" in caught.value.body["message"]
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=many.url).generate(model="llama3", prompt="hi")
    assert caught.value.status_code == 404
    response = httpx.post(
        f"{many.url}/v1/messages",
        json={"model": "claude", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
    )
    assert response.status_code == 404 and response.json()["type"] == "error"


def test_a_model_that_fails_to_load_errors_only_its_requests(many):
    client = openai.OpenAI(base_url=many.base_url, api_key="none", max_retries=0)
    for attempt in (1, 2):  # each request tries again, and says why it failed
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="broken", prompt="hi", max_tokens=1)
        assert caught.value.body["code"] == "model_load_failed"
        assert "/nonexistent/model-dir" in caught.value.body["message"]
        assert status(many)["broken"]["load_failures"] == attempt
    answer = client.completions.create(model="stories", prompt="Once", max_tokens=2)
    assert answer.usage.completion_tokens == 2
    assert httpx.get(f"{many.url}/health").json() == {"status": "ok"}


def test_keep_alive_0_unloads_the_model_after_the_answer(many):
    ollama.Client(host=many.url).generate(model="chat", prompt="hi", options={"num_predict": 2}, keep_alive=0)
    wait_until(lambda: "chat" not in loaded(many), timeout=30)
    assert status(many)["chat"]["unloads"]["expired"] >= 1
    client = openai.OpenAI(base_url=many.base_url, api_key="none")
    client.completions.create(model="stories", prompt="Once", max_tokens=2, extra_body={"keep_alive": 0})
    wait_until(lambda: "stories" not in loaded(many), timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="stories", prompt="Once", max_tokens=2, extra_body={"keep_alive": "soon"})
    assert caught.value.body["param"] == "keep_alive"


def test_ps_and_stop_through_the_cli(many):
    ollama.Client(host=many.url).generate(model="chat", prompt="hi", options={"num_predict": 2}, keep_alive="-1")
    code, text = cli("ps", "--url", many.url)
    assert code == 0, text
    row = next(line for line in text.splitlines() if line.strip().startswith("chat"))
    assert "idle" in row and "never" in row and "MiB" in row  # kept until stopped
    assert "broken" not in text  # ps shows what is loaded; --all every model
    code, text = cli("ps", "--url", many.url, "--all")
    assert "broken" in text and "failed" in text
    code, text = cli("stop", "chat", "--url", many.url)
    assert code == 0 and "stopped chat" in text
    assert "chat" not in loaded(many)
    code, text = cli("stop", "chat", "--url", many.url)
    assert code == 0 and "was not loaded" in text
    code, text = cli("stop", "nothing", "--url", many.url)
    assert code == 1 and "404" in text


def test_stop_refuses_a_busy_model_unless_forced(many):
    stream = Stream(many, "random", 1000)
    try:
        assert status(many)["random"]["in_flight"] == 1
        code, text = cli("ps", "--url", many.url)
        assert "busy" in text
        code, text = cli("stop", "random", "--url", many.url)
        assert code == 1 and "409" in text and "--force" in text
        assert "random" in loaded(many)
        code, text = cli("stop", "random", "--url", many.url, "--force")
        assert code == 0 and "stopped random (cancelled 1 request)" in text, text
        assert stream.done.wait(60)
        assert "error" in stream.events[-1] and "stopped" in stream.events[-1]["error"]["message"]
        assert "random" not in loaded(many)
    finally:
        stream.close()
    # the next request loads it again
    answer = openai.OpenAI(base_url=many.base_url, api_key="none").completions.create(
        model="random", prompt="x", max_tokens=1
    )
    assert answer.model == "random" and status(many)["random"]["loads"] == 2


def test_unloading_frees_the_memory(many):
    """Loosely: loading and unloading a 24M-parameter model again and again does not grow the RSS
    by a model's worth of memory per cycle."""

    def rss() -> int:
        text = Path(f"/proc/{many.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024

    def cycle() -> None:
        ollama.Client(host=many.url).generate(model="random", prompt="x", options={"num_predict": 1}, keep_alive=0)
        wait_until(lambda: "random" not in loaded(many), timeout=30)

    cycle()
    before = rss()
    for _ in range(4):
        cycle()
    model_bytes = status(many)["random"]["size_bytes"]
    assert model_bytes > 90 * 2**20  # fp32 weights + KV pool
    assert rss() - before < model_bytes, (before, rss())


# ---- a memory budget and a short keep-alive, from a JSON config file ---------------------------------
@pytest.fixture(scope="module")
def budget(start_server, stories_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("budget") / "models.json"
    config.write_text(
        json.dumps(
            {
                "keep_alive": "4s",
                "memory_budget": "130MiB",
                "models": [
                    {"name": "small", "model": str(stories_dir), "kv_cache_memory": "8MiB"},
                    {"name": "random", "model": "tiny-random-llama", "kv_cache_memory": "32MiB", "max_model_len": 1024},
                    {"name": "huge", "model": str(stories_dir), "kv_cache_memory": "256MiB"},
                ],
            }
        )
    )
    return start_server(f"--config={config}", "--dtype", "float32")


def _ask(server, model: str, **extra) -> dict:
    body = {"model": model, "prompt": "Once", "max_tokens": 1, **extra}
    response = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_short_keep_alive_unloads_an_idle_model(budget):
    _ask(budget, "small")
    assert status(budget)["small"]["loaded"]
    wait_until(lambda: not status(budget)["small"]["loaded"], timeout=30)
    assert status(budget)["small"]["unloads"]["expired"] >= 1


def test_the_least_recently_used_idle_model_is_evicted_when_a_new_one_does_not_fit(budget):
    _ask(budget, "small")
    _ask(budget, "random")  # small + random exceed the budget: small goes
    models = status(budget)
    assert models["random"]["loaded"] and not models["small"]["loaded"]
    assert models["small"]["unloads"].get("evicted", 0) >= 1
    assert models["random"]["size_bytes"] <= 130 * 2**20
    body = httpx.get(f"{budget.base_url}/models/status").json()
    assert body["memory_budget_bytes"] == 130 * 2**20 and body["memory_used_bytes"] <= 130 * 2**20


def test_a_busy_model_is_never_evicted_the_new_one_waits(budget):
    stream = Stream(budget, "random", 1000, n=2)
    answered = threading.Event()
    result: dict = {}

    def ask_small() -> None:
        result["answer"] = _ask(budget, "small")
        answered.set()

    asker = threading.Thread(target=ask_small, daemon=True)
    try:
        asker.start()
        wait_until(lambda: status(budget)["small"]["waiting_for_load"] == 1, timeout=30)
        assert not stream.done.is_set()  # 2 x 1000 tokens: far from done
        models = status(budget)  # while random is busy it stays, and small waits
        assert models["random"]["loaded"] and models["random"]["in_flight"] == 1
        assert not models["small"]["loaded"] and not answered.is_set()
    finally:
        stream.close()  # random goes idle: it is evicted, and small loads
    assert answered.wait(120) and result["answer"]["model"] == "small"
    models = status(budget)
    assert models["small"]["loaded"] and not models["random"]["loaded"]


def test_a_model_larger_than_the_budget_is_a_503_at_once(budget):
    response = httpx.post(f"{budget.base_url}/completions", json={"model": "huge", "prompt": "x", "max_tokens": 1})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "model_too_large" and "--memory-budget" in error["message"]
    _ask(budget, "small")  # the others go on
