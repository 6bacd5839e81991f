"""Two real ``llmctl serve`` replicas serving different models behind a real ``llmctl router``:
a request goes to the replica that serves its ``model`` (the policy choosing among those that do),
``/v1/models`` is the union of theirs, and a model no replica serves is a clear 404."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from router_helpers import Process, metric_value, start_replicas, start_router


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("models")
    for name in ("alpha", "beta"):
        (log_dir / name).mkdir()
    processes: list[Process] = []
    try:
        alpha = start_replicas(1, log_dir / "alpha", "--served-model-name", "alpha")
        processes += alpha
        beta = start_replicas(1, log_dir / "beta", "--served-model-name", "beta")
        processes += beta
        router = start_router([alpha[0].url, beta[0].url], log_dir)
        processes.append(router)
        yield {"alpha": alpha[0], "beta": beta[0], "router": router}
    finally:
        for process in processes:
            process.kill()


def requests_served(url: str, model: str) -> float:
    return sum(
        metric_value(url, "llmctl:request_success_total", finished_reason=reason, model_name=model)
        for reason in ("stop", "length")
    )


def test_requests_go_to_the_replica_that_serves_their_model(cluster):
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="none", max_retries=0, timeout=120)
    assert sorted(m.id for m in client.models.list().data) == ["alpha", "beta"]
    for model in ("alpha", "beta", "alpha", "beta", "beta"):
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        assert answer.model == model
        streamed = client.completions.create(model=model, prompt="hi", max_tokens=2, stream=True)
        assert {chunk.model for chunk in streamed} == {model}
    assert requests_served(cluster["alpha"].url, "alpha") == 4
    assert requests_served(cluster["beta"].url, "beta") == 6
    table = httpx.get(f"{cluster['router'].url}/router/replicas").json()["replicas"]
    assert sorted(tuple(r["models"]) for r in table) == [("alpha",), ("beta",)]


def test_a_model_no_replica_serves_is_a_404_and_nothing_is_forwarded(cluster):
    client = openai.OpenAI(base_url=f"{cluster['router'].url}/v1", api_key="none", max_retries=0, timeout=120)
    before = [requests_served(cluster[m].url, m) for m in ("alpha", "beta")]
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    body = error.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "gamma" in body["message"] and "alpha, beta" in body["message"]
    # no model named: any replica, as before
    plain = httpx.post(f"{cluster['router'].url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert plain.status_code == 200 and plain.json()["model"] in ("alpha", "beta")
    after = [requests_served(cluster[m].url, m) for m in ("alpha", "beta")]
    assert sum(after) - sum(before) == 1
