"""``top --url`` against servers that are not (quite) llmctl: a vLLM-compatible server with only
/metrics is drawn from it; anything else, and a wrong API key, get their own one-line state
instead of "disconnected — retrying" forever."""

from __future__ import annotations

import httpx
import pytest
from tui_helpers import drive, shown_text

from llmctl.tui.app import TopApp
from llmctl.tui.requests_table import RequestsTable
from llmctl.tui.sources import HttpSource, SourceError
from llmctl.tui.vllm_metrics import histogram_quantile

URL = "http://vllm.test:8000"


def vllm_metrics(generated: int, prompt: int, running: int, waiting: int, usage: float, finished: int) -> str:
    """/metrics as vLLM writes it (names, types and labels of vLLM 0.x's Prometheus exporter)."""
    labels = 'engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"'
    return f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{labels}}} {running}.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{labels}}} {waiting}.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{labels}}} {usage}
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="400"}} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{{labels}}} {prompt}.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{{labels}}} {generated}.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{{labels},finished_reason="stop"}} {finished}.0
vllm:request_success_total{{{labels},finished_reason="length"}} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} 2.0
vllm:time_to_first_token_seconds_bucket{{{labels},le="0.5"}} 8.0
vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 10.0
vllm:time_to_first_token_seconds_count{{{labels}}} 10.0
vllm:time_to_first_token_seconds_sum{{{labels}}} 2.5
"""


def transport(routes: dict[str, tuple[int, str]]) -> httpx.MockTransport:
    """Answers each path from ``routes`` (a callable value is called per request)."""

    def handle(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(request.url.path, (404, "Not Found"))
        if callable(body):
            body = body()
        return httpx.Response(status, text=body)

    return httpx.MockTransport(handle)


def test_a_vllm_server_is_drawn_from_its_metrics():
    scrapes = iter([vllm_metrics(1000, 5000, 8, 3, 0.25, 4), vllm_metrics(1600, 5600, 12, 5, 0.5, 6)])
    source = HttpSource(URL, transport=transport({"/metrics": (200, lambda: next(scrapes))}))

    async def scenario(app, pilot):
        await app.poll_once()
        snap = app.state.snapshot
        assert app.state.connected and snap["model"] == "Qwen/Qwen2.5-0.5B-Instruct"
        assert snap["scheduler"] == {"running": 8, "waiting": 3, "preempted_waiting": 0}
        assert snap["kv"]["num_blocks"] == 400 and snap["kv"]["used"] == 100 and snap["kv"]["usage"] == 0.25
        assert snap["counters"]["requests_finished"] == {"stop": 4, "length": 1}
        await app.poll_once()
        await pilot.pause()
        assert app.state.snapshot["scheduler"]["running"] == 12 and app.state.snapshot["kv"]["used"] == 200
        assert app.state.rates.output_tokens_per_s > 0  # 600 more generated tokens between scrapes
        status = shown_text(app.query_one("#status"))
        assert status.strip().startswith("● live") and "(vLLM /metrics)" in status
        assert "running 12 · waiting 5" in shown_text(app.query_one("#batch-summary"))
        assert "usage 50.0%" in shown_text(app.query_one("#kv-summary"))
        assert "TTFT" in shown_text(app.query_one("#latency"))
        assert app.query_one(RequestsTable).row_count == 0
        assert not app.query_one("#banner").display

    drive(TopApp(source, interval=None), scenario)


@pytest.mark.parametrize(
    ("routes", "kind", "message"),
    [
        ({}, "not llmctl", f"{URL} is not an llmctl server: it has no /v1/engine/stats, and no vLLM metrics"),
        (
            {"/metrics": (200, "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.0\n")},
            "not llmctl",
            "is not an llmctl server",
        ),
        (
            {"/v1/engine/stats": (401, '{"error": {"message": "bad key"}}')},
            "unauthorized",
            "HTTP 401 from http://vllm.test:8000/v1/engine/stats: wrong or missing API key (pass --api-key or set "
            "LLMCTL_API_KEY)",
        ),
    ],
)
def test_other_servers_and_a_wrong_key_say_what_they_are(routes, kind, message):
    source = HttpSource(URL, transport=transport(routes))

    async def scenario(app, pilot):
        await app.poll_once()
        await pilot.pause()
        assert app.state.error_kind == kind and message in app.state.error
        banner = shown_text(app.query_one("#banner"))
        assert "disconnected" not in banner and message[:40] in banner
        assert shown_text(app.query_one("#status")).strip().startswith(f"⚠ {kind}")

    drive(TopApp(source, interval=None), scenario)


def test_unreachable_is_still_disconnected():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    async def scenario(app, pilot):
        await app.poll_once()
        await pilot.pause()
        assert app.state.error_kind == "disconnected"
        assert "disconnected — retrying (ConnectError" in shown_text(app.query_one("#banner"))

    drive(TopApp(HttpSource(URL, transport=httpx.MockTransport(refuse)), interval=None), scenario)


def test_histogram_quantile_interpolates_inside_the_bucket():
    buckets = [(0.1, 2.0), (0.5, 8.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / 6)
    assert histogram_quantile(0.99, buckets) == 0.5  # in the +Inf bucket: its lower bound
    assert histogram_quantile(0.5, []) is None
    assert SourceError("x").kind == "disconnected"
