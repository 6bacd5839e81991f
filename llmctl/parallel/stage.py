"""What every rank runs for one step: its pipeline stage of each micro-batch.

Micro-batches go through the stages in order, so while stage ``s`` runs micro-batch ``k + 1``,
stage ``s + 1`` runs micro-batch ``k`` (hidden states and the residual are handed on with
non-blocking sends). The last stage computes the logits rows rank 0 asked for; with more than one
stage its tensor-parallel rank 0 sends them to rank 0, which samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llmctl.engine.model_runner import ModelRunner
from llmctl.models.registry import CausalLM
from llmctl.parallel.topology import ParallelContext
from llmctl.parallel.wire import MicroBatch, StepMessage


@dataclass
class StageRun:
    """This rank's part of one step once its compute is done: the float32 logits of each
    micro-batch where this rank holds them (the last stage; rank 0 when there is one stage), and
    the sends still in flight. A gloo send completes only when the peer posts its receive, so
    rank 0 waits for its sends when it collects the step, not when it launches it: by then the
    next stage has taken them, and meanwhile rank 0 has scheduled and run the next batch."""

    logits: list[torch.Tensor] = field(default_factory=list)
    pending: list[dist.Work] = field(default_factory=list)
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # tensors in flight outlive their sends

    def wait(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
        self.keep_alive.clear()


@torch.inference_mode()
def run_stage(ctx: ParallelContext, model: CausalLM, runner: ModelRunner, message: StepMessage) -> StageRun:
    """Run this rank's stage of every micro-batch of the step; the sends are left in flight."""
    runner.ready_blocks(message.num_blocks_touched, message.blocks_to_copy)
    hidden_size = model.config.hidden_size
    dtype = model.model.norm.weight.dtype
    run = StageRun()
    pending, logits, keep_alive = run.pending, run.logits, run.keep_alive
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
    return run


def receive_logits(ctx: ParallelContext, micro_batches: list[MicroBatch], vocab_size: int) -> list[torch.Tensor]:
    """Rank 0's side of the last stage's sends, in micro-batch order."""
    out = []
    for mb in micro_batches:
        logits = torch.empty(mb.logit_rows.numel(), vocab_size, dtype=torch.float32, device=ctx.device)
        dist.recv(logits, src=ctx.logits_rank)
        out.append(logits)
    return out
