"""Soak test of ``llmctl serve``: N randomized requests at a fixed concurrency, then checks that
the server is clean.

Requests mix completions and chat, text and token-id prompts (ASCII, CJK, emoji, random byte
garbage), random ``n``, ``stop``, ``logprobs``, ``seed``, streaming or not, temperatures up to 2;
about 10 % of the streams are dropped by the client mid-way and a few plain requests are aborted by
a client timeout. Afterwards: no 5xx, no KV block in use and no request left once idle (from
``/v1/engine/stats``), and the server's RSS grew by less than ``--rss-bound-mib`` between the end
of a warm-up and the end of the run.

    python -m benchmarks.features.soak                       # 10,000 requests on the embedded model
    python -m benchmarks.features.soak --requests 500 --model ../shared/models/stories260k
    python -m benchmarks.features.soak --url http://127.0.0.1:8000 --server-pid 1234

Exits 1 when a check fails; prints one JSON summary either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

READY = re.compile(r"at (http://127\.0\.0\.1:\d+)/v1")
WORDS = ["Once", "upon", "a", "time", "Lily", "the", "park", "happy", "ball", "and", "said", "big"]
SNIPPETS = ["你好世界", "猫在桌子上", "日本語のテキスト", "한국어", "🙂🐱🚀", "café naïve", "«ok» — ¿sí?", "Ünïcödé"]


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    transport_errors: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def random_prompt(rng: random.Random, vocab: int) -> str | list[int]:
    kind = rng.random()
    if kind < 0.15:
        return [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
    if kind < 0.3:  # byte garbage, decoded as whatever it happens to be
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))).decode("utf-8", errors="replace")
    parts = [rng.choice(WORDS + SNIPPETS) for _ in range(rng.randint(1, 12))]
    return " ".join(parts)


def random_body(rng: random.Random, vocab: int, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": rng.randint(1, 24),
        "temperature": round(rng.uniform(0, 2), 3),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        body["stop"] = rng.sample(WORDS + ["。", "🙂", "e"], rng.randint(1, 3))
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if chat:
        prompt = random_prompt(rng, vocab)
        content = prompt if isinstance(prompt, str) else " ".join(WORDS[:3])
        body["messages"] = [{"role": "user", "content": content or "hi"}]
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
    else:
        body["prompt"] = random_prompt(rng, vocab) or "hi"
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
    return body


async def one_request(client: httpx.AsyncClient, rng: random.Random, vocab: int, chat_ok: bool, tally: Tally) -> None:
    chat = chat_ok and rng.random() < 0.4
    body = random_body(rng, vocab, chat)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    disconnect = body["stream"] and rng.random() < 0.1
    abort = not body["stream"] and rng.random() < 0.03
    kind = "disconnect" if disconnect else "abort" if abort else "stream" if body["stream"] else "plain"
    tally.kinds[kind] += 1
    started = time.perf_counter()
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as response:
                tally.statuses[response.status_code] += 1
                events = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events += 1
                        if '"error"' in line and '"server_error"' in line:
                            tally.server_errors.append(line[:300])
                        if disconnect and events >= rng.randint(1, 3):
                            break  # leaving the block closes the connection mid-stream
                if response.status_code >= 500:
                    tally.server_errors.append((await response.aread()).decode(errors="replace")[:300])
        else:
            timeout = rng.uniform(0.01, 0.3) if abort else None
            response = await asyncio.wait_for(client.post(path, json=body), timeout)
            tally.statuses[response.status_code] += 1
            if response.status_code >= 500:
                tally.server_errors.append(response.text[:300])
    except asyncio.TimeoutError:
        tally.statuses["aborted"] += 1
    except httpx.HTTPError as exc:
        tally.transport_errors[type(exc).__name__] += 1
    tally.latencies.append(time.perf_counter() - started)


async def drive(
    url: str,
    requests: int,
    concurrency: int,
    seed: int,
    vocab: int,
    chat_ok: bool,
    tally: Tally,
    on_progress: Any = None,
) -> None:
    rng = random.Random(seed)
    seeds = [rng.randrange(2**32) for _ in range(requests)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                await one_request(client, random.Random(seeds[i]), vocab, chat_ok, tally)
                if on_progress is not None:
                    on_progress(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def wait_idle(url: str, timeout: float = 120) -> dict[str, Any]:
    """The stats once no request is left (or the last ones seen, after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{url}/v1/engine/stats", params={"max_steps": 0}, timeout=30).json()
        if (not stats["requests"] and stats["kv"]["used"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.25)


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "llmctl.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-level",
        "warning",
        "--no-access-log",
        *extra,
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parents[2]
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if (match := READY.search(line)) is not None:
            return proc, match.group(1)
    raise RuntimeError(f"server did not start (exit {proc.wait()})")


def run_soak(
    url: str,
    pid: int,
    *,
    requests: int,
    concurrency: int = 32,
    seed: int = 0,
    warmup: int = 200,
    rss_bound_mib: float = 64.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Drive the server at ``url`` (process ``pid``) and check it; the summary, ``ok`` included."""
    chat_ok = (
        httpx.post(
            f"{url}/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        ).status_code
        == 200
    )
    vocab = 256  # token-id prompts stay inside every model's vocabulary
    process = psutil.Process(pid)
    tally = Tally()
    warm = min(warmup, requests // 5)
    asyncio.run(drive(url, warm, concurrency, seed + 1, vocab, chat_ok, Tally()))
    wait_idle(url)
    rss_before = process.memory_info().rss
    started = time.perf_counter()
    done = 0

    def on_progress(_: int) -> None:
        nonlocal done
        done += 1
        if progress and done % 500 == 0:
            print(f"  {done}/{requests} in {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)

    asyncio.run(drive(url, requests, concurrency, seed, vocab, chat_ok, tally, on_progress))
    elapsed = time.perf_counter() - started
    stats = wait_idle(url)
    rss_after = process.memory_info().rss
    growth_mib = (rss_after - rss_before) / 2**20
    five_xx = sum(count for status, count in tally.statuses.items() if isinstance(status, int) and status >= 500)
    summary = {
        "requests": requests,
        "concurrency": concurrency,
        "seed": seed,
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(requests / elapsed, 1),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items(), key=str)},
        "kinds": dict(tally.kinds),
        "transport_errors": dict(tally.transport_errors),
        "responses_5xx": five_xx,
        "server_error_events": len(tally.server_errors),
        "examples_of_errors": tally.server_errors[:3],
        "kv_blocks_used_when_idle": stats["kv"]["used"],
        "requests_left_when_idle": len(stats["requests"]),
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_after_mib": round(rss_after / 2**20, 1),
        "rss_growth_mib": round(growth_mib, 1),
        "rss_bound_mib": rss_bound_mib,
        "p50_latency_s": round(sorted(tally.latencies)[len(tally.latencies) // 2], 3) if tally.latencies else None,
        "health": httpx.get(f"{url}/health", timeout=30).json().get("status"),
    }
    summary["ok"] = (
        five_xx == 0
        and not tally.server_errors
        and not tally.transport_errors
        and stats["kv"]["used"] == 0
        and not stats["requests"]
        and growth_mib < rss_bound_mib
        and summary["health"] == "ok"
    )
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny-random-llama", help="served by a fresh `llmctl serve`")
    parser.add_argument(
        "--serve-args", default="--max-model-len 128 --kv-cache-memory 64MiB", help="extra `llmctl serve` flags"
    )
    parser.add_argument("--url", help="soak a server already running here instead")
    parser.add_argument("--server-pid", type=int, help="its process id (for RSS), with --url")
    parser.add_argument(
        "--rss-bound-mib", type=float, default=64.0, help="most the server's RSS may grow between warm-up and end"
    )
    args = parser.parse_args()
    proc = None
    if args.url:
        if args.server_pid is None:
            parser.error("--url needs --server-pid")
        url, pid = args.url.rstrip("/"), args.server_pid
    else:
        proc, url = start_server(args.model, args.serve_args.split())
        pid = proc.pid
    try:
        summary = run_soak(
            url,
            pid,
            requests=args.requests,
            concurrency=args.concurrency,
            seed=args.seed,
            rss_bound_mib=args.rss_bound_mib,
            progress=True,
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    summary["command"] = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
