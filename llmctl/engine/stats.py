"""The engine's one statistics surface.

``EngineStats`` keeps the counters, the step history and the latency window as the engine runs,
and calls step listeners (the server's Prometheus histograms) with a ``StepStats`` after every
step. Readers take one of two views, both built here and nowhere else:

- ``EngineStats.counters(requests) -> EngineCounters``: a typed read of the gauges and counters
  (``/metrics``, ``bench``);
- ``EngineStats.snapshot(requests) -> dict``: the JSON snapshot (``/v1/engine/stats``, ``llmctl top``).

What it reads is handed to its constructor (the scheduler, the start-up settings, the speculative
decoding counters) or to the call (the unfinished requests), so it depends on nothing above it.

"running" and "waiting" count **requests** everywhere: a request is running while any of its
sequences is in the batch, and waiting (queued, or preempted and queued again) otherwise.

Snapshot schema (version 2)::

    {
      "version": 2, "time": <unix s>, "uptime_s": float, "model": str, "step": int,
      "config": {"block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "enable_prefix_caching", "enable_chunked_prefill", "dtype", "device", "attention_backend"},
      "kv": {"num_blocks", "free", "cached", "used", "shared", "usage", "token_utilization",
             "block_states": "one char per block: '.' free, 'c' cached (evictable), 'u' used by one
                              sequence, 's' shared by several",
             "groups": [{"window": tokens | null (full attention), "held": blocks live sequences
                         hold in the group}]},  # KV-cache groups: one without sliding windows
      "prefix_cache": {"queries": tokens looked up, "hits": tokens found, "hit_rate": float},
      "counters": {"num_preemptions", "prompt_tokens_total", "generation_tokens_total",
                   "requests_added_total", "requests_finished": {"stop", "length", "abort", "error"}},
      "scheduler": {"running": requests, "waiting": requests (preempted ones included),
                    "preempted_waiting": waiting requests that were preempted},
      "requests": [{"id", "user", "state": "running"|"waiting"|"preempted", "priority",
                    "prompt_tokens", "generated_tokens", "cached_tokens", "blocks": [block ids],
                    "num_preemptions", "age_s", "n"}],   # one per live sequence ("id#i" when n > 1)
      "steps": [{"step", "time", "duration_s", "prefill_tokens", "decode_tokens", "num_seqs",
                 "num_running", "num_waiting", "num_preempted", "kv_usage"}],  # oldest first, last
                 # ``max_steps``; num_running / num_waiting are requests, num_seqs / num_preempted
                 # sequences, kv_usage the fraction of KV blocks held while the step ran
      "latency": {"window", "count", "ttft_s": {"p50", "p90", "p99"}, "tpot_s": {...}, "e2e_s": {...}},
                 # over the last ``window`` finished, non-aborted requests (llmctl/engine/latency.py);
                 # null where there is no data yet
      "spec_decode": null | {"method", "num_speculative_tokens", "num_drafts": verify steps,
                     "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length"},
      "experts": null | {"window": forward passes kept, "layers": [{"layer", "steps", "tokens": tokens
                 per expert, summed over the layer's last ``steps`` passes}], "weight_bytes": every
                 expert's, "read_share_per_step": mean share of weight_bytes a pass read}
                 # mixture-of-experts models (llmctl.layers.moe.expert_stats), where ``experts`` is set
    }
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from llmctl.engine.latency import LatencyWindow
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.scheduler import Scheduler, SchedulerOutput
from llmctl.engine.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:  # only annotated: the metrics and bench readers need not import the sampler and model
    from llmctl.engine.block_manager import BlockManager
    from llmctl.engine.output_processor import RequestState

STATS_VERSION = 2
STEP_HISTORY = 512


@dataclass
class StepRecord:
    step: int
    time: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    num_running: int  # requests
    num_waiting: int  # requests
    num_preempted: int
    kv_usage: float = 0.0  # fraction of KV blocks held while the step ran (its finished sequences' too)


@dataclass
class StepStats:
    """One step as a listener sees it: its record, its outputs, and the request latencies it
    completed (seconds)."""

    record: StepRecord
    outputs: list[RequestOutput]
    ttft_s: list[float]  # requests that got their first token
    itl_s: list[float]  # requests that got another token: the time since their previous one
    e2e_s: list[float]  # requests that finished (not aborted): arrival to finish


@dataclass(frozen=True)
class EngineCounters:
    requests_running: int
    requests_waiting: int
    kv_num_blocks: int
    kv_free_blocks: int  # free or cached-but-evictable
    kv_usage: float  # fraction of blocks held by live sequences
    kv_token_utilization: float | None  # computed tokens / token slots of the blocks held (None: none held)
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_added_total: int
    requests_finished: dict[str, int]  # by finish reason
    # speculative decoding (0 without it): verify steps of a sequence, draft tokens scored, accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass
class SpecCounters:
    """Speculative decoding since start: verify steps, draft tokens scored, and of those accepted."""

    num_verifies: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify yields on average: its accepted drafts plus the one it always gets."""
        return 1 + self.num_accepted / self.num_verifies if self.num_verifies else None


@dataclass(frozen=True)
class Speculation:
    """What the stats show of speculative decoding: who drafts, how many tokens, and the counters
    the speculator keeps."""

    method: str
    num_speculative_tokens: int
    counters: SpecCounters


class EngineStats:
    def __init__(
        self,
        scheduler: Scheduler,
        *,
        model: str,
        settings: dict[str, Any],
        speculation: Speculation | None = None,
        experts: Callable[[], dict[str, Any] | None] | None = None,
        history: int = STEP_HISTORY,
    ) -> None:
        """``settings``: the snapshot's ``config`` section, fixed at start-up. ``experts``: the
        snapshot's ``experts`` section, for a mixture-of-experts model (its per-expert token counts)."""
        self.scheduler = scheduler
        self.model = model
        self.settings = dict(settings)
        self.speculation = speculation
        self.start_time = time.time()
        self.step_count = 0
        self.steps: deque[StepRecord] = deque(maxlen=history)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_added_total = 0
        self.requests_finished: dict[str, int] = {r.value: 0 for r in FinishReason}
        self.latency = LatencyWindow()
        # Called after every step that ran, in the engine's thread, with the engine lock held.
        self.listeners: list[Callable[[StepStats], None]] = []
        self.experts = experts

    def request_added(self, num_prompt_tokens: int) -> None:
        self.requests_added_total += 1
        self.prompt_tokens_total += num_prompt_tokens

    def request_finished(self, reason: str) -> None:
        self.requests_finished[reason] += 1

    def record_step(
        self,
        sched: SchedulerOutput,
        outputs: list[RequestOutput],
        started: float,
        num_requests: tuple[int, int],
        num_tokens: int | None = None,
        kv_usage: float = 0.0,
    ) -> None:
        """``num_tokens``: tokens generated this step (default: one per sampling sequence)."""
        self.step_count += 1
        self.generation_tokens_total += len(sched.sampling) if num_tokens is None else num_tokens
        record = StepRecord(
            self.step_count,
            started,
            time.time() - started,
            sched.num_prefill_tokens,
            sched.num_decode_tokens,
            len(sched.scheduled),
            *num_requests,
            len(sched.preempted),
            kv_usage,
        )
        self.steps.append(record)
        step = StepStats(record, outputs, [], [], [])
        for out in outputs:
            m = out.metrics
            if any(o.delta_token_ids for o in out.outputs):
                if m.previous_token_time is None:
                    step.ttft_s.append(m.ttft)
                else:
                    step.itl_s.append(m.inter_token_latency)
            if out.finished:
                self.request_finished(FinishReason.ERROR.value if out.error else out.outputs[0].finish_reason)
                self.latency.observe(out)
                if m.e2e is not None:
                    step.e2e_s.append(m.e2e)
        for listener in self.listeners:
            listener(step)

    # ---- the two views ---------------------------------------------------------------------------
    def counters(self, requests: Iterable[RequestState]) -> EngineCounters:
        """``requests``: the unfinished ones (their live sequences' blocks give the token utilization)."""
        sched = self.scheduler
        bm = sched.block_manager
        running, waiting = sched.num_requests()
        return EngineCounters(
            requests_running=running,
            requests_waiting=waiting,
            kv_num_blocks=bm.num_blocks,
            kv_free_blocks=bm.num_free_blocks,
            kv_usage=bm.usage,
            kv_token_utilization=token_utilization(_live_sequences(requests), bm.block_size),
            prefix_cache_queries=sched.prefix_query_tokens,
            prefix_cache_hits=sched.prefix_hit_tokens,
            num_preemptions=sched.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            requests_added_total=self.requests_added_total,
            requests_finished=dict(self.requests_finished),
            **self._spec_counters(),
        )

    def snapshot(self, requests: Iterable[RequestState], max_steps: int = 120) -> dict[str, Any]:
        """The JSON snapshot (schema in the module docstring)."""
        requests = list(requests)
        now = time.time()
        counters = self.counters(requests)
        states = self.scheduler.block_manager.block_states()
        rows = _request_rows(requests, now)
        running_ids = {r["request_id"] for r in rows if r["state"] == "running"}
        preempted_ids = {r["request_id"] for r in rows if r["state"] == "preempted"} - running_ids
        for row in rows:
            del row["request_id"]
        queries, hits = counters.prefix_cache_queries, counters.prefix_cache_hits
        return {
            "version": STATS_VERSION,
            "time": now,
            "uptime_s": round(now - self.start_time, 3),
            "model": self.model,
            "step": self.step_count,
            "config": dict(self.settings),
            "kv": {
                "num_blocks": counters.kv_num_blocks,
                "free": states.count("."),
                "cached": states.count("c"),
                "used": states.count("u"),
                "shared": states.count("s"),
                "usage": counters.kv_usage,
                "token_utilization": counters.kv_token_utilization,
                "block_states": states,
                "groups": _group_rows(self.scheduler.block_manager, requests),
            },
            "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0},
            "counters": {
                "num_preemptions": counters.num_preemptions,
                "prompt_tokens_total": counters.prompt_tokens_total,
                "generation_tokens_total": counters.generation_tokens_total,
                "requests_added_total": counters.requests_added_total,
                "requests_finished": counters.requests_finished,
            },
            "scheduler": {
                "running": counters.requests_running,
                "waiting": counters.requests_waiting,
                "preempted_waiting": len(preempted_ids),
            },
            "requests": rows,
            "steps": [asdict(s) for s in list(self.steps)[-max_steps:]],
            "latency": self.latency.section(),
            "spec_decode": self._spec_section(),
            "experts": None if self.experts is None else self.experts(),
        }

    def _spec_counters(self) -> dict[str, int]:
        if self.speculation is None:
            return {}
        c = self.speculation.counters
        return {
            "spec_num_drafts": c.num_verifies,
            "spec_num_draft_tokens": c.num_drafted,
            "spec_num_accepted_tokens": c.num_accepted,
        }

    def _spec_section(self) -> dict[str, Any] | None:
        if self.speculation is None:
            return None
        c = self.speculation.counters
        return {
            "method": self.speculation.method,
            "num_speculative_tokens": self.speculation.num_speculative_tokens,
            "num_drafts": c.num_verifies,
            "draft_tokens": c.num_drafted,
            "accepted_tokens": c.num_accepted,
            "acceptance_rate": c.acceptance_rate,
            "mean_accepted_length": c.mean_accepted_length,
        }


def token_utilization(seqs: Iterable[Sequence], block_size: int) -> float | None:
    """Of the token slots in blocks that live sequences hold, the fraction holding a computed token
    (a shared block counts once, as full as its fullest holder)."""
    filled: dict[int, int] = {}
    for seq in seqs:
        for table in seq.block_tables:
            for i, block_id in enumerate(table):
                if block_id < 0:  # released by a sliding group (NULL_BLOCK)
                    continue
                tokens = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
                filled[block_id] = max(filled.get(block_id, 0), tokens)
    slots = len(filled) * block_size
    return sum(filled.values()) / slots if slots else None


def _group_rows(bm: BlockManager, requests: Iterable[RequestState]) -> list[dict[str, Any]]:
    """Per KV-cache group: its window and the blocks live sequences hold in it (shared ones once)."""
    held: list[set[int]] = [set() for _ in bm.group_windows]
    for seq in _live_sequences(requests):
        for g, table in enumerate(seq.block_tables):
            held[g].update(b for b in table if b >= 0)
    return [{"window": w, "held": len(h)} for w, h in zip(bm.group_windows, held)]


def _live_sequences(requests: Iterable[RequestState]) -> list[Sequence]:
    return [seq for request in requests for seq in request.sequences() if not seq.is_finished]


def _request_rows(requests: Iterable[RequestState], now: float) -> list[dict[str, Any]]:
    rows = []
    for request in requests:
        for seq in request.sequences():
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.RUNNING:
                state = "running"
            else:
                state = "preempted" if seq.num_preemptions else "waiting"
            rows.append(
                {
                    "id": request.request_id if request.params.n == 1 else f"{request.request_id}#{seq.index}",
                    "request_id": request.request_id,
                    "user": seq.user,
                    "state": state,
                    "priority": seq.priority,
                    "prompt_tokens": seq.num_prompt_tokens,
                    "generated_tokens": seq.num_output_tokens,
                    "cached_tokens": seq.num_cached_tokens,
                    "blocks": [b for table in seq.block_tables for b in table if b >= 0],
                    "num_preemptions": seq.num_preemptions,
                    "age_s": round(now - request.metrics.arrival_time, 3),
                    "n": request.params.n,
                }
            )
    return rows
