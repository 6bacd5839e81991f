"""Synthetic snapshots of any size, schema v1: for the refresh benchmark and layout tests, where a
recorded run of that size is impractical on a CPU. Each call with a later ``tick`` moves the
engine on: requests generate tokens, some finish and new ones arrive, blocks change hands."""

from __future__ import annotations

import random
from typing import Any


def synthetic_snapshot(
    num_blocks: int = 4096,
    num_requests: int = 256,
    tick: int = 0,
    seed: int = 0,
    block_size: int = 16,
    steps_kept: int = 120,
) -> dict[str, Any]:
    rng = random.Random(seed * 1_000_003 + tick)
    shared_prefix = list(range(0, 8))  # every request shares the first 8 blocks (a system prompt)
    next_block = len(shared_prefix)
    per_request = max(1, (num_blocks * 3 // 4 - next_block) // max(1, num_requests))
    requests = []
    for i in range(num_requests):
        rid = i + tick // 3  # every third tick the oldest request finishes and a new one arrives
        state = "running" if i < num_requests * 3 // 4 else rng.choice(("waiting", "waiting", "preempted"))
        own = list(range(next_block, next_block + per_request)) if state == "running" else []
        next_block += len(own)
        generated = (tick * 3 + i) % 200 if state == "running" else 0
        requests.append(
            {
                "id": f"req-{rid}",
                "user": f"user{rid % 7}",
                "state": state,
                "priority": 0,
                "prompt_tokens": 100 + rid % 900,
                "generated_tokens": generated,
                "cached_tokens": 128 if state == "running" else 0,
                "blocks": (shared_prefix + own) if state == "running" else [],
                "num_preemptions": int(state == "preempted"),
                "age_s": round(0.25 * tick + (num_requests - i) * 0.1, 3),
                "n": 1,
            }
        )
    states = ["."] * num_blocks
    for b in shared_prefix:
        states[b] = "s"
    for b in range(len(shared_prefix), next_block):
        states[b] = "u"
    for b in rng.sample(range(next_block, num_blocks), (num_blocks - next_block) // 2):
        states[b] = "c"
    block_states = "".join(states)
    now = 1_700_000_000.0 + 0.25 * tick
    running = sum(r["state"] == "running" for r in requests)
    waiting = num_requests - running
    first_step = tick * 10
    steps = [
        {
            "step": first_step + k,
            "time": now - (steps_kept - k) * 0.025,
            "duration_s": 0.025,
            "prefill_tokens": rng.choice((0, 0, 0, 512, 2048)),
            "decode_tokens": running,
            "num_seqs": running + 1,
            "num_running": running,
            "num_waiting": waiting,
            "num_preempted": 0,
        }
        for k in range(1, steps_kept + 1)
    ]
    free, cached = block_states.count("."), block_states.count("c")
    return {
        "version": 1,
        "time": now,
        "uptime_s": 100.0 + 0.25 * tick,
        "model": "synthetic",
        "step": first_step + steps_kept,
        "config": {
            "block_size": block_size,
            "num_blocks": num_blocks,
            "max_num_seqs": 256,
            "max_num_batched_tokens": 2048,
            "max_model_len": 4096,
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
            "dtype": "bfloat16",
            "device": "cpu",
            "attention_backend": "torch",
        },
        "kv": {
            "num_blocks": num_blocks,
            "free": free,
            "cached": cached,
            "used": block_states.count("u"),
            "shared": block_states.count("s"),
            "usage": 1 - (free + cached) / num_blocks,
            "block_states": block_states,
        },
        "prefix_cache": {"queries": 1000 * (tick + 1), "hits": 400 * (tick + 1), "hit_rate": 0.4},
        "counters": {
            "num_preemptions": tick // 5,
            "prompt_tokens_total": 50_000 + 900 * tick,
            "generation_tokens_total": 10_000 + 60 * tick,
            "requests_finished": {"stop": tick // 3, "length": 0, "abort": 0},
        },
        "scheduler": {
            "running": running,
            "waiting": waiting,
            "preempted_waiting": sum(r["state"] == "preempted" for r in requests),
        },
        "requests": requests,
        "steps": steps,
    }
