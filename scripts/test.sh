#!/usr/bin/env bash
# The test command: install (scripts/setup.sh --dev), lint (ruff), the whole suite, then the tests marked `native`
# (native CPU kernels, the decode loop, the dtype choice, exactness against transformers) twice more
# with every kernel library's dispatch capped: as an AVX2-only CPU and as one without AVX2
# (scripts/emulate_isa.sh; not the level this machine is). A path this machine's CPU would never take
# is still run and checked.
#   scripts/test.sh              everything (what CI runs)
#   scripts/test.sh --fast       the inner loop: no slow, subprocess or parallel tests, no capped runs
#   scripts/test.sh PYTEST_ARGS  pytest with those arguments (a file, -k NAME, -m native ...), no capped runs
# Kernel tests run Triton's interpreter on the CPU (TRITON_INTERPRET=1, also set by tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
export TRITON_INTERPRET=1
PYTEST=(.venv/bin/python -m pytest -q)
if [ "${1:-}" = --fast ]; then
  shift
  exec "${PYTEST[@]}" -m "not slow and not subprocess and not parallel" "$@"
fi
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
echo "== ruff: lint and format check"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
# The suite on workers, one a core and at most 4 (each test process holds a model or a server; tests
# that start servers, ranks or CLIs wait on them much of the time, so even 2 cores run 2 workers
# well). Each worker keeps its 2 compute threads (tests/conftest.py), so the OpenMP teams wait
# passively: spinning teams of workers that share cores took tests/kernels and tests/layers from
# 104 s to 165 s on a 2-core Zen 3. The capped runs below stay in one process: their tests
# compute, and a worker's start (torch, transformers) cost more than it saved.
workers=$(( $(nproc) < 4 ? $(nproc) : 4 ))
OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" "${PYTEST[@]}" -n "$workers"
own=$(.venv/bin/python -c "from llmctl_kernels.cpu_features import isa_level; print(isa_level())")
for level in avx2 generic; do
  if [ "$level" = "$own" ]; then
    echo "== the native tests as a $level CPU: this machine is one, the suite above took those paths"
    continue
  fi
  echo "== the native tests again, as a CPU whose best instruction set is $level (scripts/emulate_isa.sh)"
  scripts/emulate_isa.sh "$level" "${PYTEST[@]}" -m native -p no:cacheprovider
done
