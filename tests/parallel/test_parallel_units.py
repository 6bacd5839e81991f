"""The pieces of parallelism that need no second process: the per-step message round trip, the
micro-batch split, the layer split, and the scheduler's side of batches in flight."""

from __future__ import annotations

import dataclasses
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from llmctl.distributed import split_layers
from llmctl.engine.model_runner import ModelOutput
from llmctl.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from llmctl.engine.sequence import FinishReason, Sequence, SequenceStatus
from llmctl.layers.ops import AttentionMetadata
from llmctl.parallel.driver import split_micro_batches
from llmctl.parallel.pipeline import PipelinedSteps, batches_in_flight, drop_finished
from llmctl.parallel.wire import MicroBatch, StepMessage, decode_step, encode_step
from llmctl.sampling_params import SamplingParams


def metadata(num_decodes: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(5 + num_decodes),
        num_prefills=1,
        num_prefill_tokens=5,
        num_decodes=num_decodes,
        prefill_query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([5], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[3, 4]], dtype=torch.int32),
        prefill_is_fresh=True,
        decode_seq_lens=torch.arange(num_decodes, dtype=torch.int32) + 9,
        decode_block_tables=torch.arange(2 * num_decodes, dtype=torch.int32).view(num_decodes, 2),
        max_decode_seq_len=9 + num_decodes,
    )


def assert_same_metadata(want: AttentionMetadata, have: AttentionMetadata) -> None:
    for f in dataclasses.fields(AttentionMetadata):
        a, b = getattr(want, f.name), getattr(have, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        elif isinstance(a, list):  # the KV-cache groups' metadata
            assert isinstance(b, list) and len(a) == len(b), f.name
            for group_want, group_have in zip(a, b, strict=True):
                assert_same_metadata(group_want, group_have)
        else:
            assert type(a) is type(b) and a == b, f.name


def test_step_message_round_trip():
    grouped = metadata(1)  # a model with two KV-cache groups: the second group's own tables and slots
    grouped.groups = [dataclasses.replace(grouped), dataclasses.replace(metadata(1), slot_mapping=torch.arange(6) + 40)]
    batches = [
        MicroBatch(torch.arange(5 + n), torch.arange(5 + n) * 2, meta, torch.tensor([4, 5, 6][: n + 1]))
        for n, meta in ((2, metadata(2)), (0, metadata(0)), (1, grouped))
    ]
    sent = StepMessage(num_blocks_touched=17, blocks_to_copy=[(1, 2), (7, 9)], micro_batches=batches)
    got = decode_step(encode_step(sent), torch.device("cpu"))
    assert (got.num_blocks_touched, got.blocks_to_copy) == (17, [(1, 2), (7, 9)])
    for want, have in zip(sent.micro_batches, got.micro_batches, strict=True):
        for name in ("input_ids", "positions", "logit_rows"):
            assert torch.equal(getattr(want, name), getattr(have, name))
        assert_same_metadata(want.meta, have.meta)
    assert torch.equal(got.micro_batches[2].meta.groups[1].slot_mapping, torch.arange(6) + 40)


def test_micro_batches_keep_the_batch_order_and_balance_tokens():
    prefills = [ScheduledSeq(object(), n) for n in (12, 3)]  # type: ignore[arg-type]
    decodes = [ScheduledSeq(object(), 1) for _ in range(5)]  # type: ignore[arg-type]
    sched = SchedulerOutput(prefills=prefills, decodes=decodes)
    parts = split_micro_batches(sched, 2)
    assert [s for p in parts for s in p.scheduled] == sched.scheduled
    assert [p.num_prefill_tokens + p.num_decode_tokens for p in parts] == [12, 8]
    assert len(split_micro_batches(SchedulerOutput(decodes=decodes[:1]), 2)) == 1  # one sequence: no split
    assert [len(p.scheduled) for p in split_micro_batches(SchedulerOutput(decodes=decodes), 3)] == [2, 2, 1]
    assert len(split_micro_batches(SchedulerOutput(decodes=decodes), 2, min_tokens=4)) == 1  # too few tokens


def test_layer_split_is_even_or_explicit():
    assert [(s.start, s.end) for s in split_layers(5, 2)] == [(0, 2), (2, 5)]
    assert [(s.start, s.end) for s in split_layers(5, 2, "4,1")] == [(0, 4), (4, 5)]
    assert split_layers(4, 1)[0].is_first and split_layers(4, 1)[0].is_last
    with pytest.raises(ValueError, match="must give 2 positive counts"):
        split_layers(5, 2, "5,0")
    with pytest.raises(ValueError, match="cannot be split"):
        split_layers(2, 3)


def decoding_scheduler(num_seqs: int, num_blocks: int, batches_in_flight: int = 1) -> tuple[Scheduler, list[Sequence]]:
    """``num_seqs`` sequences of one full 4-token block each, past their prompt (one pending token)."""
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=4,
            max_model_len=64,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            batches_in_flight=batches_in_flight,
        )
    )
    seqs = [Sequence(f"r{i}", [1, 2, 3, 4], 4, SamplingParams(max_tokens=8)) for i in range(num_seqs)]
    for seq in seqs:
        scheduler.add(seq)
    launched = []  # the prompts, in as many batches as the pipeline holds (each takes its share)
    while not (sched := scheduler.schedule()).is_empty:
        scheduler.mark_in_flight(sched)
        launched.append(sched)
    for sched in launched:
        scheduler.mark_landed(sched)
        scheduler.update_from_output(sched, [5] * len(sched.sampling))
    assert all(seq.token_ids == [1, 2, 3, 4, 5] for seq in seqs)
    return scheduler, seqs


def test_pipelined_batches_take_turns_and_skip_sequences_in_flight():
    scheduler, seqs = decoding_scheduler(5, num_blocks=64, batches_in_flight=2)
    first = scheduler.schedule()
    assert [item.seq for item in first.decodes] == seqs[:3]  # its share: ceil(5 / 2)
    scheduler.mark_in_flight(first)
    second = scheduler.schedule()
    assert [item.seq for item in second.decodes] == seqs[3:]
    scheduler.mark_in_flight(second)
    assert scheduler.schedule().is_empty  # everything is in the pipeline
    scheduler.mark_landed(first)
    assert [item.seq for item in scheduler.schedule().decodes] == seqs[:3]  # back from the pipeline


def test_a_sequence_in_flight_is_never_preempted():
    # the pool is full: each next token needs a block
    scheduler, seqs = decoding_scheduler(4, num_blocks=4, batches_in_flight=2)
    first = scheduler.schedule()  # seqs 0 and 1 take the blocks of 3 and 2, preempted
    assert [item.seq for item in first.decodes] == seqs[:2] and first.preempted == [seqs[3], seqs[2]]
    scheduler.mark_in_flight(first)
    second = scheduler.schedule()  # 2 and 3 cannot come back: the only holders are in flight
    assert second.is_empty and not second.preempted
    assert all(seq.status is SequenceStatus.RUNNING and len(seq.block_table) == 2 for seq in seqs[:2])


def test_a_sequence_aborted_in_flight_is_not_booked():
    scheduler, seqs = decoding_scheduler(3, num_blocks=64)
    sched = scheduler.schedule()
    output = ModelOutput(torch.arange(3.0)[:, None].repeat(1, 4))
    scheduler.finish(seqs[1], FinishReason.ABORT)  # while its batch was in the pipeline
    kept, kept_output = drop_finished(sched, output)
    assert kept.sampling == [seqs[0], seqs[2]] and [item.seq for item in kept.decodes] == [seqs[0], seqs[2]]
    assert kept_output.logits[:, 0].tolist() == [0.0, 2.0]
    scheduler.update_from_output(kept, [7, 7])
    assert seqs[1].token_ids == [1, 2, 3, 4, 5] and seqs[0].token_ids == [1, 2, 3, 4, 5, 7]


class LaunchRecorder:
    """Stands in for ``ParallelRunner``: batches are "in the pipeline" until collected."""

    def __init__(self) -> None:
        self.in_flight: deque[SimpleNamespace] = deque()

    def launch(self, sched: SchedulerOutput) -> SimpleNamespace:
        self.in_flight.append(SimpleNamespace(sched=sched, launched_at=0.0))
        return self.in_flight[-1]

    def collect(self, step: SimpleNamespace) -> ModelOutput:
        assert self.in_flight.popleft() is step
        return ModelOutput(torch.zeros(len(step.sched.sampling), 4))


def test_the_engine_books_one_batch_while_the_next_is_in_the_pipeline():
    scheduler, seqs = decoding_scheduler(4, num_blocks=64, batches_in_flight=2)
    runner = LaunchRecorder()
    pipeline = PipelinedSteps(scheduler, runner)  # type: ignore[arg-type]
    assert pipeline.advance() is None  # A launched: nothing to book yet
    booked, _, _ = pipeline.advance()  # B launched while A was in flight, then A collected
    assert [item.seq for item in booked.decodes] == seqs[:2] and pipeline.overlapped_launches == 1
    assert [item.seq for item in runner.in_flight[0].sched.decodes] == seqs[2:]
    scheduler.update_from_output(booked, [7, 7])
    booked, _, _ = pipeline.advance()  # A' launched, B collected
    assert [item.seq for item in booked.decodes] == seqs[2:]
    assert scheduler.in_flight == {seq.seq_id for seq in seqs[:2]}


def test_the_pipeline_holds_one_batch_per_stage_unless_told(monkeypatch):
    monkeypatch.delenv("LLMCTL_PP_BATCHES_IN_FLIGHT", raising=False)
    assert batches_in_flight(3) == 3
    monkeypatch.setenv("LLMCTL_PP_BATCHES_IN_FLIGHT", "1")  # no overlap across steps, for comparisons
    assert batches_in_flight(3) == 1
    scheduler, _ = decoding_scheduler(2, num_blocks=64, batches_in_flight=batches_in_flight(3))
    assert PipelinedSteps(scheduler, LaunchRecorder()).depth == 1  # type: ignore[arg-type]
