"""Load generator and latency/throughput metrics."""

# 64 requests (of 128 -> 128 tokens): one full batch at the default concurrency, and the README's
# `llmctl bench --concurrency 64` finishes its bench part in about a minute on 2 cores with
# SmolLM2-135M (docs/bench.md); --num-prompts scales it up
DEFAULT_NUM_PROMPTS = 64
