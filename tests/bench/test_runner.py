"""The load generator: arrivals, the concurrency cap, and both targets on a real engine and server."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmctl.bench.datasets import BenchRequest, PromptFactory, shared_prefix_requests
from llmctl.bench.metrics import RequestRecord, summarize
from llmctl.bench.runner import HttpTarget, InProcessTarget, arrival_gaps, run_load
from llmctl.config import EngineConfig
from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine


class RecordingTarget:
    """Answers after a fixed delay and records when each request was sent and how many overlapped."""

    label = "fake"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.sent: list[float] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def send(self, request: BenchRequest) -> RequestRecord:
        start = time.perf_counter()
        self.sent.append(start)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        end = time.perf_counter()
        return RequestRecord(
            start=start, end=end, chunk_times=[end], prompt_tokens=request.prompt_len, output_tokens=request.output_len
        )


def requests(n: int) -> list[BenchRequest]:
    return [BenchRequest([5, 6, 7], 3, i + 1) for i in range(n)]


def test_arrival_gaps_are_a_seeded_poisson_process():
    assert arrival_gaps(4, float("inf"), 0) == [0.0] * 4
    gaps = arrival_gaps(4001, 20.0, seed=7)
    assert gaps[0] == 0 and all(g > 0 for g in gaps[1:])
    assert sum(gaps) / 4000 == pytest.approx(1 / 20, rel=0.05)  # mean gap 1/rate
    assert gaps == arrival_gaps(4001, 20.0, seed=7)
    assert gaps != arrival_gaps(4001, 20.0, seed=8)
    assert arrival_gaps(0, 1.0, 0) == []
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, 0)


def test_concurrency_cap_and_order():
    target = RecordingTarget(delay_s=0.02)
    result = asyncio.run(run_load(target, requests(12), concurrency=3))
    assert target.max_in_flight == 3
    assert [r.output_tokens for r in result.records] == list(range(1, 13))  # records in request order
    assert result.duration_s >= 4 * 0.02  # 12 requests, 3 at a time
    unlimited = RecordingTarget(delay_s=0.02)
    asyncio.run(run_load(unlimited, requests(12), concurrency=None))
    assert unlimited.max_in_flight == 12


def test_requests_are_not_sent_before_their_arrival_time():
    target = RecordingTarget(delay_s=0.0)
    started = time.perf_counter()
    asyncio.run(run_load(target, requests(8), concurrency=None, request_rate=100.0, seed=3))
    due = list(itertools.accumulate(arrival_gaps(8, 100.0, 3)))
    offsets = [t - started for t in target.sent]
    assert all(offset >= at - 1e-3 for offset, at in zip(offsets, due))
    assert offsets[-1] >= due[-1] > 0


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=256, num_threads=1))


def test_in_process_target_timelines_and_engine_stats(engine):
    factory = PromptFactory(engine.tokenizer, engine.model.config.vocab_size)
    workload = shared_prefix_requests(
        factory, 8, num_users=2, prefix_len=64, input_len=16, output_len=6, range_ratio=0.0, seed=0
    )
    too_long = BenchRequest(list(range(10, 10 + 300)), 300, 4)

    async def run():
        async_engine = AsyncEngine(engine).start()
        try:
            return await run_load(InProcessTarget(async_engine, ignore_eos=True), [*workload, too_long], concurrency=4)
        finally:
            async_engine.shutdown()

    result = asyncio.run(run())
    ok, failed = result.records[:8], result.records[8]
    for record in ok:
        assert record.succeeded and record.output_tokens == 6 and record.prompt_tokens == 80
        assert len(record.chunk_times) == 6  # one token per step reaches the client
        assert record.start <= record.chunk_times[0] <= record.chunk_times[-1] <= record.end
    assert not failed.succeeded and "max_model_len" in failed.error
    # the first four start together (nothing cached yet); the next four find their user's 64-token prefix
    assert all(r.cached_tokens >= 64 for r in ok[4:])
    stats = result.engine_stats
    assert stats.prefix_query_tokens == 8 * 80
    assert stats.prefix_hit_tokens == sum(r.cached_tokens for r in ok)
    assert stats.prefix_hit_rate == pytest.approx(stats.prefix_hit_tokens / (8 * 80))
    assert stats.num_samples >= 1 and 0 < stats.kv_usage_peak <= 1 and 0 <= stats.kv_usage_mean <= stats.kv_usage_peak
    # the peak comes from every step too (this run can be shorter than the 50 ms sampling interval),
    # whose records carry their KV usage; the run's step listener is gone afterwards
    assert engine.stats.steps[-1].kv_usage > 0 and not engine.stats.listeners
    assert stats.token_slot_utilization is None or 0 < stats.token_slot_utilization <= 1
    summary = summarize(result.records)
    assert summary.completed == 8 and summary.failed == 1 and summary.output_tokens == 48


def test_http_target_against_live_server(live_server):
    async def run():
        target = HttpTarget(live_server + "/v1/", ignore_eos=True)
        try:
            assert await target.connect() == "tiny-random-llama"
            prompts = [
                BenchRequest("Once upon a time the engine", 7, 5, user="alice"),
                BenchRequest([11, 12, 13, 14], 4, 3),
            ]
            result = await run_load(target, prompts, concurrency=2)
            wrong = HttpTarget(live_server, model="no-such-model")
            try:
                bad = await wrong.send(prompts[0])
            finally:
                await wrong.close()
            return result, bad
        finally:
            await target.close()

    result, bad = asyncio.run(run())
    text, ids = result.records
    assert text.succeeded and text.output_tokens == 5 and text.prompt_tokens >= 5  # from the server's usage
    assert ids.succeeded and ids.output_tokens == 3 and ids.prompt_tokens == 4
    for record in result.records:
        assert 1 <= len(record.chunk_times) <= record.output_tokens
        assert record.start < record.chunk_times[0] <= record.end
    assert not bad.ok and "HTTP 404" in bad.error


def test_http_target_opens_a_connection_a_request():
    """A server may close a kept-alive connection as the client reuses it (llama-server after 5
    requests), and aiohttp does not retry a POST: each request goes out on a connection of its own.
    The server here keeps connections alive (HTTP/1.1, Content-Length), so reuse would show."""
    connections: list[tuple[str, int]] = []

    class Completions(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            self.rfile.read(int(self.headers["Content-Length"]))
            connections.append(self.client_address)
            chunks = [{"choices": [{"text": "a"}]}, {"choices": [], "usage": {"completion_tokens": 1}}]
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def run():
        target = HttpTarget(f"http://127.0.0.1:{server.server_address[1]}", model="m")
        try:
            return [await target.send(BenchRequest("hi", 1, 1)) for _ in range(6)]
        finally:
            await target.close()

    try:
        records = asyncio.run(run())
    finally:
        server.shutdown()
        server.server_close()
    assert all(r.ok and r.output_tokens == 1 and len(r.chunk_times) == 1 for r in records)
    assert len(set(connections)) == len(connections) == 6


def test_http_target_unreachable():
    async def run():
        target = HttpTarget("http://127.0.0.1:9", model=None)
        try:
            await target.connect()
        finally:
            await target.close()

    with pytest.raises(ConnectionError, match="cannot list the served model"):
        asyncio.run(run())
