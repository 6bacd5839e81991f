"""Single-stream decode speed of one model in several engines, on the same prompt ids.

One request, greedy, a fixed prompt, TOKENS new tokens whatever the model says (EOS ignored), one
warm-up then REPS timed runs (median). ``tok_s`` is new tokens / wall time of the whole request
(the prompt is short, so this is decode speed), and ``decode_tok_s`` excludes the first token.

    python -m benchmarks.peers.single_stream llmctl   MODEL OUT.json [--quantization auto|none|int8|int4|fp8]
        [--dtype D] [--kv-cache-dtype auto|int8|fp8_e4m3|fp8_e5m2|kivi2|kivi4]
    python -m benchmarks.peers.single_stream llamacpp MODEL.gguf OUT.json          (llama-cpp-python)
    python -m benchmarks.peers.single_stream hf       MODEL OUT.json [--gguf FILE]  (transformers, fp32)

Each engine runs in the interpreter that has it installed; benchmarks/peers/run_smollm2_comparison.sh
runs them side by side. Output: a RESULT line and OUT.json with the token ids (compare greedy text).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import cpu_record, write_result

PROMPT = "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"


def timed(run: Callable[[], tuple[list[int], float, float]], reps: int) -> dict:
    run()  # warm-up: first-call allocations, kernel builds, caches
    results = [run() for _ in range(reps)]
    wall = statistics.median(r[1] for r in results)
    first = statistics.median(r[2] for r in results)
    ids = results[-1][0]
    best = min(r[1] for r in results)  # on a shared machine the least-disturbed run
    return dict(
        tokens=len(ids),
        wall_s=round(wall, 3),
        tok_s=round(len(ids) / wall, 1),
        best_tok_s=round(len(ids) / best, 1),
        decode_tok_s=round((len(ids) - 1) / (wall - first), 1),
        ttft_s=round(first, 4),
        out_ids=ids,
    )


def run_llmctl(model: str, tokens: int, reps: int, args: argparse.Namespace) -> dict:
    import torch

    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(
        model=model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=4,
        kv_cache_memory=256 << 20,
        max_model_len=1024,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def run() -> tuple[list[int], float, float]:
        start = time.perf_counter()
        first = None
        engine.add_request(prompt, params)
        ids: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                ids = out.outputs[0].token_ids
                if first is None and ids:
                    first = time.perf_counter() - start
        return ids, time.perf_counter() - start, first or 0.0

    result = timed(run, reps)
    result["engine"] = (
        f"llmctl ({engine.dtype}, quantization {args.quantization}, {engine.ops.description}, "
        f"{engine.runner.decode_path})"
    )
    return result


def run_llamacpp(model: str, tokens: int, reps: int, args: argparse.Namespace) -> dict:
    from llama_cpp import Llama

    threads = args.threads or os.cpu_count()
    llm = Llama(model_path=model, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)

    def run() -> tuple[list[int], float, float]:
        start = time.perf_counter()
        first = None
        ids: list[int] = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            ids.append(token)
            if first is None:
                first = time.perf_counter() - start
            if len(ids) == tokens:
                break
        return ids, time.perf_counter() - start, first or 0.0

    result = timed(run, reps)
    result["engine"] = f"llama.cpp (llama-cpp-python, {threads} threads)"
    return result


def run_hf(model: str, tokens: int, reps: int, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {"gguf_file": args.gguf} if args.gguf else {}
    tok = AutoTokenizer.from_pretrained(model, **extra)
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **extra).eval()
    prompt = torch.tensor([tok.encode(PROMPT, add_special_tokens=False)])

    def run() -> tuple[list[int], float, float]:
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            first = time.perf_counter() - start  # a one-token run stands in for the first token's time
            start = time.perf_counter()
            out = hf.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return out[0, prompt.shape[1] :].tolist(), time.perf_counter() - start, first

    result = timed(run, reps)
    result["engine"] = f"transformers ({str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads)"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", choices=("llmctl", "llamacpp", "hf"))
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=int(os.environ.get("REPS", "3")))
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="llmctl: the KV cache's dtype (int8, kivi2, ...)")
    parser.add_argument("--gguf", default=None, help="hf: load this GGUF file from MODEL's directory")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    runner = {"llmctl": run_llmctl, "llamacpp": run_llamacpp, "hf": run_hf}[args.engine]
    result = runner(args.model, args.tokens, args.reps, args) | cpu_record()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
