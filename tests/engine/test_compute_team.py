"""The compute team's size: what the free cores suggest, and trials that keep the faster size."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.engine import compute_team
from llmctl.engine.compute_team import TRIAL_STEPS, WARMUP_STEPS, ComputeTeam, CpuLoad, team_size_for


@pytest.mark.parametrize(
    ("cpus", "busy", "limit", "expected"),
    [
        (2, 0.05, 2, 2),  # quiet
        (2, 1.0, 2, 1),  # one core busy elsewhere
        (2, 0.5, 2, 1),  # half a core taken: a member there would be descheduled
        (2, 0.2, 2, 2),  # a little background noise does not cost a thread
        (2, 2.0, 2, 1),  # never fewer than one
        (64, 1.0, 64, 63),
        (64, 0.1, 64, 64),
        (16, 0.0, 4, 4),  # never more than asked for (--threads)
        (96, 40.0, 96, 56),
    ],
)
def test_team_size_for_free_cores(cpus, busy, limit, expected):
    assert team_size_for(cpus, busy, limit) == expected


def test_cpu_load_counts_other_processes_only():
    """Busy jiffies of the machine minus this process's own, per second of wall time."""
    texts = iter(
        [
            "cpu  1000 0 500 9000 0 0 0 0 0 0\ncpu0 600 0 300 4000 0 0 0 0 0 0\ncpu1 400 0 200 5000 0 0 0 0 0 0\n",
            "1 (python) S " + " ".join(["0"] * 10) + " 300 200 0 0\n",
            # +200 busy jiffies on the two usable CPUs, +1000 on one the process may not use
            "cpu  2100 50 550 9100 0 0 0 0 0 0\ncpu0 650 50 320 4000 0 0 0 0 0 0\ncpu1 480 0 200 5000 0 0 0 0 0 0\n"
            "cpu2 1000 0 0 0 0 0 0 0 0 0\n",
            "1 (python) S " + " ".join(["0"] * 10) + " 340 210 0 0\n",  # +50 of them ours
        ]
    )
    clock = iter([10.0, 11.0])
    load = CpuLoad(read_text=lambda path: next(texts))
    load._ticks, load._cpus = 100, {0, 1}
    original = compute_team.time.monotonic
    compute_team.time.monotonic = lambda: next(clock)
    try:
        assert load.busy_elsewhere() is None  # the first sample has nothing to compare with
        assert load.busy_elsewhere() == pytest.approx(1.5)
    finally:
        compute_team.time.monotonic = original


def test_cpu_load_without_proc_is_unknown():
    def unreadable(path: Path) -> str:
        raise OSError("no /proc")

    assert CpuLoad(read_text=unreadable).busy_elsewhere() is None


class Machine:
    """Decode step times per team size, a clock, and the sizes the team set."""

    def __init__(self, step_ms: dict[int, float]) -> None:
        self.step_ms = step_ms
        self.now = 0.0
        self.calls: list[int] = []

    def team(self, limit: int = 2, load: CpuLoad | None = None) -> ComputeTeam:
        return ComputeTeam(limit, self.calls.append, cpus=limit, load=load, clock=lambda: self.now)

    def run(self, team: ComputeTeam, steps: int, rows: int = 1) -> None:
        for _ in range(steps):
            seconds = self.step_ms[team.size] / 1e3
            self.now += seconds
            team.on_decode_step(rows, seconds)


def test_quiet_machine_keeps_the_whole_team_and_backs_off():
    machine = Machine({2: 5.0, 1: 8.5})
    team = machine.team()
    machine.run(team, 2000)  # 10 s of steps: trials of one thread lose and come ever more rarely
    assert team.size == 2
    assert machine.calls[0] == 2  # set in the stepping thread on its first step
    assert machine.calls.count(2) == machine.calls.count(1) + 1 >= 2
    assert machine.calls.count(1) <= 4  # 1 s, 2 s, 4 s... apart, not one a second


def test_busy_core_shrinks_the_team_at_once():
    machine = Machine({2: 5.0, 1: 8.5})
    team = machine.team()
    machine.run(team, 50)
    machine.step_ms = {2: 25.0, 1: 9.0}  # another process took a core: the 2-thread team collapses
    machine.run(team, 3 * TRIAL_STEPS)
    assert team.size == 1
    assert machine.calls[-1] == 1


class Load(CpuLoad):
    """A load reading the test sets."""

    busy = 1.0

    def busy_elsewhere(self) -> float | None:
        return self.busy


def test_a_machine_busy_from_the_start_shrinks_the_team_after_its_first_steps():
    machine = Machine({2: 25.0, 1: 9.0})
    team = machine.team()
    machine.run(team, WARMUP_STEPS + 2 * TRIAL_STEPS)
    assert team.size == 1  # not after the first periodic trial, a second of collapsed steps later
    assert machine.calls == [2, 1]


def test_slow_first_steps_do_not_cost_the_quiet_team_a_thread():
    machine = Machine({2: 20.0})  # the team's threads wake and the caches fill
    team = machine.team()
    machine.run(team, WARMUP_STEPS)
    machine.step_ms = {2: 5.0, 1: 8.5}
    machine.run(team, 2 * TRIAL_STEPS + 1)
    assert team.size == 2 and machine.calls == [2, 1, 2]  # one thread was tried against warm steps, and lost


def test_a_smaller_team_does_not_try_more_threads_while_the_load_says_the_cores_are_taken():
    load = Load()
    machine = Machine({2: 25.0, 1: 9.0})
    team = machine.team(load=load)
    machine.run(team, 2000)  # 18 s of steps
    assert team.size == 1 and machine.calls == [2, 1]


def test_freed_core_is_taken_back_when_the_load_says_so():
    load = Load()
    machine = Machine({2: 25.0, 1: 9.0})
    team = machine.team(load=load)
    machine.run(team, 4 * TRIAL_STEPS)
    assert team.size == 1
    machine.step_ms = {2: 5.0, 1: 8.5}  # the other process ended: one thread is no slower than before
    load.busy = 0.0
    machine.run(team, 200)  # within 0.5 s of load readings and one trial
    assert team.size == 2


def test_prefill_and_batch_changes_do_not_count():
    machine = Machine({2: 5.0, 1: 8.5})
    team = machine.team()
    machine.run(team, WARMUP_STEPS + TRIAL_STEPS - 1, rows=1)
    machine.now = 100.0  # a trial is due
    machine.run(team, 1, rows=1)
    assert team.size == 1  # trying one thread
    machine.run(team, 2, rows=3)  # another batch size mid-trial: back to the size before
    assert team.size == 2 and machine.calls == [2, 1, 2]


def test_one_thread_asked_is_never_resized():
    machine = Machine({1: 8.5})
    team = machine.team(limit=1)
    machine.run(team, 500)
    assert machine.calls == [] and team.size == 1


def test_reset_restores_the_whole_team():
    machine = Machine({2: 25.0, 1: 9.0})
    team = machine.team()
    machine.run(team, 100)  # slow from the start: the first periodic trial finds one thread faster
    assert team.size == 1
    team.reset()
    assert team.size == 2 and machine.calls[-1] == 2


def test_a_smaller_team_tries_one_thread_more_when_its_trial_is_due():
    machine = Machine({8: 4.0, 7: 3.0, 6: 3.6})  # one of eight cores is busy: seven threads are fastest
    team = machine.team(limit=8)
    machine.run(team, 1000)
    assert team.size == 7 and 8 in machine.calls[1:]  # went back up to try eight, and kept seven
    machine.step_ms = {8: 2.5, 7: 3.0, 6: 3.6}  # the core is free again: no load reading, only trials
    machine.run(team, 3000)
    assert team.size == 8


def test_a_losing_size_the_quiet_load_suggests_is_tried_ever_more_rarely():
    """Where one thread is faster on a quiet machine (a tiny model), the load keeps saying both
    cores are free: that reading suggests two threads once, not at every reading."""
    load = Load()
    load.busy = 0.0
    machine = Machine({2: 9.0, 1: 5.0})
    team = machine.team(load=load)
    machine.run(team, 3000)  # 15 s of steps, a load reading every 0.5 s
    assert team.size == 1
    assert machine.calls.count(2) - 1 <= 5  # trials 1 s, 2 s, 4 s, 8 s apart, not one per reading
