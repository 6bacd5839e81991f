"""Starting torchrun jobs from the parallel tests (1 thread per rank: the CI machine has 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def rank_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **extra}


def torchrun(
    *args: str, nproc: int, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        *args,
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=rank_env(**(env or {})), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done
