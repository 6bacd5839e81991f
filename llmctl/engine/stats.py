"""A JSON-ready snapshot of the engine: what ``/v1/engine/stats`` serves and ``llmctl top`` draws.

Schema (version 1)::

    {
      "version": 1, "time": <unix s>, "uptime_s": float, "model": str, "step": int,
      "config": {"block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "enable_prefix_caching", "enable_chunked_prefill", "dtype", "device", "attention_backend"},
      "kv": {"num_blocks", "free", "cached", "used", "shared", "usage",
             "block_states": "one char per block: '.' free, 'c' cached (evictable), 'u' used by one
                              sequence, 's' shared by several"},
      "prefix_cache": {"queries": tokens looked up, "hits": tokens found, "hit_rate": float},
      "counters": {"num_preemptions", "prompt_tokens_total", "generation_tokens_total",
                   "requests_added_total", "requests_finished": {"stop", "length", "abort"}},
      "scheduler": {"running", "waiting", "preempted_waiting"},
      "requests": [{"id", "user", "state": "running"|"waiting"|"preempted", "priority",
                    "prompt_tokens", "generated_tokens", "cached_tokens", "blocks": [block ids],
                    "num_preemptions", "age_s", "n"}],
      "steps": [{"step", "time", "duration_s", "prefill_tokens", "decode_tokens", "num_seqs",
                 "num_running", "num_waiting", "num_preempted"}],  # oldest first, last ``max_steps``
      "latency": {"window", "count", "ttft_s": {"p50", "p90", "p99"}, "tpot_s": {...}, "e2e_s": {...}}
                 # nearest-rank percentiles over the last ``window`` finished, non-aborted requests
                 # (see llmctl/engine/latency.py); null where there is no data yet
    }
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from llmctl.engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from llmctl.engine.llm_engine import LLMEngine

STATS_VERSION = 1


def engine_snapshot(engine: LLMEngine, max_steps: int = 120) -> dict[str, Any]:
    now = time.time()
    bm, sched = engine.block_manager, engine.scheduler
    states = bm.block_states()
    queries, hits = sched.prefix_query_tokens, sched.prefix_hit_tokens
    requests = []
    for request in engine.requests.values():
        for seq in request.seqs:
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.RUNNING:
                state = "running"
            else:
                state = "preempted" if seq.num_preemptions else "waiting"
            requests.append({
                "id": request.request_id if request.params.n == 1 else f"{request.request_id}#{seq.index}",
                "user": seq.user,
                "state": state,
                "priority": seq.priority,
                "prompt_tokens": seq.num_prompt_tokens,
                "generated_tokens": seq.num_output_tokens,
                "cached_tokens": seq.num_cached_tokens,
                "blocks": list(seq.block_table),
                "num_preemptions": seq.num_preemptions,
                "age_s": round(now - request.metrics.arrival_time, 3),
                "n": request.params.n,
            })
    steps = list(engine.step_history)[-max_steps:]
    cfg = engine.config
    return {
        "version": STATS_VERSION,
        "time": now,
        "uptime_s": round(now - engine.start_time, 3),
        "model": engine.model_label,
        "step": engine.step_count,
        "config": {
            "block_size": bm.block_size,
            "num_blocks": bm.num_blocks,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
            "max_model_len": engine.max_model_len,
            "enable_prefix_caching": bm.enable_prefix_caching,
            "enable_chunked_prefill": cfg.enable_chunked_prefill,
            "dtype": str(engine.dtype).replace("torch.", ""),
            "device": str(engine.device),
            "attention_backend": getattr(engine.ops, "description", engine.ops.name),
        },
        "kv": {
            "num_blocks": bm.num_blocks,
            "free": states.count("."),
            "cached": states.count("c"),
            "used": states.count("u"),
            "shared": states.count("s"),
            "usage": bm.usage,
            "block_states": states,
        },
        "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0},
        "counters": {
            "num_preemptions": sched.num_preemptions,
            "prompt_tokens_total": engine.prompt_tokens_total,
            "generation_tokens_total": engine.generation_tokens_total,
            "requests_added_total": engine.requests_added_total,
            "requests_finished": dict(engine.finished_requests),
        },
        "scheduler": {
            "running": len(sched.running),
            "waiting": sched.num_waiting,
            "preempted_waiting": sum(1 for r in requests if r["state"] == "preempted"),
        },
        "requests": requests,
        "steps": [asdict(s) for s in steps],
        "latency": engine.latency.section(),
    }
