"""How fast the peer workload could run on this CPU at all, and how near each engine came.

Measures the machine's ceilings with register-only and streaming loops (compiled here with gcc,
OpenMP over T threads): fused multiply-add throughput in fp32 (AVX2 ymm; AVX-512 zmm where the CPU
has it), ``vdpbf16ps`` where it has AVX512-BF16, and the rate at which T threads read a 1 GiB
buffer. Then bounds the peer workload (benchmarks/peers/peer_workload.py: 64 requests x 128 prompt
tokens -> 128 tokens, greedy) of a Llama ``config.json``: every prefill step at the FMA peak, every
decode step at the slower of its arithmetic (at the peak) and its bytes (weights and the KV cache
it reads, at the read rate). No engine beats that floor; the floor over an engine's wall time is
the share of the machine it used, and floor / (peer's wall / R) says whether a ratio R over that
peer can be reached at all.

    python -m benchmarks.peers.cpu_roofline MODEL_DIR [--dtype float32] [--threads 2] [--isa native|avx2]
        [--results DIR]   # run_peer_comparison.sh's JSON files: each engine against the floor

``--isa avx2`` takes the AVX2 ceilings (what ``EMULATE_ISA=avx2`` runs every engine on).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from llmctl_kernels.cpu_features import cpu_flags, cpu_model

N_REQ, PROMPT_LEN, OUT_LEN = 64, 128, 128  # benchmarks/peers/peer_workload.py

PROBE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define CHAINS 12
#define ITERS 20000000L

__attribute__((target("avx2,fma"))) static float fma_ymm(void) {
  __m256 a[CHAINS], b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_ps((float)i);
  for (long it = 0; it < ITERS; it++)
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
  float s = 0; float out[8];
  for (int i = 0; i < CHAINS; i++) { _mm256_storeu_ps(out, a[i]); s += out[0]; }
  return s;
}
#ifdef HAVE_AVX512
__attribute__((target("avx512f"))) static float fma_zmm(void) {
  __m512 a[CHAINS], b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_ps((float)i);
  for (long it = 0; it < ITERS; it++)
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
  float s = 0;
  for (int i = 0; i < CHAINS; i++) s += _mm512_reduce_add_ps(a[i]);
  return s;
}
#endif
#ifdef HAVE_BF16
__attribute__((target("avx512f,avx512bf16"))) static float dp_bf16(void) {
  __m512 a[CHAINS];
  __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80), c = (__m512bh)_mm512_set1_epi16(0x3380);
  for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_ps((float)i);
  for (long it = 0; it < ITERS; it++)
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_dpbf16_ps(a[i], b, c);
  float s = 0;
  for (int i = 0; i < CHAINS; i++) s += _mm512_reduce_add_ps(a[i]);
  return s;
}
#endif

__attribute__((target("avx2"))) static double read_rate(float *buf, long n, int threads) {
  double best = 0;
  for (int rep = 0; rep < 5; rep++) {
    double t = omp_get_wtime();
    float total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total)
    for (long i = 0; i < n; i += 32) {
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(buf + i), _mm256_load_ps(buf + i + 8)),
                               _mm256_add_ps(_mm256_load_ps(buf + i + 16), _mm256_load_ps(buf + i + 24)));
      float out[8]; _mm256_storeu_ps(out, s); total += out[0];
    }
    t = omp_get_wtime() - t;
    if (total == 12345.f) printf("#");
    if (n * 4.0 / t > best) best = n * 4.0 / t;
  }
  return best;
}

static double rate(float (*fn)(void), int threads, double flops_per_op) {
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    double t = omp_get_wtime(); float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += fn();
    t = omp_get_wtime() - t;
    if (sink == 12345.f) printf("#");
    double r = threads * (double)ITERS * CHAINS * flops_per_op / t;
    if (r > best) best = r;
  }
  return best;
}

int main(int argc, char **argv) {
  int threads = atoi(argv[1]);
  printf("fma_ymm %.6e\n", rate(fma_ymm, threads, 16));
#ifdef HAVE_AVX512
  printf("fma_zmm %.6e\n", rate(fma_zmm, threads, 32));
#endif
#ifdef HAVE_BF16
  printf("dp_bf16 %.6e\n", rate(dp_bf16, threads, 64));
#endif
  long n = 1L << 28;  /* 1 GiB of float */
  float *buf = aligned_alloc(64, n * 4);
#pragma omp parallel for num_threads(threads)
  for (long i = 0; i < n; i++) buf[i] = 1.0f;
  printf("read %.6e\n", read_rate(buf, n, threads));
  return 0;
}
"""


def measure_ceilings(threads: int, isa: str) -> dict[str, float]:
    """FLOP/s of each FMA kind and bytes/s of reading, from the probe compiled for this CPU."""
    flags = cpu_flags()
    defines = []
    if isa == "native" and "avx512f" in flags:
        defines.append("-DHAVE_AVX512")
        if "avx512_bf16" in flags:
            defines.append("-DHAVE_BF16")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "probe.c", Path(tmp) / "probe"
        source.write_text(PROBE)
        subprocess.run(["gcc", "-O3", "-fopenmp", *defines, str(source), "-o", str(binary)], check=True)
        out = subprocess.run([str(binary), str(threads)], check=True, capture_output=True, text=True).stdout
    return {name: float(value) for name, value in (line.split() for line in out.splitlines() if " " in line)}


def workload_floor(config: dict, dtype_bytes: int, flops_per_s: float, bytes_per_s: float) -> dict[str, float]:
    """Seconds the peer workload takes at least: prefill steps at the FMA rate, each decode step at
    the slower of its arithmetic and its bytes (all weights, and the KV cache every sequence reads)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim, vocab = config.get("head_dim") or h // heads, config["vocab_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * inter
    head_params = vocab * h
    per_token = 2 * layers * layer_params  # the linear layers' FLOPs of one token
    prefill_tokens = N_REQ * PROMPT_LEN
    # prefill: every prompt token through the layers, causal attention (QK and PV), one LM-head row
    # per sequence (its first output token)
    prefill_flops = (
        prefill_tokens * per_token
        + N_REQ * 2 * head_params
        + N_REQ * layers * 2 * 2 * heads * head_dim * PROMPT_LEN * (PROMPT_LEN + 1) / 2
    )
    prefill_s = prefill_flops / flops_per_s
    decode_s, kv_bytes_total = 0.0, 0.0
    weight_bytes = (layers * layer_params + head_params) * dtype_bytes
    for step in range(1, OUT_LEN):  # each sequence feeds back output tokens 1 .. OUT_LEN - 1
        context = PROMPT_LEN + step
        flops = N_REQ * (per_token + 2 * head_params + layers * 4 * heads * head_dim * context)
        kv_bytes = N_REQ * layers * 2 * kv * context * dtype_bytes
        kv_bytes_total += kv_bytes
        decode_s += max(flops / flops_per_s, (weight_bytes + kv_bytes) / bytes_per_s)
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "floor_s": prefill_s + decode_s,
        "params": layers * layer_params + 2 * head_params,
        "kv_gb_read": kv_bytes_total / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="native", choices=["native", "avx2"])
    parser.add_argument("--results", type=Path, help="a run_peer_comparison.sh OUT folder")
    args = parser.parse_args()
    ceilings = measure_ceilings(args.threads, args.isa)
    shown = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
    print(f"CPU: {cpu_model()}; ISA: {' '.join(f for f in shown if f in cpu_flags())}")
    print(
        "  ".join(
            f"{name} {value / 1e9:.1f} {'GB/s' if name == 'read' else 'GFLOP/s'}" for name, value in ceilings.items()
        )
        + f"  ({args.threads} threads, {args.isa})"
    )
    if args.dtype == "bfloat16":
        if "dp_bf16" not in ceilings:
            raise SystemExit("bfloat16: this CPU (or --isa) has no vdpbf16ps; the floor would be fp32's")
        peak, name = ceilings["dp_bf16"], "vdpbf16ps"
    else:
        peak, name = max((v, k) for k, v in ceilings.items() if k.startswith("fma"))
    config = json.loads((args.model_dir / "config.json").read_text())
    floor = workload_floor(config, 2 if args.dtype == "bfloat16" else 4, peak, ceilings["read"])
    print(
        f"{args.model_dir.name} ({floor['params'] / 1e6:.1f}M params), {args.dtype}, {N_REQ} x {PROMPT_LEN} -> "
        f"{OUT_LEN}: floor {floor['floor_s']:.2f} s = prefill {floor['prefill_s']:.2f} s at {name} "
        f"{peak / 1e9:.0f} GFLOP/s + decode {floor['decode_s']:.2f} s (KV read {floor['kv_gb_read']:.1f} GB) "
        f"-> at most {N_REQ * OUT_LEN / floor['floor_s']:.0f} output tok/s"
    )
    if args.results is None:
        return
    walls = {}
    for path in sorted(args.results.glob(f"*_{args.dtype}.json")):
        result = json.loads(path.read_text())
        walls[path.stem] = result["wall_s"]
        print(
            f"  {path.stem:32s} {result['wall_s']:7.2f} s  {result['out_tok_s']:7.1f} tok/s  "
            f"{100 * floor['floor_s'] / result['wall_s']:5.1f} % of the floor's speed"
        )
    peer = walls.get(f"vllm_{args.dtype}")
    if peer:
        print(
            f"  the most any engine can lead vLLM by here: {peer / floor['floor_s']:.2f}x "
            f"(1.3x needs {100 * 1.3 * floor['floor_s'] / peer:.0f} % of the floor's speed)"
        )


if __name__ == "__main__":
    main()
