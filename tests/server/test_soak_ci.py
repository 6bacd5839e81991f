"""The CI-sized soak (``benchmarks/features/soak.py`` with a few hundred requests): randomized completions
and chat, streams dropped mid-way, aborted requests, byte-garbage prompts; then no 5xx, no KV block
in use and no request left once idle, bounded RSS growth."""

from __future__ import annotations

import importlib


def load_soak():
    return importlib.import_module("benchmarks.features.soak")


def test_ci_soak(start_server, tiny_chat_model):
    server = start_server(tiny_chat_model, "--max-model-len", "128", "--kv-cache-memory", "64MiB")
    summary = load_soak().run_soak(
        server.url, server.proc.pid, requests=300, concurrency=32, seed=5, warmup=60, rss_bound_mib=64
    )
    assert summary["ok"], summary
    assert summary["kinds"]["disconnect"] > 0 and summary["statuses"].get("200", 0) > 200
    assert "Traceback" not in server.log()
