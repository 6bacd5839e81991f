"""``llmctl top`` for a server that is not llmctl: a dashboard from vLLM's Prometheus ``/metrics``.

vLLM (and servers that copy its metric names, such as llmctl itself under ``llmctl:``) exports the
queue sizes, KV-cache usage, token counters and latency histograms; this module turns one scrape
into the engine-stats snapshot the dashboard draws (schema: ``llmctl/engine/stats.py``). What
``/metrics`` does not have stays empty or approximate: no per-request rows, a block map drawn from
the usage percentage, one "step" per scrape, latency percentiles from the cumulative histograms
(since the server started, interpolated inside the buckets).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:"
NOTE = "no per-request rows, block map from the KV usage %"
FALLBACK_CELLS = 100  # block-map cells when the server does not say how many blocks it has


def looks_like_vllm(text: str) -> bool:
    return f"{PREFIX}num_requests_running" in text or f"{PREFIX}generation_tokens" in text


class VllmMetrics:
    """Scrapes in, snapshots out; keeps what successive snapshots need (start time, previous scrape)."""

    def __init__(self) -> None:
        self.started = time.time()
        self.scrapes = 0
        self._previous: dict[str, float] | None = None

    def snapshot(self, text: str) -> dict[str, Any]:
        values, labels, buckets = _parse(text)
        now = time.time()
        self.scrapes += 1

        def total(name: str) -> float:
            return values.get(PREFIX + name, 0.0)

        usage = total("kv_cache_usage_perc") or total("gpu_cache_usage_perc")
        cache = labels.get(PREFIX + "cache_config_info", {})
        num_blocks = int(float(cache.get("num_gpu_blocks") or 0)) or FALLBACK_CELLS
        used = min(num_blocks, round(usage * num_blocks))
        running, waiting = int(total("num_requests_running")), int(total("num_requests_waiting"))
        prompt, generated = total("prompt_tokens_total"), total("generation_tokens_total")
        previous = self._previous or {"prompt": prompt, "generated": generated, "time": now}
        self._previous = {"prompt": prompt, "generated": generated, "time": now}
        hits, queries = total("prefix_cache_hits_total"), total("prefix_cache_queries_total")
        return {
            "version": 1,
            "time": now,
            "uptime_s": now - self.started,
            "step": self.scrapes,
            "note": NOTE,
            "model": next((d["model_name"] for d in labels.values() if "model_name" in d), "?"),
            "config": {"block_size": int(float(cache.get("block_size") or 0)) or "?", "num_blocks": num_blocks},
            "kv": {
                "num_blocks": num_blocks,
                "free": num_blocks - used,
                "cached": 0,
                "used": used,
                "shared": 0,
                "usage": usage,
                "block_states": "u" * used + "." * (num_blocks - used),
            },
            "prefix_cache": {
                "queries": int(queries),
                "hits": int(hits),
                "hit_rate": hits / queries if queries else 0.0,
            },
            "counters": {
                "num_preemptions": int(total("num_preemptions_total")),
                "prompt_tokens_total": int(prompt),
                "generation_tokens_total": int(generated),
                "requests_added_total": 0,
                "requests_finished": {
                    k: int(v) for k, v in _by_label(text, "request_success_total", "finished_reason").items()
                },
            },
            "scheduler": {"running": running, "waiting": waiting, "preempted_waiting": 0},
            "requests": [],
            "steps": [
                {
                    "step": self.scrapes,
                    "time": now,
                    "duration_s": now - previous["time"],
                    "prefill_tokens": int(prompt - previous["prompt"]),
                    "decode_tokens": int(generated - previous["generated"]),
                    "num_seqs": running,
                    "num_running": running,
                    "num_waiting": waiting,
                    "num_preempted": 0,
                }
            ],
            "latency": _latency(buckets),
            "spec_decode": _spec_decode(total),
        }


def _spec_decode(total: Callable[[str], float]) -> dict[str, Any] | None:
    """vLLM's (or llmctl's) speculative-decoding counters, where the server has any drafts."""
    drafts, draft_tokens = total("spec_decode_num_drafts_total"), total("spec_decode_num_draft_tokens_total")
    if not draft_tokens:
        return None
    accepted = total("spec_decode_num_accepted_tokens_total")
    return {
        "method": "server",
        "num_drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }


def _parse(text: str) -> tuple[dict[str, float], dict[str, dict[str, str]], dict[str, list[tuple[float, float]]]]:
    """Sample sums by name (over all label sets), each name's labels, histogram buckets by family."""
    values: dict[str, float] = defaultdict(float)
    labels: dict[str, dict[str, str]] = {}
    buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(PREFIX):
                continue
            values[sample.name] += sample.value
            labels.setdefault(sample.name, dict(sample.labels))
            if sample.name.endswith("_bucket"):
                buckets[family.name].append((float(sample.labels["le"]), sample.value))
    return values, labels, buckets


def _by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PREFIX + name:
                out[sample.labels.get(label, "?")] += sample.value
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: the bucket holding rank ``q``, linearly interpolated."""
    merged: dict[float, float] = defaultdict(float)
    for bound, count in buckets:
        merged[bound] += count
    ordered = sorted(merged.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def _latency(buckets: dict[str, list[tuple[float, float]]]) -> dict[str, Any] | None:
    families = {
        "ttft_s": "time_to_first_token_seconds",
        "tpot_s": "time_per_output_token_seconds",
        "e2e_s": "e2e_request_latency_seconds",
    }
    section: dict[str, Any] = {"window": "since start", "count": 0}
    for key, family in families.items():
        found = buckets.get(PREFIX + family) or (
            buckets.get(PREFIX + "inter_token_latency_seconds") if key == "tpot_s" else None
        )
        section[key] = {f"p{int(q * 100)}": histogram_quantile(q, found) for q in (0.5, 0.9, 0.99)} if found else None
        if key == "e2e_s" and found:
            section["count"] = int(sum(count for bound, count in found if math.isinf(bound)))
    return section if any(section[k] for k in families) else None
