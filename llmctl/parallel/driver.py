"""Rank 0's model runner: the scheduler's batch becomes micro-batches of tensors, broadcast to every
rank; rank 0 runs its own stage, then collects the logits for sampling.

It stands in for ``ModelRunner`` inside ``LLMEngine`` (same ``execute``), so the scheduler, the
block manager, the sampler and the server are unchanged and live on rank 0 only. With pipeline
parallelism the engine uses ``launch`` and ``collect`` instead, keeping batches in flight
(``llmctl.parallel.pipeline``).
"""

from __future__ import annotations

import atexit
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmctl import envs
from llmctl.config import EngineConfig
from llmctl.engine.model_runner import ModelOutput, ModelRunner, PromptLogits
from llmctl.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmctl.engine.sequence import Sequence
from llmctl.models.config import ModelConfig
from llmctl.parallel.stage import StageRun, receive_logits, run_stage
from llmctl.parallel.topology import ParallelContext, init_parallel
from llmctl.parallel.watchdog import fatal
from llmctl.parallel.wire import MicroBatch, StepMessage, encode_step

CMD_STOP, CMD_STEP = 0, 1


def start_parallel(config: EngineConfig) -> ParallelContext:
    """Join the ranks torchrun started (every rank calls this before loading its shard)."""
    return init_parallel(config, ModelConfig.from_dir(Path(config.model)).num_layers)


def split_micro_batches(sched: SchedulerOutput, count: int, min_tokens: int = 1) -> list[SchedulerOutput]:
    """At most ``count`` contiguous slices of the batch, of at least about ``min_tokens`` tokens and
    about equal tokens each (prefills stay before decodes, so the concatenated logits keep the
    batch's row order)."""
    items = sched.scheduled
    total = sum(item.num_new_tokens for item in items)
    count = max(1, min(count, len(items), total // max(1, min_tokens)))
    slices: list[list[ScheduledSeq]] = [[]]
    done = 0
    for i, item in enumerate(items):
        remaining_items, remaining_slices = len(items) - i, count - len(slices)
        if slices[-1] and (done >= total * len(slices) / count or remaining_items <= remaining_slices):
            slices.append([])
        slices[-1].append(item)
        done += item.num_new_tokens
    prefills = {id(item) for item in sched.prefills}
    return [
        SchedulerOutput(
            prefills=[s for s in part if id(s) in prefills], decodes=[s for s in part if id(s) not in prefills]
        )
        for part in slices
    ]


@dataclass
class InFlightStep:
    """A batch rank 0 has sent into the pipeline whose logits it has not collected yet."""

    sched: SchedulerOutput
    micro_batches: tuple[MicroBatch, ...]
    prompt_specs: tuple[list[tuple[Sequence, int, int]], ...]
    stage: StageRun  # rank 0's own stage: its sends (and, with one stage, the logits)
    broadcasts: list[dist.Work]
    message: list[torch.Tensor]  # the broadcast tensors, alive until their sends completed
    launched_at: float = field(default_factory=time.time)


class ParallelRunner:
    """``ModelRunner.execute`` over all ranks, also as ``launch`` + ``collect`` so that with pipeline
    parallelism several batches can be in the pipeline at once (``llmctl.parallel.pipeline``).
    Anything else is read from rank 0's own runner."""

    def __init__(self, ctx: ParallelContext, runner: ModelRunner) -> None:
        self.ctx, self.local = ctx, runner
        self.model = runner.model
        self.in_flight: deque[InFlightStep] = deque()  # launched, oldest first
        self._stopped = False
        # Micro-batches per step: as many as stages keeps every stage busy once the pipeline fills.
        # Only steps with enough tokens are split: a decode step is bound by reading the weights,
        # which each micro-batch does again, so splitting it costs more than the overlap gains.
        self.micro_batches = envs.LLMCTL_PP_MICRO_BATCHES or ctx.pp_size
        self.micro_batch_min_tokens = envs.LLMCTL_PP_MICRO_BATCH_MIN_TOKENS
        atexit.register(self.shutdown)

    def __getattr__(self, name: str) -> Any:  # kv_cache, block_size, ... of rank 0's shard
        return getattr(self.local, name)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        return self.collect(self.launch(sched))

    def launch(self, sched: SchedulerOutput) -> InFlightStep:
        """Send the batch to every rank and run rank 0's stage of it; the later stages run it while
        this returns (their results come back through ``collect``, oldest first)."""
        parts = split_micro_batches(sched, self.micro_batches, self.micro_batch_min_tokens)
        micro_batches, prompt_specs = zip(*(self._micro_batch(part) for part in parts))
        message = StepMessage(sched.num_blocks_touched, sched.blocks_to_copy, list(micro_batches))
        payload = encode_step(message)
        header = torch.tensor([CMD_STEP, payload.numel()], dtype=torch.int64)
        try:  # not waited for here: a worker still busy with the previous batch takes it when done
            broadcasts = [
                dist.broadcast(t, src=0, group=self.ctx.control_group, async_op=True) for t in (header, payload)
            ]
            stage = run_stage(self.ctx, self.model, self.local, message)
        except RuntimeError as exc:  # a peer died or the ranks fell out of step: nothing can continue
            fatal(f"rank 0: a step failed across the ranks ({exc}); stopping every rank")
        step = InFlightStep(sched, micro_batches, prompt_specs, stage, broadcasts, [header, payload])
        self.in_flight.append(step)
        return step

    def collect(self, step: InFlightStep) -> ModelOutput:
        """The logits of the oldest launched batch (``step``), once the last stage has them."""
        if not self.in_flight or self.in_flight[0] is not step:
            raise RuntimeError("pipeline steps are collected in the order they were launched")
        self.in_flight.popleft()
        try:
            logits = step.stage.logits
            if self.ctx.pp_size > 1:
                logits = receive_logits(self.ctx, step.micro_batches, self.model.config.vocab_size)
            for work in step.broadcasts:
                work.wait()
            step.stage.wait()
        except RuntimeError as exc:
            fatal(f"rank 0: a step failed across the ranks ({exc}); stopping every rank")
        return self._assemble(step.sched, step.micro_batches, logits, step.prompt_specs)

    @staticmethod
    def _assemble(
        sched: SchedulerOutput,
        micro_batches: tuple[MicroBatch, ...],
        logits: list[torch.Tensor],
        prompt_specs: tuple[list[tuple[Sequence, int, int]], ...],
    ) -> ModelOutput:
        """Each micro-batch's rows are its sampling rows, then its prompt-logprob rows."""
        sampling, prompt_logits = [], []
        for mb, mb_logits, specs in zip(micro_batches, logits, prompt_specs, strict=True):
            offset = mb.logit_rows.numel() - sum(count for _, _, count in specs)
            sampling.append(mb_logits[:offset])
            for seq, first_index, count in specs:
                prompt_logits.append(PromptLogits(seq, first_index, mb_logits[offset : offset + count]))
                offset += count
        out = torch.cat(sampling)
        if len(sched.logits_rows) > out.shape[0]:  # n > 1 siblings share their prompt's row
            out = out[torch.tensor(sched.logits_rows, device=out.device)]
        return ModelOutput(out, prompt_logits)

    def _micro_batch(self, part: SchedulerOutput) -> tuple[MicroBatch, list[tuple[Sequence, int, int]]]:
        """The batch tensors of one slice, and the prompt-logprob rows (``ModelRunner._prompt_logits``'
        rule) appended after the sampling rows."""
        input_ids, positions, meta, logits_indices = self.local.prepare(part)
        rows, specs, offset = [], [], 0
        for item in part.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if seq.needs_prompt_logits and end > start:
                rows.extend(range(offset, offset + end - start))
                specs.append((seq, start + 1, end - start))
            offset += item.num_new_tokens
        extra = torch.tensor(rows, dtype=logits_indices.dtype, device=logits_indices.device)
        return MicroBatch(input_ids, positions, meta, torch.cat([logits_indices, extra])), specs

    def shutdown(self) -> None:
        """Collect the batches still in the pipeline (their results are dropped), then tell the
        workers this engine is done (at the latest at interpreter exit). The process group stays
        up for another engine on the same ranks (tests run several models per job); it is torn
        down once, at exit (``topology.teardown``)."""
        if self._stopped:
            return
        self._stopped = True
        while self.in_flight:
            self.collect(self.in_flight[0])
        try:
            dist.broadcast(torch.tensor([CMD_STOP, 0], dtype=torch.int64), src=0, group=self.ctx.control_group)
        except RuntimeError:  # they are gone already (Ctrl-C reaches every rank): nothing left to stop
            fatal("rank 0: the other ranks had stopped before this engine finished")
