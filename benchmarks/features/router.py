"""Prefix-aware routing against round-robin: TTFT and prefix-cache hit rate over real replicas.

Starts ``--replicas`` real ``llmctl serve`` processes of the embedded model on 127.0.0.1 (one torch
thread each, a KV pool of ``12MiB`` = 48 blocks) and two ``llmctl router`` processes in front of
them, one per policy. Each policy then serves the same shared-prefix workload (``--systems``
system prompts of ~100 tokens x ``--questions`` questions, interleaved, ``--concurrency`` streams
at a time) with system prompts of its own, so that neither inherits the other's cache. TTFT is
measured by the client (request sent -> first chunk with content); the hit rate is the replicas'
``llmctl:prefix_cache_hits_total / llmctl:prefix_cache_queries_total`` over the run.

    python -m benchmarks.features.router                       # 3 replicas, 8 x 6 requests per policy
    python -m benchmarks.features.router --questions 12 --json router.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.router.router_helpers import prefix_cache_counters, shared_prefix_workload, start_replicas, start_router


def _ttft(router: str, body: dict) -> float:
    """Seconds from sending the request to the first chunk that carries a token (text, or the end
    of a choice whose first token decodes to nothing); the opening role-only chunk does not count."""
    start = time.perf_counter()
    body = {**body, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and (choices[0]["delta"].get("content") or choices[0]["finish_reason"]):
                    first = time.perf_counter() - start
    assert first is not None, "the stream carried no token"
    return first


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_policy(router: str, replica_urls: list[str], systems: range, args: argparse.Namespace) -> dict:
    workload = shared_prefix_workload(systems, args.questions, max_tokens=args.max_tokens)
    queried0, hit0 = prefix_cache_counters(replica_urls)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        ttfts = list(pool.map(lambda body: _ttft(router, body), workload))
    wall = time.perf_counter() - start
    queried1, hit1 = prefix_cache_counters(replica_urls)
    return {
        "requests": len(workload),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(workload) / wall, 2),
        "hit_rate": round((hit1 - hit0) / (queried1 - queried0), 3),
        "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1),
        "ttft_p50_ms": round(1000 * _percentile(ttfts, 0.5), 1),
        "ttft_p99_ms": round(1000 * _percentile(ttfts, 0.99), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as logs:
        log_dir = Path(logs)
        processes = start_replicas(args.replicas, log_dir)
        try:
            urls = [p.url for p in processes]
            results = {}
            for offset, policy in enumerate(("round-robin", "prefix")):
                router = start_router(urls, log_dir, "--policy", policy)
                processes.append(router)
                systems = range(1000 * (offset + 1), 1000 * (offset + 1) + args.systems)
                results[policy] = run_policy(router.url, urls, systems, args)
                print(policy, results[policy], flush=True)
        finally:
            for process in processes:
                process.kill()
    print("\n| routing | hit rate | TTFT mean | TTFT P50 | TTFT P99 | requests/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for policy, r in results.items():
        print(
            f"| {policy} | {100 * r['hit_rate']:.1f} % | {r['ttft_mean_ms']:.0f} ms | {r['ttft_p50_ms']:.0f} ms "
            f"| {r['ttft_p99_ms']:.0f} ms | {r['requests_per_s']:.2f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
