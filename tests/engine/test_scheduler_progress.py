"""The scheduler always makes progress: every request finishes, whatever the mix of users, ``n`` and
prompt lengths, in a pool and a seat count far too small. The scheduler and block manager alone,
driven with made-up sampled tokens (no model), so a property test can afford many examples and long
runs; tests/engine/test_block_invariants.py checks the same traffic end to end through the engine."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.scheduler import Scheduler, SchedulerConfig
from llmctl.engine.sequence import FinishReason, Sequence
from llmctl.sampling_params import SamplingParams

VOCAB = 320
PREFIXES = [[7] * 20, list(range(10, 30)), list(range(40, 53))]
MAX_NUM_SEQS = 6
MAX_STEPS = 2_000  # the longest traffic below needs a few hundred steps


def make_scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=20, block_size=8, max_model_len=96, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=40
        )
    )


def add(
    scheduler: Scheduler, request_id: str, prompt: list[int], n: int, max_tokens: int, user: str, arrival: float
) -> Sequence:
    """What ``LLMEngine.add_request`` queues: one sequence that forks its other ``n - 1`` samples."""
    seq = Sequence(
        request_id,
        list(prompt),
        len(prompt),
        SamplingParams(n=n, max_tokens=max_tokens),
        user=user,
        arrival_time=arrival,
        pending_forks=n - 1,
    )
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, token: int = 5) -> list[Sequence]:
    """One engine step with a fixed sampled token; returns the forked children."""
    out = scheduler.schedule()
    assert not out.is_empty or not scheduler.has_unfinished(), "work waits but nothing was scheduled"
    scheduler.update_from_output(out, [token] * len(out.sampling))
    assert scheduler._seats_in_use() <= MAX_NUM_SEQS
    return [child for _, children in out.forks for child in children]


def test_fair_seat_preemption_cannot_livelock_prompts_that_fork():
    """Three users each want a prompt with n = 3 (3 seats: it forks 2 samples once its prompt is
    computed) while 6 seats hold two. Taking a whole 3-seat prompt from a user for fairness left
    that user below its share, so it took one back in turn, round the users, within every step:
    each step's work was undone and nothing ever finished (the "a request never finished" failure
    of tests/engine/test_block_invariants.py)."""
    scheduler = make_scheduler()
    for i, (user, prompt_len, n, max_tokens) in enumerate(
        [("c", 12, 3, 29), ("b", 3, 3, 16), ("c", 1, 2, 19), ("a", 12, 3, 28)]
    ):
        add(scheduler, f"r{i}", [3 + (i * 37 + j) % 300 for j in range(prompt_len)], n, max_tokens, user, i)
    steps = 0
    while scheduler.has_unfinished():
        assert steps < 200, f"no progress: {scheduler.num_preemptions} preemptions in {steps} steps"
        step(scheduler)
        steps += 1
    scheduler.block_manager.check_invariants([])
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


class TrafficMachine(RuleBasedStateMachine):
    """Random adds (shared prefixes, n up to 3, three users), aborts and steps; at the end every
    request must finish within ``MAX_STEPS`` and give back every block."""

    @initialize()
    def make_scheduler(self):
        self.scheduler = make_scheduler()
        self.requests: dict[str, list[Sequence]] = {}
        self.count = 0

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES) + 1)),
        suffix=st.lists(st.integers(3, VOCAB - 1), max_size=25),
        max_tokens=st.integers(1, 30),
        n=st.sampled_from([1, 1, 2, 3]),
        user=st.sampled_from("abc"),
    )
    def add(self, prefix, suffix, max_tokens, n, user):
        prompt = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix or [5]
        self.count += 1
        request_id = f"r{self.count}"
        self.requests[request_id] = [add(self.scheduler, request_id, prompt, n, max_tokens, user, self.count)]

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        for seq in self.requests.pop(request_id):
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)

    @rule(steps=st.integers(1, 6), token=st.integers(3, VOCAB - 1))
    def step(self, steps, token):
        for _ in range(steps):
            self._step(token)

    def _step(self, token: int) -> None:
        for child in step(self.scheduler, token):
            self.requests[child.request_id].append(child)
        for request_id, seqs in list(self.requests.items()):
            if all(seq.is_finished and not seq.pending_forks for seq in seqs):
                del self.requests[request_id]

    @invariant()
    def blocks_accounted_for(self):
        live = [seq for seqs in getattr(self, "requests", {}).values() for seq in seqs if not seq.is_finished]
        if live:
            self.scheduler.block_manager.check_invariants(live)

    def teardown(self):
        scheduler = getattr(self, "scheduler", None)
        if scheduler is None:
            return
        for _ in range(MAX_STEPS):
            if not scheduler.has_unfinished():
                break
            self._step(5)
        assert not scheduler.has_unfinished(), f"no progress: {scheduler.num_preemptions} preemptions"
        assert not self.requests
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


TrafficMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_every_request_finishes_under_random_traffic = TrafficMachine.TestCase


def test_collaborators_come_through_the_constructor():
    """The block manager's release hook, the draft proposer and a truncation reach the scheduler as
    arguments and calls, never as attributes set on it afterwards."""
    released: list[int] = []
    manager = BlockManager(20, 8, on_release=released.append)
    proposed: list[int] = []

    def propose_drafts(seq: Sequence, most: int) -> int:
        proposed.append(most)
        return 0

    config = SchedulerConfig(
        num_blocks=20,
        block_size=8,
        max_model_len=96,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=40,
        num_speculative_tokens=3,
    )
    scheduler = Scheduler(config, manager, propose_drafts=propose_drafts)
    seq = add(scheduler, "r", list(range(10, 22)), n=1, max_tokens=8, user="a", arrival=0.0)
    step(scheduler)  # the prompt: 12 tokens in 2 blocks, one sampled
    step(scheduler)  # a decode: the proposer is asked for at most 3 drafts
    assert scheduler.block_manager is manager and proposed == [3]
    scheduler.truncate(seq, 13)  # as a stop string found before the last token would
    assert seq.token_ids == [*range(10, 22), 5]
    with pytest.raises(ValueError, match="prompt"):
        scheduler.truncate(seq, 11)
    scheduler.finish(seq, FinishReason.STOP)
    assert sorted(released) == sorted(set(released)) and len(released) == 2  # each block once
    with pytest.raises(ValueError, match="differs"):
        Scheduler(dataclasses.replace(config, num_blocks=21), manager)
