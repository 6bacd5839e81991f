#!/usr/bin/env bash
# One prepared GPU check for llmctl's Triton kernels, for a fresh CUDA machine holding only the repo.
#
#   bash scripts/gpu_check.sh            # logs and results land in $OUT (or /tmp/llmctl_gpu_check)
#   bash scripts/gpu_check.sh --dry-run  # the same plumbing on a CPU: a few interpreter tests and
#                                        # the benchmark's --dry-run, with .venv's python
#
# 1. finds a python whose torch sees a CUDA device and has triton (the image's python3 first; it
#    never installs a CPU torch over it), 2. runs tests/kernels on the GPU (compiled kernels, no
#    interpreter; test_triton_kv_quant.py there covers the quantized KV cache: every
#    --kv-cache-dtype's store, decode and prefill against the torch references), 3. runs
#    benchmarks/kernels/gpu_kernels.py (one table: decode GB/s vs peak, prefill vs SDPA, elementwise
#    kernels, one decoder layer's decode step). Every stage runs even if an
#    earlier one failed; the exit code is non-zero if any did. Each stage has its own timeout, so
#    the whole check stays well under 10 minutes.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd)"
RESULTS="${OUT:-/tmp/llmctl_gpu_check}"
mkdir -p "$RESULTS"
TEST_TIMEOUT="${LLMCTL_GPU_TEST_TIMEOUT:-330}"
BENCH_TIMEOUT="${LLMCTL_GPU_BENCH_TIMEOUT:-200}"

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=1
fi

export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export TOKENIZERS_PARALLELISM=false
# kernels/ imports as llmctl_kernels (pyproject.toml's package-dir). A bare python here has no install
# of the repo, so a link in a temporary folder gives the folder that name.
SHIM="$(mktemp -d)"
ln -s "$REPO/kernels" "$SHIM/llmctl_kernels"
export PYTHONPATH="$REPO:$SHIM${PYTHONPATH:+:$PYTHONPATH}"
if [[ $DRY == 1 ]]; then
    export TRITON_INTERPRET=1
    export LLMCTL_TEST_DEVICE=cpu
else
    export TRITON_INTERPRET=0      # tests/conftest.py only *defaults* it to 1
    export LLMCTL_TEST_DEVICE=cuda # tests/kernels run on the GPU
fi

T0=$(date +%s)
section() { echo; echo "==== $* [$(( $(date +%s) - T0 ))s]"; }

section "python with torch + triton"
PY=""
if [[ $DRY == 1 ]]; then
    PY="$REPO/.venv/bin/python"
    [[ -x "$PY" ]] || PY="$(command -v python3)"
else
    for cand in python3 /opt/torch/.venv/bin/python3 python "$REPO/.venv/bin/python"; do
        if command -v "$cand" >/dev/null 2>&1 &&
            "$cand" -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
            PY="$(command -v "$cand")"
            break
        fi
    done
fi
if [[ -z "$PY" ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "FATAL: no CUDA device here (no nvidia-smi); use --dry-run on a CPU machine"
        exit 1
    fi
    echo "no python with a CUDA torch and triton found; trying 'pip install torch triton' (needs a registry)"
    if timeout 300 python3 -m pip install -q torch triton pytest &&
        python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        PY="$(command -v python3)"
    else
        echo "FATAL: no usable CUDA torch + triton on this machine"
        exit 1
    fi
fi
echo "python: $PY"
"$PY" -c '
import torch, triton
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, cc {p.major}.{p.minor}")
'
if [[ $DRY == 0 ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
fi
if ! "$PY" -c 'import pytest' >/dev/null 2>&1; then
    echo "FATAL: pytest is missing for $PY"
    exit 1
fi

section "kernel tests on $LLMCTL_TEST_DEVICE (tests/kernels, TRITON_INTERPRET=$TRITON_INTERPRET)"
EXTRA=()
if [[ $DRY == 1 ]]; then
    EXTRA=(-k "select_ops or split_heuristic or more_splits or (varlen_batches and single) or dequantized_value")
elif "$PY" -c 'import xdist' >/dev/null 2>&1; then
    EXTRA=(-n 8)  # parallel workers: mostly parallel Triton compiles
fi
set +e
timeout --signal=INT --kill-after=20 "$TEST_TIMEOUT" \
    "$PY" -m pytest tests/kernels -q -rfEs -p no:cacheprovider -o addopts="" \
    --continue-on-collection-errors ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | tee "$RESULTS/kernel_tests.log"
TEST_RC=${PIPESTATUS[0]}
set -e
echo "kernel tests exit code: $TEST_RC"

section "microbenchmarks (benchmarks/kernels/gpu_kernels.py)"
BENCH_ARGS=(--json "$RESULTS/gpu_kernels.json")
if [[ $DRY == 1 ]]; then
    BENCH_ARGS+=(--dry-run)
fi
set +e
timeout --signal=INT --kill-after=20 "$BENCH_TIMEOUT" \
    "$PY" -m benchmarks.kernels.gpu_kernels "${BENCH_ARGS[@]}" 2>&1 | tee "$RESULTS/gpu_kernels.log"
BENCH_RC=${PIPESTATUS[0]}
set -e
echo "benchmarks exit code: $BENCH_RC"

section "summary"
echo "kernel tests: $([[ $TEST_RC == 0 ]] && echo PASS || echo "FAIL (rc=$TEST_RC)")"
echo "benchmarks:   $([[ $BENCH_RC == 0 ]] && echo OK || echo "FAIL (rc=$BENCH_RC)")"
echo "results in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
echo "total: $(( $(date +%s) - T0 ))s"
[[ $TEST_RC == 0 && $BENCH_RC == 0 ]]
