"""TP=1 vs TP=2 and PP=2 (with and without batches in flight across steps, with and without
micro-batches) on the same cores, interleaved.

Each variant is one ``llmctl bench`` run (in-process engine; the parallel ones start their ranks
through torchrun) on a random-weight fp32 Llama built once with transformers. The variants share
the machine's cores: TP=1 gets all of them as torch threads, each of N ranks gets cores / N.
A prefill-heavy run (long prompts, few output tokens) shows what micro-batches overlap:

    python -m benchmarks.features.parallel_tp --input-len 512 --output-len 2 \
        --variants "PP=2 (split every step),PP=2 (never split)"

    python -m benchmarks.features.parallel_tp [--reps 2] [--model-dir /tmp/llmctl-tp-bench-model]

Decode overlap across steps (PP=1 vs PP=2, 1 thread per rank; 128 short requests so that each of
the two batches in flight has 64 sequences and compute, not reading the weights, dominates a step;
5 + 3 layers so that the last stage, which also runs the LM head, is not the slow one):

    LLMCTL_PP_LAYER_PARTITION=5,3 python -m benchmarks.features.parallel_tp --num-prompts 128 --input-len 8 \
        --output-len 16 --variants "TP=1,TP=1 (1 thread),PP=2,PP=2 (one batch in flight)"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {  # name -> (extra flags, ranks, extra env)
    "TP=1": ((), 1, {}),
    "TP=1 (1 thread)": ((), 2, {}),  # one rank's share of the cores: the per-rank baseline
    "TP=2": (("--tensor-parallel-size", "2"), 2, {}),
    "PP=2": (("--pipeline-parallel-size", "2"), 2, {}),  # 2 batches in flight across steps
    "PP=2 (one batch in flight)": (("--pipeline-parallel-size", "2"), 2, {"LLMCTL_PP_BATCHES_IN_FLIGHT": "1"}),
    "PP=2 (split every step)": (("--pipeline-parallel-size", "2"), 2, {"LLMCTL_PP_MICRO_BATCH_MIN_TOKENS": "1"}),
    "PP=2 (never split)": (("--pipeline-parallel-size", "2"), 2, {"LLMCTL_PP_MICRO_BATCHES": "1"}),
}


def make_model(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def run(model: Path, name: str, args: argparse.Namespace) -> dict:
    flags, ranks, env = VARIANTS[name]
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            sys.executable,
            "-m",
            "llmctl.cli",
            "bench",
            str(model),
            "--num-prompts",
            str(args.num_prompts),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            args.kv_cache_memory,
            "--json",
            str(out),
            *flags,
        ]
        run_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(max(1, cores // ranks)), **env}
        subprocess.run(command, cwd=REPO_ROOT, env=run_env, check=True, capture_output=True)
        return json.loads(out.read_text())["result"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "llmctl-tp-bench-model")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()
    if not (args.model_dir / "config.json").is_file():
        make_model(args.model_dir)
    names = args.variants.split(",")
    results: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):  # ABAB...: load drifts hit every variant alike
        for name in names:
            results[name].append(run(args.model_dir, name, args))
            print(
                f"rep {rep} {name}: {results[name][-1]['output_throughput']:.1f} tok/s (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    print(
        f"\n{args.num_prompts} requests x {args.input_len} prompt -> {args.output_len} output tokens, fp32, "
        f"{os.cpu_count()} cores; best of {args.reps}"
    )
    print("| variant | output tok/s | TPOT median (ms) | TTFT median (ms) |\n|---|---|---|---|")
    for name in names:
        best = max(results[name], key=lambda r: r["output_throughput"])
        print(
            f"| {name} | {best['output_throughput']:.1f} | {best['tpot_ms']['median']:.1f} | "
            f"{best['ttft_ms']['median']:.1f} |"
        )


if __name__ == "__main__":
    main()
