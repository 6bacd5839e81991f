"""A synthetic load for ``llmctl top --local``: enough variety that every colour of the block map
and every request state shows up with nothing else running.

The mix: several users, three of them sharing long system prompts (their full blocks are found in
the prefix cache and shared while several such requests run), long documents (prefill-heavy,
many blocks), short one-liners, ``n > 1`` sampling (forked sequences share their prompt blocks),
continuous Poisson arrivals with bursts (so requests wait and, when the pool runs dry, are
preempted), and a few clients that hang up mid-stream (aborts).
"""

from __future__ import annotations

import asyncio
import random
from contextlib import aclosing
from dataclasses import dataclass, field

from llmctl.engine.async_engine import AsyncEngine
from llmctl.errors import InvalidRequestError
from llmctl.sampling_params import SamplingParams

SYSTEM_PROMPTS = {
    "support": (
        "You are the support assistant of a small bakery that delivers bread, cakes and pastries in "
        "the city. Answer politely and briefly, in plain words. Never promise a delivery time you "
        "cannot keep, always offer a refund when an order arrived damaged, and remind customers that "
        "orders placed before noon are delivered the same day."
    ),
    "tutor": (
        "You are a patient tutor for children who are learning to read. Use short sentences and "
        "simple words, explain every new word with an example, ask one question at the end of each "
        "answer, and praise the child for trying. Stories about dragons, rivers, trains, gardens "
        "and the moon are the favourites."
    ),
    "coder": (
        "You are a senior engineer reviewing code for an inference engine with a paged key value "
        "cache, continuous batching and prefix caching. Point out bugs first, then performance "
        "problems, then style. Quote the line you talk about and suggest the smallest change that "
        "fixes it. Be direct and kind."
    ),
}
USERS = {"alice": "support", "bob": "support", "carol": "tutor", "dave": "coder", "erin": "coder", "frank": None}
WORDS = (
    "engine story memory page token step pool river train garden moon dragon bread cake order "
    "refund delivery child word question answer cache block batch prefix kernel review bug line "
    "change quickly slowly small large shared waiting running again today tomorrow why how what"
).split()


@dataclass
class RequestSpec:
    kind: str  # "chat" | "document" | "short"
    user: str
    prompt: str
    params: SamplingParams
    hang_up_after: int | None = None  # the client closes the stream after this many tokens


@dataclass
class LoadProfile:
    rate: float = 4.0  # mean arrivals per second
    max_in_flight: int = 64  # the generator stops adding requests beyond this many
    burst_probability: float = 0.04  # an arrival brings a burst of ``burst_size`` requests
    burst_size: int = 10
    seed: int = 0
    users: dict[str, str | None] = field(default_factory=lambda: dict(USERS))


class RequestMix:
    """Draws the next request of the mix (deterministic for a seed)."""

    def __init__(self, profile: LoadProfile) -> None:
        self.profile = profile
        self.rng = random.Random(profile.seed)

    def _words(self, low: int, high: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(low, high)))

    def next_request(self) -> RequestSpec:
        rng = self.rng
        user = rng.choice(list(self.profile.users))
        team = self.profile.users[user]
        draw = rng.random()
        n = 1
        if team is not None and draw < 0.6:
            kind = "chat"
            prompt = f"{SYSTEM_PROMPTS[team]}\nUser: {self._words(4, 20)}?\nAssistant:"
            max_tokens = rng.randint(16, 96)
            n = rng.choice((1, 1, 1, 1, 2, 3))
        elif draw < 0.8:
            kind = "document"
            prompt = f"Summarise this document. {self._words(120, 360)}."
            max_tokens = rng.randint(32, 160)
        else:
            kind = "short"
            prompt = self._words(3, 8)
            max_tokens = rng.randint(4, 24)
        params = SamplingParams(
            n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=rng.randrange(1 << 30)
        )
        hang_up = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < 0.03 else None
        return RequestSpec(kind, user, prompt, params, hang_up)


class SyntheticLoad:
    """Sends the mix to an ``AsyncEngine`` from the running event loop until stopped."""

    def __init__(self, engine: AsyncEngine, profile: LoadProfile | None = None) -> None:
        self.engine = engine
        self.profile = profile or LoadProfile()
        self.mix = RequestMix(self.profile)
        self.sent = self.completed = self.rejected = 0
        self._clients: set[asyncio.Task] = set()

    async def run(self) -> None:
        rng = self.mix.rng
        while True:
            await asyncio.sleep(rng.expovariate(self.profile.rate))
            count = self.profile.burst_size if rng.random() < self.profile.burst_probability else 1
            for _ in range(count):
                if len(self._clients) >= self.profile.max_in_flight:
                    break
                task = asyncio.create_task(self._client(self.mix.next_request()))
                self._clients.add(task)
                task.add_done_callback(self._clients.discard)

    async def _client(self, spec: RequestSpec) -> None:
        self.sent += 1
        final = None
        try:
            stream = self.engine.generate(spec.prompt, spec.params, user=spec.user)
            async with aclosing(stream):  # an early exit aborts the request
                async for out in stream:
                    final = out
                    if spec.hang_up_after is not None and len(out.outputs[0].token_ids) >= spec.hang_up_after:
                        return
        except InvalidRequestError:
            self.rejected += 1
            return
        if final is not None and final.finished:
            self.completed += 1

    async def stop(self) -> None:
        """Hang up every client (their requests are aborted) and wait for them."""
        for task in list(self._clients):
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
