"""A mixture-of-experts model served side by side: llmctl, llama.cpp's ``llama-server`` and
transformers on one random-weight MoE. ``--family qwen3moe`` (the default): Qwen3-MoE's shape,
about 1.3B parameters in all and 0.23B active per token (64 experts of which 8 run, 24 layers,
hidden size 1024, expert width 256, a 16,384-token vocabulary), served as Q4_K_M. ``--family
gpt-oss``: gpt-oss's proportions scaled down, about 1.0B in all and 0.17B active (32 experts of
which 4 run, 16 layers, hidden size and expert width 768, attention sinks, alternating sliding
layers), served as llama.cpp's ``MXFP4_MOE`` (experts MXFP4, the rest Q8_0), as gpt-oss ships.

The checkpoint is built with transformers, written to GGUF by llama.cpp's own
``convert_hf_to_gguf.py`` (F16) and quantized by ``llama-quantize`` (the family's type, or
``--type``). Both servers serve that one file and are driven by ``llmctl bench --url`` with
the same workload: 128 -> 128 tokens, one stream (8 prompts) and 64 concurrent (128 prompts).
transformers decodes from the fp32 checkpoint in process (one stream, and a batch of 64).

Bytes read per decoded token: the file's active-parameter floor (every tensor but the embedding
table, the expert tensors counted at ``top_k / experts`` of their size) beside what llmctl's
server reports (its weight bytes, less the experts no token of a pass chose, from
``/v1/engine/stats``' ``experts.read_share_per_step``, less the embedding table), per token.

    python -m benchmarks.moe_comparison --llama-server BIN [--family qwen3moe|gpt-oss] [--quantize BIN]
        [--type Q4_K_M] [--work DIR] [--cases c1,c64] [--no-transformers]

``--quantize`` defaults to ``llama-quantize`` beside the ``llama-server`` binary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness import cpu_record, write_result
from benchmarks.served_comparison import CASES, Case, bench, free_port, llama_server, serving

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

QWEN3_MOE_SHAPE = dict(
    vocab_size=16384,
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2048,  # unused: every layer is sparse
    moe_intermediate_size=256,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    mlp_only_layers=[],
    decoder_sparse_step=1,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
GPT_OSS_SHAPE = dict(
    vocab_size=16384,
    hidden_size=768,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=768,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class Family:
    config_class: str  # transformers' config class
    shape: dict
    checkpoint: str  # folder name under --work
    stem: str  # GGUF file names: <stem>-<type>.gguf
    qtype: str  # llama-quantize type served by default

    @property
    def active_share(self) -> float:
        experts = self.shape.get("num_experts") or self.shape["num_local_experts"]
        return self.shape["num_experts_per_tok"] / experts


FAMILIES = {
    "qwen3moe": Family("Qwen3MoeConfig", QWEN3_MOE_SHAPE, "qwen3-moe-1.3b-a0.23b", "moe-1.3b-a0.23b", "Q4_K_M"),
    "gpt-oss": Family("GptOssConfig", GPT_OSS_SHAPE, "gpt-oss-1.0b-a0.17b", "gpt-oss-1.0b-a0.17b", "MXFP4_MOE"),
}


def build_checkpoint(family: Family, model_dir: Path) -> Path:
    """The family's random-weight checkpoint (fp32 safetensors) and its tokenizer, made once."""
    if (model_dir / "config.json").is_file():
        return model_dir
    import transformers
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(TESTS))
    from llama_cpp_converter import write_llama_tokenizer

    torch.manual_seed(0)
    config = getattr(transformers, family.config_class)(**family.shape)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(model_dir)
    write_llama_tokenizer(model_dir, family.shape["vocab_size"])
    return model_dir


def build_gguf(family: Family, model_dir: Path, work: Path, quantize: Path, qtype: str) -> Path:
    """llama.cpp's converter (F16), then ``llama-quantize`` to ``qtype``; made once."""
    sys.path.insert(0, str(TESTS))
    from llama_cpp_converter import convert

    out = work / f"{family.stem}-{qtype}.gguf"
    if out.is_file():
        return out
    f16 = work / f"{family.stem}-F16.gguf"
    if not f16.is_file():
        convert(model_dir, f16, "f16", pre_tokenizer="default")
    subprocess.run([str(quantize), str(f16), str(out), qtype], check=True, stdout=subprocess.DEVNULL)
    return out


def file_bytes(path: Path, active_share: float) -> dict[str, float]:
    """From the GGUF's tensor table: the bytes of the embedding table, of the expert tensors, of
    everything else, and the active-parameter floor per token (all but the embedding table, the
    experts at ``top_k / experts``)."""
    from gguf import GGUFReader

    embedding = experts = other = 0
    for tensor in GGUFReader(str(path)).tensors:
        size = int(tensor.n_bytes)
        if tensor.name == "token_embd.weight":
            embedding += size
        elif "_exps." in tensor.name:
            experts += size
        else:
            other += size
    return {"embedding": embedding, "experts": experts, "other": other, "floor": other + active_share * experts}


def fetch_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def llmctl_case(model: Path, case: Case, out_dir: Path, files: dict[str, float]) -> dict:
    """``llmctl serve`` on the file, ``llmctl bench --url`` against it, and the bytes its passes read."""
    port = free_port()
    cmd = [
        *(sys.executable, "-m", "llmctl.cli", "serve", str(model), "--port", str(port)),
        *("--log-level", "warning", "--no-access-log", "--max-model-len", str(case.input_len + case.output_len + 64)),
    ]
    with serving(cmd, port) as url:
        result = bench(url, str(model), case, out_dir / f"llmctl_{case.name}.json")
        stats = fetch_json(f"{url}/v1/engine/stats?max_steps=64")
        status = fetch_json(f"{url}/v1/models/status")
    experts = stats["experts"]
    weights = status["models"][0]["weights_bytes"]
    steps = [s for s in stats["steps"] if s["decode_tokens"] and not s["prefill_tokens"]]
    tokens_per_pass = sum(s["decode_tokens"] for s in steps) / len(steps) if steps else 1.0
    per_pass = weights - files["embedding"] - experts["weight_bytes"] * (1 - experts["read_share_per_step"])
    row = _row("llmctl", case, result)
    row |= {
        "weights_mb": round(weights / 1e6, 1),
        "expert_read_share": round(experts["read_share_per_step"], 3),
        "decode_tokens_per_pass": round(tokens_per_pass, 1),
        "bytes_per_token_mb": round(per_pass / tokens_per_pass / 1e6, 2),
    }
    return row


def llama_case(binary: str, model: Path, case: Case, out_dir: Path) -> dict:
    port = free_port()
    with serving(llama_server(binary, str(model), port, case), port) as url:
        result = bench(url, str(model), case, out_dir / f"llama-server_{case.name}.json")
    return _row("llama-server", case, result)


def _row(engine: str, case: Case, result: dict) -> dict:
    return {
        "engine": engine,
        "case": case.name,
        "concurrency": case.concurrency,
        "output_tok_s": round(result["output_throughput"], 1),
        "stream_tok_s_median": round(result["stream_tokens_per_s_median"] or 0.0, 1),
        "ttft_ms_median": round(result["ttft_ms"]["median"], 1),
        "failed": result["failed"],
    }


def transformers_rows(model_dir: Path, vocab_size: int, prompt_len: int = 128) -> list[dict]:
    """transformers' fp32 greedy decode in process: one stream (64 new tokens) and a batch of 64
    equal-length prompts (16 new tokens); decode tok/s with the prefill's time taken off."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, new_tokens in ((1, 64), (64, 16)):
        ids = torch.randint(3, vocab_size, (batch, prompt_len), generator=gen)

        def run(n: int, ids: torch.Tensor = ids) -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return time.perf_counter() - start

        run(2)  # warm-up
        prefill = run(1)
        total = run(new_tokens + 1)
        tok_s = batch * new_tokens / (total - prefill)
        rows.append(
            {
                "engine": "transformers",
                "case": "c1" if batch == 1 else "c64",
                "concurrency": batch,
                "output_tok_s": round(tok_s, 1),
                "stream_tok_s_median": round(tok_s / batch, 1),
                "ttft_ms_median": round(prefill * 1e3, 1),
                "failed": 0,
            }
        )
        print(f"transformers  b={batch:<3} {tok_s:8.1f} tok/s decode (prefill {prefill:.2f} s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="llama-server (../shared/peer/build_llama_cpp.sh)")
    parser.add_argument("--quantize", default=None, help="llama-quantize (default: beside llama-server)")
    parser.add_argument("--family", default="qwen3moe", choices=list(FAMILIES))
    parser.add_argument("--type", default=None, help="llama-quantize type of the served file (default: the family's)")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "llmctl-bench" / "moe")
    parser.add_argument("--cases", default="c1,c64", help=f"any of {', '.join(CASES)}")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "moe_comparison")
    args = parser.parse_args()
    quantize = Path(args.quantize or Path(args.llama_server).with_name("llama-quantize"))
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[args.family]
    model_dir = build_checkpoint(family, args.work / family.checkpoint)
    gguf = build_gguf(family, model_dir, args.work, quantize, args.type or family.qtype)
    files = file_bytes(gguf, family.active_share)
    record = cpu_record() | {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "file": gguf.name}
    print(f"# {record['cpu']} · {record['cpus']} CPUs · {record['isa']} · {gguf.name}")
    size_mb = gguf.stat().st_size / 1e6
    print(f"# active-parameter floor: {files['floor'] / 1e6:.1f} MB per token (file: {size_mb:.0f} MB)")
    rows = []
    for name in args.cases.split(","):
        case = CASES[name]
        for row in (llmctl_case(gguf, case, args.out, files), llama_case(args.llama_server, gguf, case, args.out)):
            rows.append(row)
            extra = f"  {row['bytes_per_token_mb']} MB/token" if "bytes_per_token_mb" in row else ""
            print(
                f"{row['engine']:<13} {name:<4} c={case.concurrency:<3} {row['output_tok_s']:>8} tok/s  "
                f"stream {row['stream_tok_s_median']:>6} tok/s  TTFT {row['ttft_ms_median']:>8} ms{extra}",
                flush=True,
            )
    if not args.no_transformers:
        rows += transformers_rows(model_dir, family.shape["vocab_size"])
    write_result(
        record | {"floor_mb_per_token": round(files["floor"] / 1e6, 2), "rows": rows},
        args.out / f"moe-{args.family}.json",
    )


if __name__ == "__main__":
    main()
