"""Step outputs reach the event loop in one delivery per step, none while one is pending, in order;
a compute team resized mid-stream changes no token."""

from __future__ import annotations

import asyncio
import threading

import torch

from llmctl.engine.async_engine import AsyncEngine, Mailbox
from llmctl.engine.compute_team import ComputeTeam
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams


class CountingLoop:
    """An event loop stand-in that records what would be scheduled on it."""

    def __init__(self, closed: bool = False) -> None:
        self.callbacks: list = []
        self.closed = closed

    def call_soon_threadsafe(self, callback) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.callbacks.append(callback)


class ListQueue:
    def __init__(self) -> None:
        self.items: list = []

    def put_nowait(self, item) -> None:
        self.items.append(item)


def test_one_wake_up_while_a_delivery_is_pending():
    loop, first, second = CountingLoop(), ListQueue(), ListQueue()
    mailbox = Mailbox(loop)
    mailbox.post([(first, 1), (second, "a")])
    mailbox.post([(first, 2)])  # the loop has not run the delivery yet: no second wake-up
    mailbox.post([(first, 3), (second, "b")])
    assert len(loop.callbacks) == 1
    loop.callbacks.pop()()
    assert first.items == [1, 2, 3] and second.items == ["a", "b"]
    mailbox.post([(first, 4)])  # delivered: the next post wakes the loop again
    assert len(loop.callbacks) == 1
    loop.callbacks.pop()()
    assert first.items == [1, 2, 3, 4]


def test_a_closed_loop_drops_its_outputs_without_raising():
    loop, queue = CountingLoop(closed=True), ListQueue()
    mailbox = Mailbox(loop)
    mailbox.post([(queue, 1)])
    loop.closed = False
    mailbox.post([(queue, 2)])  # not stuck as "scheduled" after the failed wake-up
    loop.callbacks.pop()()
    assert queue.items == [2]


def test_posts_from_another_thread_arrive_in_order():
    async def main() -> list[int]:
        queue: asyncio.Queue = asyncio.Queue()
        mailbox = Mailbox(asyncio.get_running_loop())

        def producer() -> None:
            for i in range(2000):
                mailbox.post([(queue, i)])

        thread = threading.Thread(target=producer)
        thread.start()
        got = [await queue.get() for _ in range(2000)]
        thread.join()
        return got

    assert asyncio.run(main()) == list(range(2000))


def test_streams_match_the_engine_with_a_team_resized_every_step(stories_dir):
    """Eight concurrent greedy streams through the loop thread, the compute team switching between
    one and two threads on every decode step: each stream's deltas, in order, add up to what
    ``LLMEngine.generate`` gives, and every block comes back."""
    prompts = [
        "Once upon a time",
        "The cat",
        "Lily and Tom went",
        "One day, a big",
        "The sun",
        "A dog",
        "Mom said",
        "Ben",
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = {
        p: out.outputs[0].token_ids
        for p, out in zip(prompts, LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20).generate(prompts, params))
    }

    sizes: list[int] = []

    class FlippingTeam(ComputeTeam):
        def on_decode_step(self, rows: int, seconds: float) -> None:
            self._resize(1 if self.size == 2 else 2)

    team = FlippingTeam(2, lambda n: (sizes.append(n), torch.set_num_threads(n)), cpus=2)
    engine = AsyncEngine(LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20), compute_team=team).start()

    async def stream(prompt: str) -> tuple[list[int], int]:
        ids: list[int] = []
        outputs = 0
        async for out in engine.generate(prompt, params):
            ids += out.outputs[0].delta_token_ids
            outputs += 1
            assert out.outputs[0].token_ids == ids  # deltas in order, none lost or repeated
        return ids, outputs

    async def main() -> list[tuple[list[int], int]]:
        return await asyncio.gather(*(stream(p) for p in prompts))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    torch.set_num_threads(2)
    for prompt, (ids, outputs) in zip(prompts, results):
        assert ids == expected[prompt]
        assert outputs == 24  # one output per step, each delivered, none merged away
    assert len(sizes) > 20 and set(sizes) == {1, 2}
    blocks = engine.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    assert team not in engine.engine.stats.listeners


def test_a_cpu_engine_gets_a_team_of_the_threads_asked_for(stories_dir):
    engine = LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)
    threads = torch.get_num_threads()
    async_engine = AsyncEngine(engine).start()
    try:
        team = async_engine.compute_team
        assert isinstance(team, ComputeTeam) and team.limit == threads
        assert team in engine.stats.listeners
    finally:
        async_engine.shutdown()
    assert team not in engine.stats.listeners and team.size == threads
    assert AsyncEngine(engine, compute_team=None).compute_team is None
