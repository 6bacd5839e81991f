"""Single-stream decode speed of one model with each ``--quantization`` (and float32).

The model is a random-weight Llama with SmolLM2-135M's shapes (30 layers, hidden 576, MLP 1536, 9/3
heads, vocabulary 49,152; built with ``transformers`` into a temporary directory) unless a model
directory is given. Decode tok/s = 32 / (time for 33 tokens - time for 1 token), best of REPEATS.

    python -m benchmarks.kernels.quant_decode [MODEL_DIR] [--kinds none,int8,int4:64,fp8] [--dtype float32]
        [--threads N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from llmctl.engine.llm_engine import LLMEngine
from llmctl.layers.quantization import weight_bytes
from llmctl.sampling_params import SamplingParams

REPEATS = 2
DECODE_TOKENS = 32


def smollm2_shaped(out_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    )
    LlamaForCausalLM(cfg).save_pretrained(out_dir)
    return out_dir


def timed(engine: LLMEngine, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([[1, 450, 4996, 17354]], params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--kinds", default="none,int8,int4:64,fp8")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or smollm2_shaped(Path(tmp) / "smollm2-shaped")
        print(f"model {model_dir.name}, dtype {args.dtype}, {torch.get_num_threads()} threads")
        for spec in args.kinds.split(","):
            kind, _, group = spec.partition(":")
            engine = LLMEngine(
                model=str(model_dir),
                skip_tokenizer=True,
                dtype=args.dtype,
                quantization=kind,
                quantization_group_size=int(group or 64),
                kv_cache_memory=64 << 20,
                num_threads=args.threads,
            )
            timed(engine, 4)  # warm-up (and the native kernels' build, if not cached)
            best = min(timed(engine, DECODE_TOKENS + 1) - timed(engine, 1) for _ in range(REPEATS))
            print(
                f"{spec:8s} {DECODE_TOKENS / best:7.1f} tok/s   weights {weight_bytes(engine.model) / 2**20:7.1f} MiB",
                flush=True,
            )
            del engine


if __name__ == "__main__":
    main()
