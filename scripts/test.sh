#!/usr/bin/env bash
# The test command: install (scripts/setup.sh), then run the whole suite.
# Kernel tests run Triton's interpreter on the CPU (TRITON_INTERPRET=1, also set by tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q "$@"
