"""``/health``, Prometheus ``/metrics`` under ``llmctl:`` names, and the engine stats that
``llmctl top`` reads (a snapshot and a stream)."""

from __future__ import annotations

import json
import threading

from server_helpers import scrape, wait_until

from llmctl.engine.stats import STATS_VERSION

GAUGES = ("llmctl:kv_cache_usage_perc", "llmctl:num_requests_running", "llmctl:num_requests_waiting")
COUNTERS = (
    "llmctl:prefix_cache_queries",
    "llmctl:prefix_cache_hits",
    "llmctl:num_preemptions",
    "llmctl:prompt_tokens",
    "llmctl:generation_tokens",
    "llmctl:request_success",
    "llmctl:spec_decode_num_drafts",
    "llmctl:spec_decode_num_draft_tokens",
    "llmctl:spec_decode_num_accepted_tokens",
)
HISTOGRAMS = (
    "llmctl:time_to_first_token_seconds",
    "llmctl:inter_token_latency_seconds",
    "llmctl:e2e_request_latency_seconds",
    "llmctl:iteration_tokens_total",
)


def test_metrics_exposition(http):
    before = scrape(http)
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 7, "temperature": 0})
    assert r.status_code == 200
    after = scrape(http)
    for name in GAUGES:
        assert after[name]["type"] == "gauge"
    for name in COUNTERS:
        assert after[name]["type"] == "counter"
    for name in HISTOGRAMS:
        assert after[name]["type"] == "histogram"

    def grew(family: str, sample: str) -> float:
        return after[family][sample] - before[family][sample]

    assert grew("llmctl:generation_tokens", "llmctl:generation_tokens_total") == 7
    assert grew("llmctl:prompt_tokens", "llmctl:prompt_tokens_total") == 5
    assert grew("llmctl:prefix_cache_queries", "llmctl:prefix_cache_queries_total") == 5
    assert grew("llmctl:time_to_first_token_seconds", "llmctl:time_to_first_token_seconds_count") == 1
    assert grew("llmctl:inter_token_latency_seconds", "llmctl:inter_token_latency_seconds_count") == 6
    assert grew("llmctl:e2e_request_latency_seconds", "llmctl:e2e_request_latency_seconds_count") == 1
    length = 'llmctl:request_success_total{"finished_reason": "length", "model_name": "stories"}'
    assert grew("llmctl:request_success", length) == 1
    # one request alone: 7 steps, one prefill of 5 tokens then 6 single-token decodes
    assert grew("llmctl:iteration_tokens_total", "llmctl:iteration_tokens_total_count") == 7
    assert grew("llmctl:iteration_tokens_total", "llmctl:iteration_tokens_total_sum") == 5 + 6
    assert after["llmctl:kv_cache_usage_perc"]["llmctl:kv_cache_usage_perc"] == 0


def test_health(http):
    assert http.get("/health").json() == {"status": "ok"}


def test_stats_snapshot_shows_a_running_request(http):
    done = threading.Event()

    def long_request() -> None:
        http.post(
            "/v1/completions",
            json={
                "prompt": "Once upon a time",
                "max_tokens": 400,
                "ignore_eos": True,
                "temperature": 0,
                "user": "alice",
            },
        )
        done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    try:

        def running() -> dict | None:
            stats = http.get("/v1/engine/stats", params={"max_steps": 5}).json()
            return stats if any(r["user"] == "alice" and r["state"] == "running" for r in stats["requests"]) else None

        stats = wait_until(running)
        (request,) = [r for r in stats["requests"] if r["user"] == "alice"]
        assert request["prompt_tokens"] == 5 and request["blocks"]
        assert all(stats["kv"]["block_states"][b] in "us" for b in request["blocks"])
        assert len(stats["kv"]["block_states"]) == stats["kv"]["num_blocks"] == stats["config"]["num_blocks"]
        assert stats["config"]["kv_cache_dtype"] == "auto" and stats["config"]["kv_bytes_per_token"] > 0
        assert 0 < len(stats["steps"]) <= 5
        assert {"prefill_tokens", "decode_tokens", "num_seqs"} <= set(stats["steps"][0])
        assert stats["server"]["served_model_name"] == "stories" and stats["server"]["in_flight"] >= 1
    finally:
        thread.join(timeout=60)
    assert done.is_set()


def test_stats_stream(http):
    events = []
    with http.stream("GET", "/v1/engine/stats/stream", params={"interval": 0.1, "max_steps": 1}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
            if len(events) == 3:
                break
    assert [e["version"] for e in events] == [STATS_VERSION] * 3
    assert events[0]["time"] < events[1]["time"] < events[2]["time"]
    assert http.get("/v1/engine/stats/stream", params={"interval": 0}).status_code == 400
