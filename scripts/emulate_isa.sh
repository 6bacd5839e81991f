#!/usr/bin/env bash
# Run a command as a smaller x86 CPU would: every kernel library's run-time dispatch capped at LEVEL.
#   scripts/emulate_isa.sh avx2 CMD [ARGS...]     # an AVX2-only CPU (Zen 3): no AVX-512, VNNI, AMX, bf16
#   scripts/emulate_isa.sh generic CMD [ARGS...]  # no AVX2 either: llmctl's scalar kernels
# llmctl's kernels (LLMCTL_CPU_ISA), torch's (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA), MKL's
# (MKL_ENABLE_INSTRUCTIONS) and torch's CPU probes (scripts/emulated_cpu/sitecustomize.py) all follow it.
# The core itself (caches, clock, bandwidth) stays this machine's: figures from it compare code paths.
set -euo pipefail
level=${1:?usage: scripts/emulate_isa.sh avx2|generic CMD [ARGS...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
case "$level" in
  avx2) export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ;;
  generic) export ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2 ;;
  *) echo "scripts/emulate_isa.sh: unknown level '$level' (avx2 or generic)" >&2; exit 2 ;;
esac
export EMULATE_ISA=$level LLMCTL_CPU_ISA=$level
export PYTHONPATH=$here/emulated_cpu${PYTHONPATH:+:$PYTHONPATH}
exec "$@"
