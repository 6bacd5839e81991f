"""The load generator and its two targets: the in-process ``AsyncEngine`` and any OpenAI-compatible
HTTP server (llmctl serve, vLLM, llama.cpp's server).

Requests arrive as a Poisson process (exponential gaps from a seeded RNG; all at once when the rate
is infinite) and at most ``concurrency`` are in flight; a request's clock starts when it is sent,
after it got a concurrency slot. Every request is greedy (temperature 0): the benchmark measures
the engine, not the sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from llmctl.bench.datasets import BenchRequest
from llmctl.bench.metrics import RequestRecord
from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.stats import EngineCounters
from llmctl.sampling_params import SamplingParams

KV_SAMPLE_INTERVAL_S = 0.05


@dataclass
class EngineRunStats:
    """What only an in-process run can see, measured over the timed run (warm-up excluded)."""

    kv_usage_mean: float  # fraction of KV blocks held by live sequences, mean of samples
    kv_usage_peak: float
    token_slot_utilization: float | None  # tokens held / token slots of held blocks, mean of samples
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_samples: int
    # speculative decoding over the run (all 0 without it)
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else None

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens per verify step: accepted drafts plus the one every verify yields."""
        return 1 + self.spec_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float
    engine_stats: EngineRunStats | None = None
    target: str = ""
    notes: list[str] = field(default_factory=list)


class Target(Protocol):
    label: str

    async def send(self, request: BenchRequest) -> RequestRecord: ...


class InProcessTarget:
    """Streams each request from the engine; a token's time is when its step's output reached this
    event loop, as a client of the engine sees it."""

    def __init__(self, engine: AsyncEngine, ignore_eos: bool) -> None:
        self.engine = engine
        self.ignore_eos = ignore_eos
        self.label = engine.engine.model_label

    async def send(self, request: BenchRequest) -> RequestRecord:
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=self.ignore_eos)
        start = time.perf_counter()
        record = RequestRecord(start=start, end=start, prompt_tokens=request.prompt_len)
        final = None
        try:
            async for out in self.engine.generate(request.prompt, params, user=request.user, lora=request.lora):
                now = time.perf_counter()
                if out.outputs[0].delta_token_ids:
                    record.chunk_times.append(now)
                final = out
        except Exception as exc:  # noqa: BLE001 - one failed request must not end the run; it is counted as failed
            record.ok, record.error = False, f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter()
        if final is not None:
            record.prompt_tokens = len(final.prompt_token_ids)
            record.output_tokens = len(final.outputs[0].token_ids)
            record.cached_tokens = final.num_cached_tokens
            if final.outputs[0].finish_reason == "abort":
                record.ok, record.error = False, "aborted"
        return record

    def counters(self) -> EngineCounters:
        """The engine's own counters (llmctl/engine/stats.py); read off the event loop, it may wait
        for a step."""
        return self.engine.counters()


class HttpTarget:
    """POSTs streaming ``/v1/completions`` requests. Every chunk with a choice is a token arrival (a
    server may hold back tokens whose text is not complete yet, and send them with a later chunk, as
    a client would see them). Output tokens come from the final usage chunk
    (``stream_options.include_usage``); a server that sends none is counted one token per chunk.

    The client is aiohttp (as vLLM's serving benchmark): the load generator shares the machine with
    the server it measures, and httpx's async stack took about twice its CPU a streamed token
    (~300 against ~150 us on a Zen 5, one stream of SmolLM2-135M through ``llmctl serve``)."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        ignore_eos: bool = True,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        base = url.rstrip("/")
        self.base_url = base[:-3] if base.endswith("/v1") else base
        self.model = model
        self.ignore_eos = ignore_eos
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # a server may think for long between two chunks (a long prefill): the limit is per read
        self._timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.label = url

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made at first use, on the event loop that runs the load (aiohttp binds a session to it)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=self._timeout,
                # no cap: the concurrency option is the cap. A connection a request: a server may
                # close a kept-alive one (llama-server after 5 requests) as aiohttp reuses it, and
                # aiohttp, unlike httpx, does not retry a POST on a fresh one
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                read_bufsize=1 << 20,  # one SSE line (a chunk with logprobs) may be long
                trust_env=True,  # HTTP(S)_PROXY / NO_PROXY, as httpx and vLLM's benchmark read them
            )
        return self._session

    async def get(self, path: str) -> tuple[int, Any]:
        """GET ``path`` of the server: the status and the JSON body (None when it is not JSON)."""
        async with self.session.get(self.base_url + path) as response:
            try:
                body = await response.json(content_type=None)
            except ValueError:
                body = None
            return response.status, body

    async def connect(self) -> str:
        """Find the served model name (the first of ``/v1/models``) unless one was given."""
        if self.model is None:
            try:
                status, body = await self.get("/v1/models")
                if status != 200:
                    raise ValueError(f"HTTP {status}")
                self.model = body["data"][0]["id"]
            except (aiohttp.ClientError, OSError, LookupError, TypeError, ValueError) as exc:  # OSError: timeouts too
                raise ConnectionError(f"{self.base_url}/v1/models: cannot list the served model ({exc})") from exc
        self.label = f"{self.model} @ {self.base_url}"
        return self.model

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # an extension vLLM, llama.cpp and llmctl read; others ignore it
        if request.user:
            body["user"] = request.user
        return body

    async def send(self, request: BenchRequest) -> RequestRecord:
        start = time.perf_counter()
        record = RequestRecord(start=start, end=start, prompt_tokens=request.prompt_len)
        usage: dict[str, Any] | None = None
        try:
            async with self.session.post(self.base_url + "/v1/completions", json=self.payload(request)) as response:
                if response.status != 200:
                    body = (await response.read()).decode(errors="replace")
                    raise RuntimeError(f"HTTP {response.status}: {body[:300]}")
                async for line in response.content:  # line by line, as the events arrive
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        raise RuntimeError(f"server error: {chunk['error']}")
                    if chunk.get("choices"):  # as vLLM's benchmark: any choice chunk is a token arrival
                        record.chunk_times.append(time.perf_counter())
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except Exception as exc:  # noqa: BLE001 - counted as a failed request, the run goes on
            record.ok, record.error = False, f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter()
        if usage:
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            record.prompt_tokens = int(usage.get("prompt_tokens") or record.prompt_tokens)
            record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        else:
            record.output_tokens = len(record.chunk_times)
        return record


async def _sample_kv(target: InProcessTarget, samples: list[EngineCounters], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(await asyncio.to_thread(target.counters))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), KV_SAMPLE_INTERVAL_S)


def arrival_gaps(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: a Poisson process (exponential gaps of mean 1/rate, from a
    seeded RNG), the first request at once; all zeros when the rate is infinite."""
    if not request_rate > 0:
        raise ValueError("request rate must be positive (inf sends everything at once)")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]


async def run_load(
    target: Target,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None,
    request_rate: float = math.inf,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Send every request under the arrival process and the concurrency cap; wait for all."""
    gaps = arrival_gaps(len(requests), request_rate, seed)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    in_process = isinstance(target, InProcessTarget)
    samples: list[EngineCounters] = []
    stop = asyncio.Event()
    before = target.counters() if in_process else None

    async def one(request: BenchRequest) -> RequestRecord:
        async with slots if slots is not None else contextlib.nullcontext():
            record = await target.send(request)
        if on_done is not None:
            on_done(record)
        return record

    step_usages: list[float] = []  # every step's KV usage: a run shorter than the sampling interval has a peak too

    def on_step(step) -> None:  # in the engine's thread, with its lock held
        step_usages.append(step.record.kv_usage)

    sampler = None
    if in_process:  # the engine lock may wait for a step: not on the event loop
        await asyncio.to_thread(target.engine.add_step_listener, on_step)
        sampler = asyncio.create_task(_sample_kv(target, samples, stop))
    started = time.perf_counter()
    try:
        tasks = []
        for gap, request in zip(gaps, requests):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - started
    finally:  # also on Ctrl-C or a failing on_done: no listener or sampler left behind
        if sampler is not None:
            stop.set()
            await asyncio.gather(sampler, return_exceptions=True)
            await asyncio.to_thread(target.engine.remove_step_listener, on_step)
    stats = None
    if sampler is not None:
        after = target.counters()
        usages = [c.kv_usage for c in samples]
        fills = [c.kv_token_utilization for c in samples if c.kv_token_utilization is not None]
        stats = EngineRunStats(
            kv_usage_mean=sum(usages) / len(usages) if usages else 0.0,
            kv_usage_peak=max(usages + step_usages, default=0.0),
            token_slot_utilization=sum(fills) / len(fills) if fills else None,
            prefix_query_tokens=after.prefix_cache_queries - before.prefix_cache_queries,
            prefix_hit_tokens=after.prefix_cache_hits - before.prefix_cache_hits,
            num_preemptions=after.num_preemptions - before.num_preemptions,
            num_samples=len(samples),
            spec_num_drafts=after.spec_num_drafts - before.spec_num_drafts,
            spec_draft_tokens=after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            spec_accepted_tokens=after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
        )
    return RunResult(records, duration, stats, target=target.label)
