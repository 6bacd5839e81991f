"""CPU time per decoded token of one stream, for comparing two checkouts on a busy machine.

On a shared machine wall time measures the other sessions; the CPU time of one thread measures the
work a decode step does. Run it with ``OMP_NUM_THREADS=1``, alternating the checkouts (A B A B):

    cd <checkout> && OMP_NUM_THREADS=1 python -m benchmarks.features.decode_cpu_time [MODEL] \\
        [--quantization Q] [--tokens N]

(``-m`` puts the current folder first on ``sys.path``: llmctl is imported from the checkout it runs in.)

Prints the least and every measured CPU ms per token (3 runs of N/3 decode steps after a prefill).
"""

from __future__ import annotations

import argparse
import time

import torch

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine(
        model=args.model,
        quantization=args.quantization,
        dtype=args.dtype,
        max_num_seqs=4,
        kv_cache_memory=256 << 20,
        max_model_len=1024,
    )
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    engine.step()  # the prefill
    per_token = []
    for _ in range(3):
        start, steps = time.process_time(), args.tokens // 3 - 1
        for _ in range(steps):
            engine.step()
        per_token.append(1000 * (time.process_time() - start) / steps)
    while engine.has_unfinished():
        engine.step()
    print(
        f"{args.model} quantization {args.quantization}: CPU ms/token (1 thread) least "
        f"{min(per_token):.2f}, all {[round(t, 2) for t in per_token]}"
    )


if __name__ == "__main__":
    main()
