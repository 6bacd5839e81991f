#!/usr/bin/env bash
# Every speed goal of docs/benchmarks.md in one run (about 10 minutes on 2 cores), then the table of
# goal, measured value and met or not (benchmarks/peers/issue_goals.py), with the CPU model and flags:
#   - run_peer_comparison.sh (fp32): vLLM, transformers, llmctl on the 246M Llama, 64 x 128 -> 128;
#     on a CPU with AMX, once more in bf16 (the dtype `--dtype auto` picks there)
#   - run_smollm2_comparison.sh: SmolLM2-135M one stream, llama.cpp / llmctl / transformers
#   - llmctl bench smollm2-135m --concurrency 64 --quantization int8
#   - the README's main command, llmctl bench --concurrency 64
#   - spec_decode.py: n-gram speculation on the edit workload, fp32 weights
#
# usage: PEER_WORK=DIR PEER_PY=PYTHON benchmarks/peers/issue_goals.sh
#   PEER_WORK: the vLLM peer folder (../shared/peer/README.txt); PEER_PY: a python with
#   llama-cpp-python. EMULATE_ISA=avx2 LLAMA_AVX2=DIR: every engine on its AVX2 code paths, as in
#   the two comparison scripts. LLAMA_DIR=DIR: llama.cpp from DIR (run_smollm2_comparison.sh says
#   when). Results go to OUT (default results/goals-<UTC time>). ROUNDS=N:
#   N whole rounds (OUT/round-1 ... round-N), then each goal's verdict per round and its median: on
#   a shared machine one run's ratio moves by +-15 %.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the checkout's root: the benchmarks run as modules from there
RESULTS=${OUT:-results/goals-$(date -u +%Y%m%dT%H%M%S)}
PY=${PY:-.venv/bin/python}
ROUNDS=${ROUNDS:-1}

# One round of every measurement into folder $1.
run_round() {
  local dir=$1
  mkdir -p "$dir"
  rm -f "$dir/EMULATE_ISA"
  if [ -n "${EMULATE_ISA:-}" ]; then echo "$EMULATE_ISA" > "$dir/EMULATE_ISA"; fi
  OUT=$dir/peer DTYPE=float32 REPS=1 benchmarks/peers/run_peer_comparison.sh
  if [ -z "${EMULATE_ISA:-}" ] && grep -qw amx_tile /proc/cpuinfo; then  # on an AMX CPU, bf16 as well
    OUT=$dir/peer DTYPE=bfloat16 REPS=1 benchmarks/peers/run_peer_comparison.sh  # (the dtype --dtype auto picks there)
  fi
  OUT=$dir/smollm2 REPS=3 benchmarks/peers/run_smollm2_comparison.sh
  (
    if [ "${EMULATE_ISA:-}" = avx2 ]; then  # llmctl's own runs: its kernels and torch's held to AVX2
      export LLMCTL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
    fi
    .venv/bin/llmctl bench smollm2-135m --concurrency 64 --quantization int8 --json "$dir/bench_int8.json" | tail -4
    .venv/bin/llmctl bench --concurrency 64 --json "$dir/bench_readme.json" | tail -4
    "$PY" -m benchmarks.features.spec_decode --rounds 3 --num-speculative-tokens 4 --quantization none \
      --out "$dir/spec_ngram.json" | grep RESULT
  )
}

if [ "$ROUNDS" -le 1 ]; then
  run_round "$RESULTS"
else  # whole rounds one after another: every engine meets the machine's slow and fast spells alike
  for round in $(seq 1 "$ROUNDS"); do run_round "$RESULTS/round-$round"; done
  rm -f "$RESULTS/EMULATE_ISA"
  if [ -n "${EMULATE_ISA:-}" ]; then echo "$EMULATE_ISA" > "$RESULTS/EMULATE_ISA"; fi
fi
"$PY" -m benchmarks.peers.issue_goals "$RESULTS" --json "$RESULTS/goals.json"
