"""The command-line side of parallelism: one command starts every rank.

An engine command given ``--tensor-parallel-size`` / ``--pipeline-parallel-size`` > 1 outside
torchrun checks the model can be split (a clear error before any rank starts), then replaces
itself with torchrun's agent (``python -m llmctl.parallel.agent --standalone``: torchrun with a
one-line ending) running the same command line once per rank. Under torchrun (that re-run, or a
multi-node ``torchrun --nnodes ...`` invocation) rank 0 runs the command; every other rank is
diverted into the worker loop.

The agent is the process the user started: Ctrl-C or SIGTERM reach it, and it stops every rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import NoReturn

from llmctl import envs
from llmctl.config import EMBEDDED_MODEL_NAME, EngineConfig
from llmctl.errors import ConfigError
from llmctl.parallel.topology import leave_process_group, under_torchrun

CLI_MODULE = "llmctl.cli"


def divert_parallel_ranks(config: EngineConfig, model_spec: str | None) -> bool:
    """Called by every engine command once its options are parsed. Returns False to run the command
    (rank 0, or a single process); a worker rank runs its loop and ends the process instead."""
    model_dir = check_splittable(config, model_spec)
    if not under_torchrun():
        relaunch_under_torchrun(config.world_size)
    if int(os.environ.get("RANK", "0")) == 0:
        return False
    from llmctl.parallel.worker import run_worker

    run_worker(dataclasses.replace(config, model=model_dir))
    finish_worker_rank()


def finish_worker_rank() -> NoReturn:
    """A worker rank whose engine stopped cleanly: leave the process group in order, then end the
    process without interpreter finalization (nothing of a worker needs it: it prints nothing and
    writes no files), so no C++ thread of the communication library can outlive the interpreter."""
    leave_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_splittable(config: EngineConfig, model_spec: str | None) -> str:
    """The model directory, once it is known that TP x PP can split it; else a ``ConfigError``."""
    from pathlib import Path

    from llmctl.distributed import split_layers
    from llmctl.model_spec import resolve_model
    from llmctl.models.config import ModelConfig

    spec = model_spec or config.model
    what = (
        f"--tensor-parallel-size {config.tensor_parallel_size} --pipeline-parallel-size {config.pipeline_parallel_size}"
    )
    resolved = spec if spec == EMBEDDED_MODEL_NAME else resolve_model(spec)
    if resolved == EMBEDDED_MODEL_NAME or not Path(resolved).is_dir() or resolved.endswith(".gguf"):
        raise ConfigError(
            f"{what}: needs a Hugging Face model directory (config.json + *.safetensors); {spec!r} is not one"
        )
    if config.quantization not in ("auto", "none"):
        raise ConfigError(f"{what}: --quantization {config.quantization} is not supported with parallelism yet")
    cfg = ModelConfig.from_dir(Path(resolved))
    tp = config.tensor_parallel_size
    if cfg.num_heads % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ConfigError(
            f"--tensor-parallel-size {tp} and the model's {cfg.num_kv_heads} KV heads: one must divide the other"
        )
    if cfg.intermediate_size % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the MLP width {cfg.intermediate_size}")
    try:
        split_layers(cfg.num_layers, config.pipeline_parallel_size, envs.LLMCTL_PP_LAYER_PARTITION)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return resolved


def relaunch_under_torchrun(world_size: int) -> None:
    """Replace this process with torchrun's agent running this same command on ``world_size``
    local ranks. Never returns."""
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of oversubscribing them
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    argv = [
        sys.executable,
        "-m",
        "llmctl.parallel.agent",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(world_size),
        "--max-restarts",
        "0",
        "-m",
        CLI_MODULE,
        *sys.argv[1:],
    ]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
