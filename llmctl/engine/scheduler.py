"""Iteration-level scheduler: which sequences run in the next step, and how many tokens each.

Every step:

1. **Decodes first.** Each running sequence with one pending token gets it. When the pool has
   no block for one, the most recently admitted running sequence is preempted (by recompute: its
   blocks go back, full ones stay in the prefix cache) until it fits.
2. **Prefill work fills the rest of the token budget**: chunks of prompts already admitted, then
   new admissions. The budget is split max-min fairly between users (a user asking for less than
   an equal share gets all it asks; the rest is shared by the others), FCFS by (priority, arrival)
   within a user. With chunked prefill off a prompt is only scheduled whole, so the budget is not
   split: users take turns by the seats they hold.
3. **Fair seats.** When all ``max_num_seqs`` seats (or all blocks) are taken and a user holding
   fewer than its share ``max_num_seqs // active users`` is waiting, the most recent sequence of
   the user holding the most seats above its share is preempted to make room, if that user keeps
   its share (a prompt that forks ``n > 1`` samples holds ``n`` seats).

4. **LoRA slots.** Running sequences use at most ``max_loras`` distinct adapters (the device slots
   every batch's adapters must fit): a request whose adapter would be one more waits, and its user's
   queue with it, until a running adapter's last sequence ends.

The scheduler never fails a request for lack of blocks: preempted sequences wait at the head of
their user's queue and resume, finding their full blocks again in the prefix cache.

With sliding-window layers a sequence needs blocks in every KV-cache group (block_manager.py):
``allocate`` succeeds only when all of them fit the shared pool (a sliding group's share first
gives back what left its window), so admission and preemption count every group through it.

After the model ran, ``update_from_output`` does the step's bookkeeping in one place (as nano-vllm's
``postprocess``): computed K/V, ``n > 1`` forks, the sampled tokens, and the end of sequences that
hit EOS, a stop token id, ``max_tokens`` or ``max_model_len``. The scheduler owns the block manager:
every block is taken and given back through it.
"""

from __future__ import annotations

import heapq
import logging
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    kv_cache_dtype: str = "auto"  # salts the prefix-cache keys
    num_speculative_tokens: int = 0  # most draft tokens a decode may verify per step (0: no speculation)
    # Pipeline parallelism (llmctl/parallel/pipeline.py): batches in flight at once, which share the
    # live sequences, each taking at most its share so that every stage has a batch to run.
    batches_in_flight: int = 1
    # LoRA (llmctl/lora/): most distinct adapters among running sequences (--max-loras; 0: no LoRA)
    max_loras: int = 0


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence, so its last logits pick the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens verified behind the sequence's pending token (a speculative decode)."""
        return max(0, self.seq.num_computed_tokens + self.num_new_tokens - self.seq.num_tokens)


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    # speculative decodes: the pending token plus draft tokens, one decode row each, after the decodes
    verifies: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_blocks_touched: int = 0  # pool blocks [0, n) may have been handed out so far
    # The sequences that get a token this step, and for each the row of the runner's sampling
    # logits to draw it from: the ones whose chunk samples, in ``scheduled`` order, then the
    # ``n > 1`` siblings forked off a prompt that completes this step (they share its row).
    sampling: list[Sequence] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Prefill chunks first, then decodes, then verifies: the layout the model runner and
        attention expect."""
        return self.prefills + self.decodes + self.verifies

    @property
    def num_verify_rows(self) -> int:
        """Logits rows of the verifies: one per draft token plus the bonus position."""
        return sum(item.num_new_tokens for item in self.verifies)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills)

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decodes) + self.num_verify_rows

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.verifies


def max_min_fair_shares(demands: dict[str, int], capacity: int) -> dict[str, int]:
    """Split ``capacity`` so that nobody gets more than they ask and the smallest share is as large
    as possible (water-filling)."""
    shares: dict[str, int] = {}
    remaining = capacity
    users = sorted(demands, key=lambda u: demands[u])
    for i, user in enumerate(users):
        shares[user] = min(demands[user], remaining // (len(users) - i))
        remaining -= shares[user]
    return shares


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager | None = None,
        *,
        propose_drafts: Callable[[Sequence, int], int] | None = None,
    ) -> None:
        """``block_manager``: the pool's (None: a plain one from ``config``; the engine passes one
        wired to its quantized KV pool). ``propose_drafts``: ``(seq, most) -> k`` draft tokens to
        verify behind a decode (speculative decoding, llmctl/spec/); None: no speculation."""
        if block_manager is None:
            block_manager = BlockManager(
                config.num_blocks, config.block_size, config.enable_prefix_caching, config.kv_cache_dtype
            )
        elif (block_manager.num_blocks, block_manager.block_size) != (config.num_blocks, config.block_size):
            raise ValueError("the block manager's pool differs from the scheduler config's")
        self.config = config
        self.block_manager = block_manager
        self.propose_drafts = propose_drafts
        self.running: list[Sequence] = []  # admission order: the tail is preempted first
        self.waiting: dict[str, list[tuple[int, float, int, Sequence]]] = defaultdict(list)  # per-user heaps
        self.num_waiting = 0  # kept current so other threads may read it without walking the queues
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.resumed_hit_tokens = 0  # tokens a preempted sequence found again in the cache on resuming
        # Pipeline parallelism: the sequences of batches still in the pipeline, which are neither
        # scheduled nor preempted (``mark_in_flight`` / ``mark_landed``).
        self.in_flight: set[int] = set()

    # ---- queue management --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting[seq.user], (seq.priority, seq.arrival_time, seq.seq_id, seq))
        self.num_waiting += 1

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove a sequence wherever it is and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            queue = self.waiting[seq.user]
            queue[:] = [entry for entry in queue if entry[3] is not seq]
            heapq.heapify(queue)
            self.num_waiting -= 1
            if not queue:
                del self.waiting[seq.user]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` of a sequence that is ending (a stop string found
        before the last of the tokens it got this step: the ones after it were never generated)."""
        if num_tokens < seq.num_prompt_tokens:
            raise ValueError("a truncation cannot reach into the prompt")
        del seq.token_ids[num_tokens:]

    def mark_in_flight(self, sched: SchedulerOutput) -> None:
        """Pipeline parallelism: ``sched`` was launched; its sequences wait for its tokens."""
        self.in_flight.update(item.seq.seq_id for item in sched.scheduled)

    def mark_landed(self, sched: SchedulerOutput) -> None:
        """Pipeline parallelism: ``sched``'s results are back; its sequences may be scheduled again."""
        self.in_flight.difference_update(item.seq.seq_id for item in sched.scheduled)

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) requests: a request is running while any of its sequences is in the
        batch, and waiting (queued, or preempted and queued again) otherwise."""
        running = {seq.request_id for seq in self.running}
        waiting = {entry[3].request_id for queue in self.waiting.values() for entry in queue}
        return len(running), len(waiting - running)

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        limit = self._batch_seq_limit()

        # 1. decodes
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < limit:
            seq = self.running[i]
            if seq.seq_id in self.in_flight:
                i += 1
                continue
            k = self._lookahead(seq, budget) if seq.num_pending_tokens == 1 else 0
            if seq.num_pending_tokens == 1 and self._allocate_or_preempt(seq, 1 + k, out, scheduled):
                (out.verifies if k else out.decodes).append(ScheduledSeq(seq, 1 + k))
                scheduled.add(seq.seq_id)
                budget -= 1 + k
            if seq.status is SequenceStatus.RUNNING:
                i += 1
        if any(item.seq.lora is not None for item in out.decodes):
            # each adapter's decode rows side by side: the LoRA kernels then add its deltas to one
            # range of rows instead of gathering and scattering them (no row depends on its place)
            out.decodes.sort(key=lambda item: -1 if item.seq.lora is None else item.seq.lora.id)

        # 2. prefill chunks of admitted prompts, then admissions, under max-min fair shares. With
        # chunked prefill off a prompt must fit whole, so decodes are not charged against it (a
        # prompt longer than what the decodes leave would otherwise wait as long as they run).
        if not self.config.enable_chunked_prefill:
            budget = self.config.max_num_batched_tokens
        if budget > 0:
            self._schedule_prefills(budget, out, scheduled, limit)
        out.blocks_to_copy = self.block_manager.take_pending_copies()
        out.num_blocks_touched = self.block_manager.num_blocks_touched
        self._plan_sampling(out)
        return out

    def _batch_seq_limit(self) -> int:
        """Most sequences in one batch: all of them, or with pipeline parallelism the batch's share
        of the live ones (those that could run: at most ``max_num_seqs``). Without pipeline
        parallelism there is no cap here: forked children (``n`` > 1) may outnumber the seats."""
        groups = self.config.batches_in_flight
        if groups == 1:
            return sys.maxsize
        live = min(len(self.running) + self.num_waiting, self.config.max_num_seqs)
        return max(1, -(-live // groups))

    def _lookahead(self, seq: Sequence, budget: int) -> int:
        """Draft tokens to verify behind a decode's pending token: within the token budget, the
        context limit and the tokens ``max_tokens`` still allows after the next one."""
        most = min(
            self.config.num_speculative_tokens,
            budget - 1,
            self.config.max_model_len - seq.num_tokens,
            seq.params.max_tokens - seq.num_output_tokens - 1,
        )
        if self.propose_drafts is None or most <= 0:
            return 0
        return self.propose_drafts(seq, most)

    @staticmethod
    def _plan_sampling(out: SchedulerOutput) -> None:
        """Which sequences sample this step, from which logits row; a prompt completing with
        ``n > 1`` gets its siblings here, each drawing its own first token from the prompt's row."""
        samplers = [item.seq for item in out.scheduled if item.samples and item.seq.pooling is None]
        out.sampling = list(samplers)
        out.logits_rows = list(range(len(samplers)))
        for row, parent in enumerate(samplers):
            if parent.pending_forks:
                children = [parent.fork(parent.index + k) for k in range(1, parent.pending_forks + 1)]
                out.forks.append((parent, children))
                out.sampling.extend(children)
                out.logits_rows.extend([row] * len(children))

    def _prefill_shares(self, budget: int) -> dict[str, int]:
        """Each user's share of the step's prefill tokens."""
        demands: dict[str, int] = defaultdict(int)
        for seq in self.running:
            if seq.num_pending_tokens > 1 and seq.seq_id not in self.in_flight:
                demands[seq.user] += seq.num_pending_tokens
        for user, queue in self.waiting.items():
            demands[user] += sum(entry[3].num_pending_tokens for entry in queue)
        if self.config.enable_chunked_prefill:
            return max_min_fair_shares(demands, budget)
        return dict.fromkeys(demands, budget)  # whole prompts only: an even split could fit none

    def _schedule_prefills(self, budget: int, out: SchedulerOutput, scheduled: set[int], limit: int) -> None:
        chunked = self.config.enable_chunked_prefill
        shares = self._prefill_shares(budget)
        for seq in list(self.running):
            if len(scheduled) >= limit:
                return
            if (
                seq.num_pending_tokens <= 1
                or seq.seq_id in scheduled
                or seq.seq_id in self.in_flight
                or seq.status is not SequenceStatus.RUNNING
            ):
                continue
            n = min(seq.num_pending_tokens, shares[seq.user], budget)
            if n <= 0 or (not chunked and n < seq.num_pending_tokens):
                continue
            if self._allocate_or_preempt(seq, n, out, scheduled):
                out.prefills.append(ScheduledSeq(seq, n))
                scheduled.add(seq.seq_id)
                shares[seq.user] -= n
                budget -= n

        blocked_users: set[str] = set()
        while budget > 0 and len(scheduled) < limit:
            user = self._next_user(blocked_users)
            if user is None:
                break
            seq = self.waiting[user][0][3]
            if not self._lora_fits(seq):
                blocked_users.add(user)  # waits for a LoRA slot; other users' requests may go first
                continue
            seats = 1 + seq.pending_forks  # n > 1: its samples will be forked into seats of their own
            while self._seats_in_use() + seats > self.config.max_num_seqs:
                if not self._preempt_for_fairness(user, out, scheduled):
                    break
            if self._seats_in_use() + seats > self.config.max_num_seqs:
                break  # the fairest next request waits for seats; nobody else jumps ahead of it
            # a sequence holding no blocks may adopt cached ones, unless it needs every prompt position
            may_hit = not seq.block_table and not seq.needs_every_position
            cached = self.block_manager.find_cached_prefix(seq) if may_hit else []
            pending = seq.num_tokens - seq.num_computed_tokens - len(cached) * self.block_manager.block_size
            n = min(pending, shares.get(user, 0), budget)
            if n <= 0 or (not chunked and n < pending):
                blocked_users.add(user)
                continue
            while not self.block_manager.allocate(seq, n, cached):
                if not self._preempt_for_fairness(user, out, scheduled):
                    break
            else:
                heapq.heappop(self.waiting[user])
                self.num_waiting -= 1
                if not self.waiting[user]:
                    del self.waiting[user]
                self._admit(seq, len(cached))
                out.prefills.append(ScheduledSeq(seq, n))
                scheduled.add(seq.seq_id)
                shares[user] -= n
                budget -= n
                continue
            break  # the pool is short and nobody holds more than their share: wait for blocks

    def _admit(self, seq: Sequence, num_cached_blocks: int) -> None:
        cached_tokens = num_cached_blocks * self.block_manager.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached_tokens
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += cached_tokens
        else:
            self.resumed_hit_tokens += cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether admitting ``seq`` keeps the running adapters within ``max_loras``."""
        if seq.lora is None:
            return True
        running = {s.lora.id for s in self.running if s.lora is not None}
        return seq.lora.id in running or len(running) < self.config.max_loras

    def _seats_by_user(self) -> dict[str, int]:
        """Seats held: a running sequence holds one, plus one per sample it will fork (n > 1)."""
        seats: dict[str, int] = defaultdict(int)
        for seq in self.running:
            seats[seq.user] += 1 + seq.pending_forks
        return seats

    def _seats_in_use(self) -> int:
        return sum(1 + seq.pending_forks for seq in self.running)

    def _next_user(self, blocked: set[str]) -> str | None:
        """The waiting user holding the fewest seats (ties: the earliest head-of-queue request)."""
        seats = self._seats_by_user()
        candidates = [u for u, q in self.waiting.items() if q and u not in blocked]
        if not candidates:
            return None
        return min(candidates, key=lambda u: (seats[u], self.waiting[u][0][:3]))

    # ---- preemption --------------------------------------------------------------------------
    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Allocate for a running sequence, preempting from the tail of ``running`` until it fits.
        Returns False when ``seq`` itself had to be preempted."""
        while not self.block_manager.allocate(seq, n):
            victim = next(s for s in reversed(self.running) if s.seq_id not in self.in_flight)  # seq at the latest
            self._preempt(victim, out, scheduled)
            if victim is seq:
                return False
        return True

    def _preempt_for_fairness(self, user: str, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Free a seat (and its blocks) for ``user`` if it holds less than its fair share and another
        user holds more; the victim is that user's most recently admitted sequence."""
        seats = self._seats_by_user()
        active = set(seats) | set(self.waiting)
        fair = max(1, self.config.max_num_seqs // max(1, len(active)))
        if seats[user] >= fair:
            return False
        heaviest = max(seats, key=lambda u: seats[u], default=None)
        if heaviest is None or heaviest == user or seats[heaviest] <= fair:
            return False
        # The victim's user keeps its fair share: a prompt that will fork (n > 1) holds several seats,
        # and taking it could leave its user below the share, free to take one back: round and round.
        victim = next(
            (
                s
                for s in reversed(self.running)
                if s.user == heaviest
                and s.seq_id not in self.in_flight
                and seats[heaviest] - 1 - s.pending_forks >= fair
            ),
            None,
        )
        if victim is None:  # all in the pipeline (their blocks are being written), or none can be spared
            return False
        self._preempt(victim, out, scheduled)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput, scheduled: set[int]) -> None:
        if seq.seq_id in scheduled:  # undo this step's work for it
            scheduled.discard(seq.seq_id)
            out.prefills = [s for s in out.prefills if s.seq is not seq]
            out.decodes = [s for s in out.decodes if s.seq is not seq]
            out.verifies = [s for s in out.verifies if s.seq is not seq]
        seq.draft_token_ids, seq.draft_probs, seq.num_draft_computed = [], None, 0
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    # ---- after the model ran -----------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: list[int], verified_token_ids: list[list[int]] | None = None
    ) -> None:
        """Book the step the model ran: the K/V it computed (newly full blocks go to the prefix
        cache), the ``n > 1`` forks, one sampled token per ``out.sampling`` sequence, the tokens
        each of ``out.verifies`` got (its accepted drafts and one more), and the end of those that
        hit EOS, a stop token, ``max_tokens`` or ``max_model_len`` (their blocks go back). Stop
        strings are text, so the output processor finds them (see ``finish``)."""
        for item in out.prefills + out.decodes:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)
            if item.seq.pooling is not None and item.seq.num_pending_tokens == 0:
                self.finish(item.seq, FinishReason.STOP)  # pooled: its prefill is all it runs
        for parent, children in out.forks:
            self._fork(parent, children)
        for seq, token in zip(out.sampling, sampled_token_ids, strict=True):
            seq.token_ids.append(token)
            if (reason := self._end_reason(seq, token)) is not None:
                self.finish(seq, reason)
        for item, tokens in zip(out.verifies, verified_token_ids or [], strict=True):
            self._book_verified(item.seq, tokens)

    def _book_verified(self, seq: Sequence, tokens: list[int]) -> None:
        """Append a verify's tokens up to the first that ends the sequence; K/V stays for the
        pending token and the accepted drafts, the rejected drafts' lookahead blocks go back."""
        reason = None
        appended = 0
        for token in tokens:
            seq.token_ids.append(token)
            appended += 1
            if (reason := self._end_reason(seq, token)) is not None:
                break
        seq.num_computed_tokens += appended  # the pending token, then each accepted draft before the last
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        seq.draft_token_ids, seq.draft_probs = [], None
        self.block_manager.cache_full_blocks(seq)
        if reason is not None:
            self.finish(seq, reason)
        else:
            self.block_manager.release_tail(seq)

    def _end_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why ``token``, just appended, ends the sequence (its stop conditions, or its grammar)."""
        reason = self._stop_reason(seq, token)
        if reason is None and seq.grammar is not None and not seq.grammar.accept_token(token):
            logger.warning("sequence %s: token %d broke its grammar (%s)", seq.seq_id, token, seq.grammar.error)
            reason = FinishReason.ERROR
        return reason

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in self.config.eos_token_ids and (not params.ignore_eos or _grammar_done(seq)):
            return FinishReason.STOP
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children share the parent's blocks (the partial last one copy-on-write) and run right
        behind it."""
        parent.pending_forks = 0
        at = self.running.index(parent) + 1
        for child in children:
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
        self.running[at:at] = children


def _grammar_done(seq: Sequence) -> bool:
    """A structured output whose grammar is complete ends at EOS even with ``ignore_eos``: its mask
    allows nothing else."""
    return seq.grammar is not None and seq.grammar.is_terminated
