"""Which replica gets a request: prefix-aware (the default) or round-robin (the baseline).

Prefix-aware routing, in order:

1. **Affinity.** The router remembers, for every chunk-hash chain it has routed (a bounded LRU
   table), the replica it went to. A request goes where its longest remembered prefix went: that
   replica holds the prefix's KV blocks in its prefix cache.
2. **Consistent hashing.** A prefix never seen goes to the replica its ``ring_key`` (the hash of
   its first few chunks) lands on, on a ring with ``VNODES`` points per replica. When a replica
   joins or leaves, only the prefixes on its arcs move.
3. **Bounded load.** Either choice is taken while that replica carries fewer than
   ``ceil(load_factor * (in-flight + 1) / replicas)`` of this router's requests (consistent
   hashing with bounded loads, Mirrokni et al. 2018), or no more than ``MIN_SPREAD - 1`` above
   the least loaded one; beyond both the request goes to the least loaded replica, so a hot
   prefix spills over instead of queueing behind itself. The spread keeps a lightly loaded
   router from scattering prefixes: at 1 request in flight the bound alone would already call
   its replica full, although a batching server takes dozens at no cost.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from llmctl.router.prefix import PrefixKey
from llmctl.router.replicas import Replica

VNODES = 64
DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_TABLE_SIZE = 65536
MIN_SPREAD = 2


@dataclass(frozen=True)
class Choice:
    replica: Replica
    reason: str  # "affinity" | "ring" | "least_loaded" | "round_robin": a metric label


class HashRing:
    """Replica URLs at ``VNODES`` pseudo-random points each; a key belongs to the next point."""

    def __init__(self, urls: Sequence[str]) -> None:
        points = sorted((_point(f"{url}#{i}"), url) for url in urls for i in range(VNODES))
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]

    def owner(self, key: int, allowed: set[str]) -> str | None:
        """The first URL in ``allowed`` clockwise from ``key``."""
        if not self._urls:
            return None
        start = bisect.bisect(self._hashes, key)
        for offset in range(len(self._urls)):
            url = self._urls[(start + offset) % len(self._urls)]
            if url in allowed:
                return url
        return None


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def least_loaded(candidates: Sequence[Replica]) -> Replica:
    return min(candidates, key=lambda r: (r.in_flight, r.url))


class PrefixAwarePolicy:
    name = "prefix"

    def __init__(self, *, load_factor: float = DEFAULT_LOAD_FACTOR, table_size: int = DEFAULT_TABLE_SIZE) -> None:
        if load_factor < 1:
            raise ValueError("--load-factor must be at least 1")
        self.load_factor = load_factor
        self.table_size = table_size
        self._affinity: OrderedDict[int, str] = OrderedDict()
        self._ring = HashRing([])
        self._ring_generation = -1

    def choose(self, key: PrefixKey, candidates: Sequence[Replica], members: Sequence[str], generation: int) -> Choice:
        """``candidates``: healthy replicas not yet tried for this request (not empty)."""
        if generation != self._ring_generation:
            self._ring, self._ring_generation = HashRing(members), generation
        by_url = {r.url: r for r in candidates}
        preferred, reason = self._remembered(key, by_url), "affinity"
        if preferred is None:
            owner = self._ring.owner(key.ring_key, set(by_url))
            preferred, reason = (by_url[owner] if owner else None), "ring"
        if preferred is None or self._overloaded(preferred, candidates):
            preferred, reason = least_loaded(candidates), "least_loaded"
        self._remember(key, preferred.url, by_url)
        return Choice(preferred, reason)

    def _overloaded(self, replica: Replica, candidates: Sequence[Replica]) -> bool:
        total = sum(r.in_flight for r in candidates)
        bound = math.ceil(self.load_factor * (total + 1) / len(candidates))
        return replica.in_flight >= bound and replica.in_flight >= least_loaded(candidates).in_flight + MIN_SPREAD

    def _remembered(self, key: PrefixKey, by_url: dict[str, Replica]) -> Replica | None:
        for chain_hash in reversed(key.chain):
            url = self._affinity.get(chain_hash)
            if url in by_url:
                self._affinity.move_to_end(chain_hash)
                return by_url[url]
        return None

    def _remember(self, key: PrefixKey, url: str, available: dict[str, Replica]) -> None:
        """Record the chains that have no live home yet; a spilled request does not steal a
        prefix from the replica that already caches it."""
        for chain_hash in key.chain:
            if self._affinity.get(chain_hash) not in available:
                self._affinity[chain_hash] = url
            self._affinity.move_to_end(chain_hash)
        while len(self._affinity) > self.table_size:
            self._affinity.popitem(last=False)


class RoundRobinPolicy:
    """The baseline the benchmark and the tests compare against: each healthy replica in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, key: PrefixKey, candidates: Sequence[Replica], members: Sequence[str], generation: int) -> Choice:
        ordered = sorted(candidates, key=lambda r: r.url)
        return Choice(ordered[next(self._counter) % len(ordered)], "round_robin")


Policy = PrefixAwarePolicy | RoundRobinPolicy


def make_policy(name: str, *, load_factor: float = DEFAULT_LOAD_FACTOR) -> Policy:
    if name == "prefix":
        return PrefixAwarePolicy(load_factor=load_factor)
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown --policy {name!r} (prefix, round-robin)")
