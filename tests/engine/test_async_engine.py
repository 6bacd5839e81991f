"""The engine loop in a thread with asyncio streams: concurrent streams, early close = abort."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import InvalidRequestError
from llmctl.sampling_params import SamplingParams

EXPECTED = ", there was a little girl named Lily. She loved to play outside in the park. One day,"


@pytest.fixture
def async_engine(stories_dir):
    engine = AsyncEngine(LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)).start()
    yield engine
    engine.shutdown()


def test_concurrent_streams_and_early_close(async_engine):
    async def consume(n_tokens: int | None):
        text = ""
        # A client that goes away asks for far more tokens than it reads: a fast engine must not
        # finish it before the close arrives (30 tokens of stories260k take ~25 ms).
        params = SamplingParams(
            temperature=0, max_tokens=30 if n_tokens is None else 400, ignore_eos=n_tokens is not None
        )
        gen = async_engine.generate("Once upon a time", params)
        async for out in gen:
            text += out.outputs[0].delta_text
            if n_tokens is not None and len(out.outputs[0].token_ids) >= n_tokens:
                await gen.aclose()  # the client went away
                break
        return text

    async def main():
        results = await asyncio.gather(*(consume(None if i % 2 else 3) for i in range(8)))
        return results

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i % 2:
            assert text == EXPECTED
        else:
            assert EXPECTED.startswith(text) and len(text) < len(EXPECTED)
    engine = async_engine.engine
    deadline = time.time() + 10  # aborts run in worker threads: give them a moment
    while time.time() < deadline and engine.stats.requests_finished["abort"] < 4:
        time.sleep(0.01)
    with async_engine.lock:
        assert not engine.requests
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats.requests_finished["abort"] == 4


def test_invalid_request_raises_immediately(async_engine):
    async def main():
        with pytest.raises(InvalidRequestError):
            async for _ in async_engine.generate("", SamplingParams()):
                pass

    asyncio.run(main())
    snapshot = async_engine.stats_snapshot()
    assert snapshot["kv"]["free"] == snapshot["kv"]["num_blocks"]


def test_fair_lock_serves_a_waiter_before_the_holder_takes_it_again():
    """The engine loop's pattern: release after a step and take the lock again at once. A thread
    that asked in between must get it first (a plain Lock lets the loop win again and again)."""
    from llmctl.engine.async_engine import FairLock

    lock, order = FairLock(), []
    stop = threading.Event()

    def busy_loop() -> None:
        while not stop.is_set():
            with lock:
                order.append("loop")
                time.sleep(0.002)  # a step

    loop_thread = threading.Thread(target=busy_loop)
    loop_thread.start()
    time.sleep(0.02)
    waiters = []
    for i in range(3):

        def waiter(i: int = i) -> None:
            with lock:
                order.append(f"waiter{i}")

        t = threading.Thread(target=waiter)
        t.start()
        waiters.append(t)
        time.sleep(0.001)
    for t in waiters:
        t.join(timeout=5)
        assert not t.is_alive()
    stop.set()
    loop_thread.join(timeout=5)
    first = order.index("waiter0")
    # every waiter got in within two of the loop's steps of the one before it
    assert [name for name in order if name.startswith("waiter")] == ["waiter0", "waiter1", "waiter2"]
    assert order.index("waiter2") - first <= 2 + 2 * 2


def test_abort_is_served_promptly_while_the_loop_is_busy(async_engine):
    """Aborts (a closed stream, a cancelled request) wait at most about a step for the lock
    while the loop keeps stepping a long generation."""
    engine = async_engine.engine
    steps = []
    async_engine.add_step_listener(lambda stats: steps.append(1))

    async def main():
        gen = async_engine.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
        other = async_engine.generate(
            "Once upon a time", SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
        )
        await gen.__anext__()
        first = await other.__anext__()

        def abort_counting_steps() -> tuple[bool, int]:
            # counted from the moment the abort asks for the lock, in its own thread: how long the
            # worker thread took to start on a loaded machine is not the lock's doing
            before = len(steps)
            return async_engine.abort(first.request_id), len(steps) - before

        aborted, waited = await asyncio.to_thread(abort_counting_steps)
        await gen.aclose()
        await other.aclose()
        return aborted, waited

    aborted, waited = asyncio.run(main())
    assert aborted
    assert waited <= 3, f"the abort waited {waited} engine steps for the lock"
    deadline = time.time() + 10
    while time.time() < deadline and engine.requests:
        time.sleep(0.01)
    with async_engine.lock:
        assert not engine.requests
