"""What every rank runs for one step: its pipeline stage of each micro-batch.

Micro-batches go through the stages in order, so while stage ``s`` runs micro-batch ``k + 1``,
stage ``s + 1`` runs micro-batch ``k`` (hidden states and the residual are handed on with
non-blocking sends). The last stage computes the logits rows rank 0 asked for; with more than one
stage its tensor-parallel rank 0 sends them to rank 0, which samples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmctl.engine.model_runner import ModelRunner
from llmctl.models.llama import LlamaForCausalLM
from llmctl.parallel.topology import ParallelContext
from llmctl.parallel.wire import MicroBatch, StepMessage


@torch.inference_mode()
def run_stage(ctx: ParallelContext, model: LlamaForCausalLM, runner: ModelRunner,
              message: StepMessage) -> list[torch.Tensor]:
    """This rank's part of the step; the float32 logits of each micro-batch where this rank holds
    them (the last stage; rank 0 when there is one stage), else an empty list."""
    runner.ready_blocks(message.num_blocks_touched, message.blocks_to_copy)
    hidden_size = model.config.hidden_size
    dtype = model.model.norm.weight.dtype
    pending: list[dist.Work] = []
    logits: list[torch.Tensor] = []
    keep_alive: list[torch.Tensor] = []  # tensors in flight must outlive their sends
    for mb in message.micro_batches:
        intermediate = None
        if not ctx.stage.is_first:
            received = torch.empty(2, mb.num_tokens, hidden_size, dtype=dtype, device=ctx.device)
            dist.recv(received, src=ctx.prev_rank)
            intermediate = (received[0], received[1])
        out = model(mb.input_ids, mb.positions, mb.meta, intermediate)
        if not ctx.stage.is_last:
            packed = torch.stack(out).contiguous()
            keep_alive.append(packed)
            pending.append(dist.isend(packed, dst=ctx.next_rank))
            continue
        mb_logits = model.compute_logits(out[mb.logit_rows]).float()
        if ctx.is_driver:
            logits.append(mb_logits)
        elif ctx.rank == ctx.logits_rank:
            keep_alive.append(mb_logits)
            pending.append(dist.isend(mb_logits, dst=0))
    for work in pending:
        work.wait()
    return logits


def receive_logits(ctx: ParallelContext, micro_batches: list[MicroBatch], vocab_size: int) -> list[torch.Tensor]:
    """Rank 0's side of the last stage's sends, in micro-batch order."""
    out = []
    for mb in micro_batches:
        logits = torch.empty(mb.logit_rows.numel(), vocab_size, dtype=torch.float32, device=ctx.device)
        dist.recv(logits, src=ctx.logits_rank)
        out.append(logits)
    return out
