"""Every rank but 0: load this rank's shard and KV pool, then run each step rank 0 broadcasts,
until rank 0's engine says it is done."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmctl.config import EngineConfig, resolve_kv_cache_bytes
from llmctl.engine.model_runner import ModelRunner, kv_format, kv_groups, paged_format
from llmctl.layers.backends import build_ops
from llmctl.models.loader import load_model
from llmctl.parallel.driver import CMD_STOP, start_parallel
from llmctl.parallel.stage import run_stage
from llmctl.parallel.watchdog import fatal
from llmctl.parallel.wire import decode_step
from llmctl.platform import select_kernels


def run_worker(config: EngineConfig) -> None:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    ctx = start_parallel(config)
    ops = build_ops(
        select_kernels(config.kernel_backend, ctx.device, quant_exact_activations=config.quant_exact_activations)
    )
    model = load_model(config.model, dtype=config.dtype, device=ctx.device, ops=ops, **ctx.shard_kwargs())
    dtype = model.model.norm.weight.dtype
    # The KV-cache groups of rank 0's engine (tensor parallel: every rank holds every layer; a
    # model with several groups is refused with pipeline stages), a block holding one group's layers
    groups = kv_groups(model)
    block = paged_format(kv_format(model, config.block_size, dtype), groups)
    # The same sizing as rank 0's engine, then the smallest pool over the ranks: rank 0's block
    # manager hands out block ids that every rank must hold.
    num_blocks = ctx.agree_min(resolve_kv_cache_bytes(config, ctx.device) // block.block_bytes())
    runner = ModelRunner(
        model, num_blocks=num_blocks, block_size=config.block_size, device=ctx.device, kv_dtype=dtype, groups=groups
    )
    header = torch.empty(2, dtype=torch.int64)
    try:
        while True:
            dist.broadcast(header, src=0, group=ctx.control_group)
            command, length = header.tolist()
            if command == CMD_STOP:
                break
            payload = torch.empty(length, dtype=torch.int64)
            dist.broadcast(payload, src=0, group=ctx.control_group)
            run_stage(ctx, model, runner, decode_step(payload, ctx.device)).wait()
    except RuntimeError as exc:
        fatal(f"rank {ctx.rank}: lost rank 0 or a peer during a step ({exc}); exiting")
