"""Pipeline parallelism across steps: up to one batch per stage in the pipeline at once.

Without this a step ends when its logits are back, so with S stages each stage idles (S - 1) / S
of the time in steady decode (a decode step is one micro-batch: splitting it costs weight reads,
see ``ParallelRunner``). Here rank 0 keeps up to ``depth`` (= S) batches in flight, as vLLM's
"virtual engines" do, but with one scheduler and one KV pool::

    rank 0 (stage 0):  run A | schedule B, run B | book A, schedule A', run A' | book B, ...
    rank 1 (stage 1):        | run A             | run B                      | run A', ...

* The scheduler skips the sequences of batches in flight (their next token is not known yet) and
  never preempts them (their blocks are being written); each batch takes at most its share
  (1 / depth) of the live sequences, so in steady decode the batches alternate between groups.
* Every rank runs the batches in launch order at every layer, so a later batch always sees the
  K/V an earlier one wrote: a block freed by an abort while its batch is in flight, or a prefix
  block cached by an earlier batch, is safe to hand to the next batch.
* A sequence aborted while its batch is in flight is not booked when the batch comes back (its
  blocks went back at the abort).
"""

from __future__ import annotations

import dataclasses

from llmctl import envs
from llmctl.engine.model_runner import ModelOutput
from llmctl.engine.scheduler import Scheduler, SchedulerOutput
from llmctl.parallel.driver import ParallelRunner


def batches_in_flight(pp_size: int) -> int:
    """How many batches the pipeline holds at once: one per stage (the scheduler is built with it
    as ``SchedulerConfig.batches_in_flight``)."""
    # 1: a step ends when its logits are back (no overlap across steps; for comparisons)
    return envs.LLMCTL_PP_BATCHES_IN_FLIGHT or pp_size


class PipelinedSteps:
    """The engine's step with batches in flight: ``advance`` launches and collects, as many at
    once as the scheduler was configured to share its sequences between."""

    def __init__(self, scheduler: Scheduler, runner: ParallelRunner) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.depth = scheduler.config.batches_in_flight
        self.overlapped_launches = 0  # batches launched while another was in flight (the overlap)

    @property
    def busy(self) -> bool:
        """Batches are still in the pipeline (their results must be collected and booked)."""
        return bool(self.runner.in_flight)

    def advance(self) -> tuple[SchedulerOutput, ModelOutput, float] | None:
        """Launch the next batch when the pipeline has room and something not in flight can run;
        then, once the pipeline is full or nothing more can start, collect the oldest batch.
        Returns it for booking (with its launch time), or None when nothing is ready to book."""
        if len(self.runner.in_flight) < self.depth:
            sched = self.scheduler.schedule()
            if not sched.is_empty:
                self.scheduler.mark_in_flight(sched)
                self.overlapped_launches += bool(self.runner.in_flight)
                self.runner.launch(sched)
                if len(self.runner.in_flight) < self.depth:
                    return None
        if not self.runner.in_flight:
            return None
        step = self.runner.in_flight[0]
        output = self.runner.collect(step)
        self.scheduler.mark_landed(step.sched)
        return (*drop_finished(step.sched, output), step.launched_at)


def drop_finished(sched: SchedulerOutput, output: ModelOutput) -> tuple[SchedulerOutput, ModelOutput]:
    """The batch without the sequences that finished (were aborted) while it was in flight, nor
    the ``n > 1`` siblings forked off such a prompt."""
    gone = {id(seq) for seq in sched.sampling if seq.is_finished}
    for parent, children in sched.forks:
        if parent.is_finished:
            gone.update(id(child) for child in children)
    if not gone and not any(item.seq.is_finished for item in sched.scheduled):
        return sched, output
    keep = [i for i, seq in enumerate(sched.sampling) if id(seq) not in gone]
    kept = dataclasses.replace(
        sched,
        prefills=[item for item in sched.prefills if not item.seq.is_finished],
        decodes=[item for item in sched.decodes if not item.seq.is_finished],
        sampling=[sched.sampling[i] for i in keep],
        logits_rows=list(range(len(keep))),
        forks=[(parent, children) for parent, children in sched.forks if not parent.is_finished],
    )
    prompt_logits = [chunk for chunk in output.prompt_logits if not chunk.seq.is_finished]
    return kept, ModelOutput(output.logits[keep], prompt_logits, output.verify_logits)
