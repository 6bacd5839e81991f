"""Size the CPU compute team (torch's OpenMP threads) to the cores that are free, as steps run.

A decode step is a few hundred short parallel regions. Its team spins between them, which pays off
only while every member owns a core: when another process (or this process's event loop, a
benchmark client, a terminal) takes a core, the member sharing it is descheduled for a whole
time slice and every region waits for it. On 2 cores with one busy, a 2-thread team decodes at a
fifth of its quiet speed; one thread on the free core at half.

``ComputeTeam`` is a step listener (``EngineStats.listeners``): it runs in the thread that steps
the engine, after every step, and decides there, from what it measures, with no machine tuned in:

* what is free: the CPU time other processes took from the cores this process may use
  (``/proc/stat`` minus ``/proc/self/stat``) over the last interval;
* what is fast: a trial. As soon as the team's first decode steps are timed (a machine already
  busy when the engine starts would otherwise decode at a third of its speed until a later
  trial), then every so often, at once when decode steps slow down, and when the free cores
  change, it runs ``TRIAL_STEPS`` decode steps of the same batch with another team size and keeps
  the faster size. A trial that keeps the size waits twice as long for the next. A smaller team
  tries one thread more only when no load reading says that the cores are still taken, and a
  reading that keeps suggesting the same size is tried once, not at every reading.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmctl.engine.stats import StepStats

log = logging.getLogger(__name__)

TRIAL_STEPS = 6  # decode steps timed per team size in a trial
WARMUP_STEPS = 6  # decode steps not timed when the team starts (its threads wake, caches fill)
SLOWDOWN = 1.3  # decode steps this much slower than the team's own median start a trial at once
FASTER = 0.92  # a trial size must take at most this fraction of the current size's time to win
FIRST_INTERVAL_S = 1.0  # seconds between trials after the first; doubles while trials keep the size
LONGEST_INTERVAL_S = 32.0
LOAD_INTERVAL_S = 0.5  # how often the free cores are read


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def team_size_for(cpus: int, busy_elsewhere: float, limit: int) -> int:
    """Threads for a team on ``cpus`` cores while other processes keep ``busy_elsewhere`` cores
    busy: one per core left free, a core counted free when at most a quarter of it is taken."""
    free = int(cpus - busy_elsewhere + 0.25)
    return max(1, min(limit, free))


class CpuLoad:
    """Cores kept busy by other processes, from the kernel's CPU counters (None where there are none)."""

    def __init__(self, read_text: Callable[[Path], str] = Path.read_text) -> None:
        self._read = read_text
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, float, float] | None = None
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            lines = self._read(Path("/proc/stat")).splitlines()
            own = self._read(Path("/proc/self/stat")).rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        busy = 0
        for line in lines:  # per-CPU lines of the CPUs this process may use (a cpuset narrows them)
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and (self._cpus is None or int(name[3:]) in self._cpus):
                busy += sum(int(v) for v in ticks[:3]) + sum(
                    int(v) for v in ticks[5:8]
                )  # user nice system, irq softirq steal
        return time.monotonic(), busy / self._ticks, (int(own[11]) + int(own[12])) / self._ticks  # utime stime

    def busy_elsewhere(self) -> float | None:
        """Cores other processes kept busy since the previous call (None on the first call)."""
        sample = self._sample()
        if sample is None:
            return None
        last, self._last = self._last, sample
        if last is None or sample[0] - last[0] <= 0:
            return None
        return max(0.0, ((sample[1] - last[1]) - (sample[2] - last[2])) / (sample[0] - last[0]))


@dataclass
class _Trial:
    size: int
    previous: int
    times: list[float]  # the median step before the trial, then the trial's steps


class ComputeTeam:
    """Picks the compute team's size between steps (see the module docstring)."""

    def __init__(
        self,
        limit: int,
        set_threads: Callable[[int], None],
        cpus: int | None = None,
        load: CpuLoad | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = max(1, limit)  # the size asked for (--threads, or every core): never more
        self.size = self.limit
        self.cpus = cpus or usable_cpus()
        self._set_threads = set_threads
        self._load = load
        self._clock = clock
        self._times: list[float] = []  # recent decode steps at the current size, same batch
        self._rows = 0
        self._trial: _Trial | None = None
        self._interval = FIRST_INTERVAL_S
        self._next_trial = clock()  # the first trial follows the first timed steps
        self._next_load = clock()
        self._suggested: int | None = None
        self._load_size: int | None = None  # the size the latest load reading asks for
        self._warmup = WARMUP_STEPS
        self._applied = False  # the size is set in the stepping thread on its first step

    def __call__(self, step: StepStats) -> None:
        record = step.record
        if record.prefill_tokens or not record.decode_tokens:  # only like decode steps compare
            return
        self.on_decode_step(record.decode_tokens, record.duration_s)

    def on_decode_step(self, rows: int, seconds: float) -> None:
        if self.limit == 1:
            return
        if not self._applied:
            self._applied = True
            self._set_threads(self.size)
        if self._warmup:
            self._warmup -= 1
            return
        now = self._clock()
        if rows != self._rows:  # another batch: earlier times do not compare
            self._rows, self._times = rows, []
            if self._trial is not None:
                self._resize(self._trial.previous)
                self._trial = None
        if self._trial is not None:
            return self._trial_step(seconds, now)
        self._times = [*self._times[-(2 * TRIAL_STEPS - 1) :], seconds]
        if len(self._times) < TRIAL_STEPS:
            return
        candidate = self._candidate(now)
        recent = statistics.median(self._times[-TRIAL_STEPS:])
        slowed = recent > SLOWDOWN * statistics.median(self._times)
        if candidate is not None and (now >= self._next_trial or slowed or candidate == self._suggested):
            self._trial = _Trial(candidate, self.size, [recent])
            self._resize(candidate)
            self._times = []

    def _trial_step(self, seconds: float, now: float) -> None:
        trial = self._trial
        trial.times.append(seconds)
        if len(trial.times) <= TRIAL_STEPS:
            return
        baseline, tried = trial.times[0], statistics.median(trial.times[1:])
        self._trial = None
        if tried <= FASTER * baseline:
            log.debug(
                "compute team %d -> %d threads (%.2f -> %.2f ms a step)",
                trial.previous,
                trial.size,
                baseline * 1e3,
                tried * 1e3,
            )
            self._interval = FIRST_INTERVAL_S
            self._times = trial.times[1:]
        else:
            self._resize(trial.previous)
            self._interval = min(LONGEST_INTERVAL_S, self._interval * 2)
        self._suggested = None
        self._next_trial = now + self._interval

    def _candidate(self, now: float) -> int | None:
        """The size to try next: what the free cores suggest when their count changes and that
        differs, else one thread more when below the size asked for (None while the latest load
        reading says the cores are still taken: trying would cost a collapsed step per trial step),
        one fewer at it. A suggestion is tried once per change: where a size it suggests keeps
        losing (one thread beats two on a quiet machine), its trials back off like any other."""
        if self._load is not None and now >= self._next_load:
            self._next_load = now + LOAD_INTERVAL_S
            busy = self._load.busy_elsewhere()
            if busy is not None:
                size = team_size_for(self.cpus, busy, self.limit)
                if size != self._load_size:
                    self._suggested = size if size != self.size else None
                self._load_size = size
        if self._suggested is not None:
            return self._suggested
        if self.size < self.limit:
            return None if self._load_size is not None and self._load_size <= self.size else self.size + 1
        return self.size - 1

    def reset(self) -> None:
        """Back to the full size, forgetting what was measured (whoever steps next starts afresh)."""
        self._trial, self._times, self._suggested, self._load_size = None, [], None, None
        self._interval, self._next_trial, self._warmup = FIRST_INTERVAL_S, self._clock(), WARMUP_STEPS
        self._resize(self.limit)
        self._applied = False

    def _resize(self, size: int) -> None:
        if size != self.size:
            self.size = size
            self._set_threads(size)


def cpu_compute_team(device: object, threads: int) -> ComputeTeam | None:
    """The team for an engine computing on ``device`` with ``threads`` threads asked for (None off a CPU:
    a GPU's kernels do not run on the host's team)."""
    import torch

    if str(device).split(":")[0] != "cpu":
        return None
    return ComputeTeam(threads, torch.set_num_threads, load=CpuLoad())
