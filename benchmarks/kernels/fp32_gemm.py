"""GFLOP/s of the fp32 linear layers' GEMM: the native panel kernel (kernels/cpu/gemm_kernels.cpp)
against torch's ``F.linear`` (MKL), torch with the weight prepacked for oneDNN (what llmctl used
before for large fp32 weights) and numpy (OpenBLAS), at the shapes of the 246M Llama
(``llama250m``) and SmolLM2-135M, for M = 1, 8, 64, 512 rows.

Two measurements: one thread, CPU time of the thread (``time.thread_time``: what the work costs,
little disturbed by other processes on a shared machine), and all threads (torch's count), wall
time. The contenders run interleaved (A B C D A B C D ...), best of ``--reps``.

    python -m benchmarks.kernels.fp32_gemm [--reps 5] [--rows 1,8,64,512] [--models llama250m,smollm2]

``--engine MODEL``: end to end instead, two engines in one process, torch's GEMM
(``LLMCTL_NATIVE_GEMM=0``) and the native one, run interleaved on the peer workload's shape
(64 requests x 128 random prompt ids, greedy, fp32; ``--prompt-len`` shortens the prompts): CPU seconds
of the 8,192-token prefill and CPU milliseconds of a 64-row decode step (``--threads 1``: CPU time of
one thread, the work itself; more threads: wall time), and whether both engines produced the same tokens.

    python -m benchmarks.kernels.fp32_gemm --engine /path/to/llama250m --threads 1 [--rounds 3]
    python -m benchmarks.kernels.fp32_gemm --engine smollm2-135m --quantization none --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.harness import cpu_line
from llmctl_kernels.cpu_features import isa_level
from llmctl_kernels.fp32_linear import pack_panels
from llmctl_kernels.gemm_native import load_gemm_native, native_unavailable_reason

# (name, in_features K, out_features N) of each linear layer (merged QKV and gate-up, as llmctl holds them)
SHAPES = {
    "llama250m": [
        ("qkv", 1024, 1536),
        ("o", 1024, 1024),
        ("gate_up", 1024, 5632),
        ("down", 2816, 1024),
        ("lm_head", 1024, 32000),
    ],
    "smollm2": [
        ("qkv", 576, 960),
        ("o", 576, 576),
        ("gate_up", 576, 3072),
        ("down", 1536, 576),
        ("lm_head", 576, 49152),
    ],
}


def _numpy_threads(count: int):
    """Caps OpenBLAS's threads (threadpoolctl, when installed); None: numpy is left out."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=count)


def contenders(k: int, n: int) -> dict[str, Callable[[torch.Tensor], object]]:
    w = torch.randn(n, k) / k**0.5
    out: dict[str, Callable[[torch.Tensor], object]] = {"torch": lambda x: F.linear(x, w)}
    with contextlib.suppress(RuntimeError, AttributeError):
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["oneDNN prepacked"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
    wt = np.ascontiguousarray(w.numpy().T)
    out["numpy"] = lambda x: x.numpy() @ wt
    module = load_gemm_native()
    if module is not None:
        packed = pack_panels(w)
        out["native"] = lambda x: module.linear(x, packed, n, None)
    return out


def measure(fns: dict[str, Callable], x: torch.Tensor, reps: int, clock: Callable[[], float]) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for fn in fns.values():  # warm-up (first-touch, oneDNN's primitive cache)
        fn(x)
    for _ in range(reps):
        for name, fn in fns.items():
            start = clock()
            fn(x)
            best[name] = min(best[name], clock() - start)
    return best


def run(models: list[str], rows: list[int], reps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    limiter = _numpy_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    what = "1 thread, CPU time" if threads == 1 else f"{threads} threads, wall time"
    print(f"\n### GFLOP/s, {what} (best of {reps})\n")
    names = None
    for model in models:
        for layer, k, n in SHAPES[model]:
            fns = contenders(k, n)
            if limiter is None:
                fns.pop("numpy")
            if names is None:
                names = list(fns)
                print("| model | layer | K → N | M | " + " | ".join(names) + " | native / best other |")
                print("|---|---|---|---:|" + "---:|" * (len(names) + 1))
            for m in rows:
                x = torch.randn(m, k)
                best = measure(fns, x, max(2, reps if m * k * n < 2e9 else reps // 2), clock)
                rate = {name: 2 * m * k * n / t / 1e9 for name, t in best.items()}
                others = max(v for name, v in rate.items() if name != "native")
                ratio = f"{rate['native'] / others:.2f}×" if "native" in rate else "—"
                print(
                    f"| {model} | {layer} | {k} → {n} | {m} | "
                    + " | ".join(f"{rate[name]:.1f}" for name in names)
                    + f" | {ratio} |",
                    flush=True,
                )
    if limiter is not None:
        limiter.restore_original_limits()


def engine_ab(model: str, quantization: str, rounds: int, threads: int, decode_tokens: int, prompt_len: int) -> None:
    """Prefill and decode time of torch's GEMM against the native one, interleaved in one process."""
    import random

    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    engines = {}
    for label, setting in (("torch GEMM", "0"), ("native GEMM", "1")):
        os.environ["LLMCTL_NATIVE_GEMM"] = setting  # read when the weights are packed, at load
        engines[label] = LLMEngine(
            model=model,
            dtype="float32",
            quantization=quantization,
            skip_tokenizer=True,
            max_model_len=512,
            max_num_seqs=64,
            kv_cache_memory=1 << 30,
            enable_prefix_caching=False,
        )  # every round prefills in full
    vocab = min(32000, engines["torch GEMM"].model.config.vocab_size)
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=1 + decode_tokens, ignore_eos=True)
    runs: dict[str, dict[str, list[float]]] = {label: {"prefill": [], "decode": []} for label in engines}
    tokens: dict[str, list] = {}
    for engine in engines.values():  # warm-up
        engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(rounds):
        for label, engine in engines.items():
            prefill, steps, outputs = _timed_steps(engine, prompts, params, clock)
            runs[label]["prefill"].append(prefill)
            runs[label]["decode"].append(1000 * sorted(steps)[len(steps) // 2])
            tokens[label] = outputs
    what = "CPU time, 1 thread" if threads == 1 else f"wall time, {threads} threads"
    print(f"\n{model} fp32, 64 x {prompt_len} prompt tokens, {what}, {rounds} interleaved rounds (best; all)\n")
    print(f"| GEMM | prefill {64 * prompt_len:,} tokens (s) | decode step, 64 rows (ms, median) | decode tok/s |")
    print("|---|---:|---:|---:|")
    for label, r in runs.items():
        step = min(r["decode"])
        print(
            f"| {label} | {min(r['prefill']):.2f} ({', '.join(f'{v:.2f}' for v in r['prefill'])}) | "
            f"{step:.1f} ({', '.join(f'{v:.1f}' for v in r['decode'])}) | {64000 / step:.1f} |"
        )
    same = sum(tokens["torch GEMM"][i] == tokens["native GEMM"][i] for i in tokens["torch GEMM"])
    print(f"\nsequences with identical tokens (1 + {decode_tokens} each): {same}/64")


def _timed_steps(engine, prompts, params, clock) -> tuple[float, list[float], dict]:
    """Time of the steps until every request has its first token (the prefill), and of each later
    step (decode steps of all 64 rows); the token ids by request."""
    ids = [engine.add_request(p, params) for p in prompts]
    started: set = set()
    prefill, steps, outputs = 0.0, [], {}
    while engine.has_unfinished():
        start = clock()
        outs = engine.step()
        elapsed = clock() - start
        if len(started) < len(ids):
            prefill += elapsed
        elif len(outputs) == 0:
            steps.append(elapsed)
        for out in outs:
            started.add(out.request_id)
            if out.finished:
                outputs[ids.index(out.request_id)] = out.outputs[0].token_ids
    return prefill, steps, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--models", default="llama250m,smollm2")
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}", help="thread counts to run")
    parser.add_argument("--engine", metavar="MODEL", help="end-to-end A/B of the engine on MODEL instead")
    parser.add_argument("--quantization", default="none", help="with --engine (a GGUF model: none = fp32)")
    parser.add_argument("--rounds", type=int, default=3, help="with --engine")
    parser.add_argument("--decode-tokens", type=int, default=16, help="with --engine: decode steps timed")
    parser.add_argument("--prompt-len", type=int, default=128, help="with --engine: prompt tokens of each request")
    args = parser.parse_args()
    module = load_gemm_native()
    print(
        f"CPU: {cpu_line()}; native GEMM: "
        f"{isa_level() if module else native_unavailable_reason()}; torch {torch.__version__}; "
        f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}"
    )
    for threads in dict.fromkeys(int(t) for t in args.threads.split(",")):
        if args.engine:
            engine_ab(args.engine, args.quantization, args.rounds, threads, args.decode_tokens, args.prompt_len)
            continue
        run(args.models.split(","), [int(m) for m in args.rows.split(",")], args.reps, threads)
    print(f"\nload average at the end {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
