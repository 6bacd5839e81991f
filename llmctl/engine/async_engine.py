"""The engine loop in a background thread, with asyncio streams of per-request outputs.

The loop thread owns stepping; API coroutines add and abort requests under one lock, so a
request joins the batch at the next step boundary. Each request's outputs are pushed into an
``asyncio.Queue`` on the caller's event loop as soon as the step that produced them ends: one
wake-up of that loop per step for all its requests, and none while an earlier delivery is still
waiting to run there (the outputs join it, in order). A woken event loop takes a core from the
compute team, so it is woken no more often than it can listen. A caller that wants only the
finished output (a response that is not streamed) is woken once, when its request finishes.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from llmctl.engine.compute_team import ComputeTeam, cpu_compute_team
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.openmp import release_thread_pool
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.stats import EngineCounters, StepStats
from llmctl.errors import EngineBusyError
from llmctl.pooling_params import PoolingParams
from llmctl.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the message carries the original error."""


class FairLock:
    """A lock taken in the order it was asked for. The engine loop releases the lock after a
    step and asks for it again at once; with a plain ``threading.Lock`` it usually wins again,
    so an abort, an add or a metrics read can wait many steps (seen: a second Ctrl+C's aborts
    waited over 20 s behind a busy loop). Here a waiter is served before the loop's next step."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Mailbox:
    """Outputs on their way to one event loop's queues. ``post`` (any thread) schedules one
    delivery on the loop unless one is already scheduled and has not run yet; ``deliver`` (on the
    loop) empties the box into the queues in the order things were posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, object]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, items: list[tuple[asyncio.Queue, object]]) -> None:
        with self._lock:
            self._items.extend(items)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self.deliver)
        except RuntimeError:  # the loop is closed: nobody is left to read these outputs
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


@dataclass(frozen=True)
class _Stream:
    """Where one request's outputs go."""

    mailbox: Mailbox
    queue: asyncio.Queue
    final_only: bool  # only the finished output (and errors)


AUTO = "auto"  # compute_team: the CPU team for the engine's device (None on a GPU)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int | None = None,
        compute_team: ComputeTeam | Literal["auto"] | None = AUTO,
    ) -> None:
        self.engine = engine
        # refuse new requests while this many wait (None: no limit); the one place the limit is checked
        self.max_waiting = max_waiting
        self.lock = FairLock()  # held for a whole step; callers are served between steps, in order
        self._work = threading.Event()
        self._stopping = False
        self._streams: dict[str, _Stream] = {}
        self._mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}
        # sizes the CPU compute team between steps (llmctl/engine/compute_team.py); None: never resized
        self.compute_team = compute_team if compute_team != AUTO else None
        self._auto_team = compute_team == AUTO
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        """Start the loop thread. Call it from the thread that loaded the model: that thread's
        OpenMP workers are released here, so the loop thread's are the only ones (two pools on
        a small machine cost ~25 % of throughput; llmctl/engine/openmp.py). The compute team,
        when there is one, listens to the loop's steps from here on."""
        if self._thread is None:
            release_thread_pool()
            if self._auto_team:  # the size asked for is the one this (the loading) thread was given
                self.compute_team = cpu_compute_team(self.engine.device, torch.get_num_threads())
            if self.compute_team is not None:
                self.engine.stats.listeners.append(self.compute_team)
            self._thread = threading.Thread(target=self._loop, name="llmctl-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.compute_team is not None and self.compute_team in self.engine.stats.listeners:
            self.engine.stats.listeners.remove(self.compute_team)
            self.compute_team.reset()  # torch's default for threads started later is the whole team again

    @property
    def is_dead(self) -> bool:
        """The loop stopped on a fault in model execution or sampling (a fault in one request's
        output only fails that request): nothing more will be served; ``dead_error`` says why.
        A server answers ``/health`` with 503 and exits, so that a supervisor restarts it."""
        return self.error is not None

    @property
    def dead_error(self) -> str | None:
        return None if self.error is None else f"engine loop failed: {self.error!r}"

    def _loop(self) -> None:
        # A step's outputs are handed over as the next step starts its forward pass: the event
        # loops then encode and send them while the forward runs without the GIL, instead of
        # holding the GIL as the engine thread schedules the next step. A step that runs no
        # forward, or an idle engine, hands them over at its end.
        pending: list[RequestOutput] = []

        def hand_over() -> None:
            if pending:
                self._publish([(out.request_id, out) for out in pending])
                pending.clear()

        try:
            while not self._stopping:
                with self.lock:
                    busy = self.engine.has_unfinished()
                    outputs = self.engine.step(before_forward=hand_over) if busy else []
                    more = busy and self.engine.has_unfinished()
                hand_over()  # a step that ran no forward still owes the previous step's outputs
                pending.extend(outputs)
                if not more:  # no step follows to hand these over
                    hand_over()
                if not busy:
                    self._work.wait(timeout=0.5)
                    self._work.clear()
            hand_over()
        except BaseException as exc:  # noqa: BLE001 - surface to every waiting client, never hang them
            # The traceback first, then the error: a server reports the failure (and exits) once
            # it sees the error, so the traceback always comes before that message, never after.
            traceback.print_exc()
            with self.lock:  # adds check the error under the lock: none registers after this
                self.error = exc
            self._publish([(request_id, EngineDeadError(self.dead_error)) for request_id in list(self._streams)])

    def _publish(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their streams: one post per event loop."""
        posts: dict[Mailbox, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None or (stream.final_only and isinstance(item, RequestOutput) and not item.finished):
                continue
            posts.setdefault(stream.mailbox, []).append((stream.queue, item))
        for mailbox, batch in posts.items():
            mailbox.post(batch)

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        mailbox = self._mailboxes.get(loop)
        if mailbox is None or mailbox.loop.is_closed():
            for old in [k for k in self._mailboxes if k.is_closed()]:  # loops that ended (asyncio.run per call)
                del self._mailboxes[old]
            mailbox = self._mailboxes[loop] = Mailbox(loop)
        return mailbox

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue,
        final_only: bool = False,
        **kwargs: Any,
    ) -> str:
        """Validate and queue (raises ``InvalidRequestError`` at once); outputs (with ``final_only``:
        the finished one alone) will be put on ``queue`` through ``loop``. Blocks up to one engine
        step for the lock: call it from a worker thread, as ``generate`` does, not on the event loop."""
        if self.error is not None:
            raise EngineDeadError(self.dead_error)
        self.engine.prepare(params)  # compile a grammar here, outside the lock the loop steps under
        with self.lock:  # the queue check and the add are one step: concurrent adds cannot overshoot
            if self.max_waiting is not None:
                _, waiting = self.engine.scheduler.num_requests()
                if waiting >= self.max_waiting:
                    raise EngineBusyError(f"{waiting} requests are waiting (limit {self.max_waiting}); retry later")
            if self.error is not None:  # the loop died after the check above: do not wait forever
                raise EngineDeadError(self.dead_error)
            request_id = self.engine.add_request(prompt, params, **kwargs)
            self._streams[request_id] = _Stream(self._mailbox(loop), queue, final_only)
        self._work.set()
        return request_id

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        final_only: bool = False,
        **kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields each step's output for the request until it finishes (a pooling request: one);
        with ``final_only``, the finished output alone (each output carries the totals), so the
        event loop is not woken per step for a caller that only wants the end. Closing the
        iterator early (a client that went away) aborts the request and frees its blocks (in a
        worker thread, so it takes effect within a step). The add itself runs in a worker thread
        too, so the event loop never waits for the engine's lock."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        adding = asyncio.ensure_future(
            asyncio.to_thread(self.add_request, prompt, params, loop, queue, final_only, **kwargs)
        )
        try:
            request_id = await asyncio.shield(adding)
        except asyncio.CancelledError:  # the caller left while the add was in flight: undo it once done
            adding.add_done_callback(
                lambda f: f.cancelled() or f.exception() or loop.run_in_executor(None, self._discard, f.result())
            )
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # abort in a worker thread: taking the lock may wait for a whole step
                loop.run_in_executor(None, self._discard, request_id)

    def fail(self, request_id: str, error: BaseException) -> None:
        """End the request's ``generate`` with ``error`` (raised there, after the outputs already
        on their way), which aborts the request. Any thread; a request not (or no longer) being
        generated is left alone."""
        self._publish([(request_id, error)])

    def _discard(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            return self.engine.abort(request_id)

    # ---- statistics (llmctl/engine/stats.py), read under the lock: a step is never half-counted --
    def counters(self) -> EngineCounters:
        with self.lock:
            return self.engine.counters()

    def stats_snapshot(self, max_steps: int = 120) -> dict[str, Any]:
        with self.lock:
            return self.engine.stats_snapshot(max_steps)

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Called in the engine's thread after every step, with the lock held: keep it short."""
        with self.lock:
            self.engine.stats.listeners.append(listener)

    def remove_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        with self.lock:
            self.engine.stats.listeners.remove(listener)
