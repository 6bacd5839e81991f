"""Process groups and this rank's place in them.

Global rank ``r`` is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp``, so a stage's
ranks are adjacent (on one node when a node holds a multiple of ``tp`` ranks). Three kinds of
traffic use three groups:

* control (rank 0 -> all, the per-step batch): gloo, on the CPU, with a long timeout, because a
  server may sit idle for hours while the workers wait for the next step;
* tensor-parallel all-reduce / all-gather inside a stage: NCCL on CUDA, gloo on a CPU;
* pipeline hand-offs (hidden states stage to stage, logits back to rank 0): point-to-point on the
  default group.
"""

from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmctl import envs
from llmctl.config import EngineConfig
from llmctl.distributed import PipelineStage, TensorParallel, split_layers
from llmctl.errors import ConfigError
from llmctl.parallel.watchdog import watch_parent

CONTROL_TIMEOUT = timedelta(days=30)  # idle servers: workers wait this long for the next step


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    tp: TensorParallel
    pp_size: int
    stage_index: int
    stage: PipelineStage
    control_group: Any  # gloo group over every rank
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def rank_of(self, stage_index: int, tp_rank: int) -> int:
        return stage_index * self.tp.size + tp_rank

    @property
    def prev_rank(self) -> int:
        return self.rank_of(self.stage_index - 1, self.tp.rank)

    @property
    def next_rank(self) -> int:
        return self.rank_of(self.stage_index + 1, self.tp.rank)

    @property
    def logits_rank(self) -> int:
        """The rank that sends the gathered logits to rank 0: TP rank 0 of the last stage."""
        return self.rank_of(self.pp_size - 1, 0)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over all ranks (e.g. KV blocks: every rank must hold the pool
        that rank 0's block manager hands out)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def shard_kwargs(self) -> dict[str, Any]:
        """What ``load_model`` needs to build only this rank's shard."""
        return {"tp": self.tp, "stage": self.stage}


LEAVE_TIMEOUT = timedelta(seconds=60)  # the exit barrier: peers that are alive get there within a step


_contexts: list[ParallelContext] = []  # every context this process built: their groups go at exit


def leave_process_group() -> None:
    """Every rank's last act on the process group (once, at exit, after the driver's stop):
    wait at a barrier until every rank has finished its last step, destroy every group, and drop
    every reference to them, so that their C++ objects go now, while the interpreter is alive.

    Why the last part: ``destroy_process_group`` only forgets the groups; a group Python still
    references (this context, and every tensor-parallel layer through ``TensorParallel.group``)
    keeps its gloo worker threads running into interpreter finalization. Such a thread releases a
    finished collective's work a moment after the waiting thread returned from it; if that is the
    last reference to a tensor Python also knew, it takes the GIL to drop the Python object, and a
    thread taking the GIL during finalization is ended by ``pthread_exit``, whose unwinding through
    a ``noexcept`` destructor aborts the process ("terminate called without an active exception",
    exit -6, seen under load after the rank's work was done). Destroying the group joins those
    threads (its destructor releases the GIL while it waits)."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier(async_op=True).wait(LEAVE_TIMEOUT)
    except RuntimeError:  # a peer is gone already: there is nobody left to wait for
        pass
    dist.destroy_process_group()
    for ctx in _contexts:
        ctx.control_group = None
        object.__setattr__(ctx.tp, "group", None)  # frozen, and shared by the model's parallel layers
    _contexts.clear()
    gc.collect()  # groups held in reference cycles go now too


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_parallel(config: EngineConfig, num_layers: int) -> ParallelContext:
    """Join the process group torchrun describes in the environment and build every subgroup
    (every rank creates every group, in the same order, as torch.distributed requires)."""
    if not under_torchrun():
        raise ConfigError(
            f"{config.world_size} ranks need torchrun: run the llmctl command (it starts them), or "
            "this program under torchrun (docs/parallelism.md)"
        )
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != config.world_size:
        raise ConfigError(
            f"torchrun started {world_size} ranks but --tensor-parallel-size "
            f"{config.tensor_parallel_size} x --pipeline-parallel-size "
            f"{config.pipeline_parallel_size} = {config.world_size}"
        )
    device = config.resolve_device()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=CONTROL_TIMEOUT if backend == "gloo" else None,
            device_id=device if device.type == "cuda" else None,
        )
        atexit.register(leave_process_group)  # runs after the driver's stop message (LIFO)
        watch_parent(int(os.environ.get("RANK", "0")))
    rank, tp_size, pp_size = dist.get_rank(), config.tensor_parallel_size, config.pipeline_parallel_size
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if device.type == "cuda" else dist.group.WORLD
    tp_group = None
    for stage_index in range(pp_size):
        ranks = list(range(stage_index * tp_size, (stage_index + 1) * tp_size))
        group = dist.new_group(ranks) if pp_size > 1 else dist.group.WORLD
        if rank in ranks:
            tp_group = group
    stage_index = rank // tp_size
    stages = split_layers(num_layers, pp_size, envs.LLMCTL_PP_LAYER_PARTITION)
    ctx = ParallelContext(
        rank=rank,
        world_size=world_size,
        tp=TensorParallel(rank=rank % tp_size, size=tp_size, group=tp_group),
        pp_size=pp_size,
        stage_index=stage_index,
        stage=stages[stage_index],
        control_group=control,
        device=device,
    )
    _contexts.append(ctx)
    return ctx
