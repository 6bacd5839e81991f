"""Prefix keys, the hash ring, affinity, bounded load and round-robin, without any server."""

from __future__ import annotations

from collections import Counter

import pytest

from llmctl.router.policy import HashRing, PrefixAwarePolicy, RoundRobinPolicy, make_policy
from llmctl.router.prefix import prefix_key, routing_bytes
from llmctl.router.replicas import Replica

SYSTEM = "You are a careful assistant who answers in one sentence. " * 6  # 342 bytes: 5 full chunks


def _replicas(n: int = 3) -> list[Replica]:
    return [Replica(f"http://10.0.0.{i}:8000", healthy=True) for i in range(n)]


def _chat(system: str, question: str) -> bytes:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return routing_bytes("/v1/chat/completions", body)


def test_chunk_hashes_chain_so_a_shared_prefix_shares_its_leading_hashes():
    a = prefix_key(_chat(SYSTEM, "What is a KV block? " * 4))
    b = prefix_key(_chat(SYSTEM, "Why page the cache? " * 4))
    shared = len(SYSTEM) // 64  # chunks wholly inside the system message
    assert a.chain[:shared] == b.chain[:shared]
    assert a.chain[-1] != b.chain[-1]
    assert a.ring_key == b.ring_key  # the first four chunks are the system prompt's
    other = prefix_key(_chat(SYSTEM.replace("careful", "cheerful"), "What is a KV block?"))
    assert not set(other.chain) & set(a.chain)  # a change in chunk 0 changes every hash after it


def test_short_prompt_has_no_chain_but_a_ring_key():
    key = prefix_key(b"hi")
    assert key.chain == () and key.ring_key == prefix_key(b"hi").ring_key != prefix_key(b"ho").ring_key


def test_routing_bytes_of_each_request_shape():
    assert routing_bytes("/v1/completions", {"prompt": "Once"}) == b"Once"
    assert routing_bytes("/v1/completions", {"prompt": ["Once", "Twice"]}) == b"Once"
    tokens = routing_bytes("/v1/completions", {"prompt": [1, 2]})
    assert tokens == routing_bytes("/v1/completions", {"prompt": [[1, 2]]})
    assert tokens != routing_bytes("/v1/completions", {"prompt": [1, 3]})
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert routing_bytes("/v1/chat/completions", parts) == routing_bytes(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    )
    for malformed in (None, [], {"prompt": 3}, {"messages": "x"}):
        assert routing_bytes("/v1/chat/completions", malformed) in (b"",)


def test_ring_moves_only_the_keys_of_a_replica_that_leaves():
    urls = [r.url for r in _replicas(4)]
    ring = HashRing(urls)
    keys = [prefix_key(f"prompt number {i}".encode() * 8).ring_key for i in range(400)]
    before = {k: ring.owner(k, set(urls)) for k in keys}
    assert set(Counter(before.values())) == set(urls) and min(Counter(before.values()).values()) > 50
    after = {k: ring.owner(k, set(urls[1:])) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == urls[0] for k in moved)


def test_same_prefix_goes_to_the_same_replica_and_prefixes_spread():
    policy = PrefixAwarePolicy()
    replicas = _replicas()
    urls = [r.url for r in replicas]
    homes = {}
    for s in range(24):
        system = f"System prompt {s}: " + "be brief and exact. " * 8
        chosen = {
            policy.choose(prefix_key(_chat(system, f"question {q}")), replicas, urls, 0).replica.url for q in range(5)
        }
        assert len(chosen) == 1  # nothing in flight: never over the bound
        homes[s] = chosen.pop()
    assert len(set(homes.values())) == 3


def test_affinity_follows_a_short_shared_prefix_that_the_ring_key_does_not_cover():
    """A system prompt of two chunks, then different questions: the ring key (four chunks) differs
    per question, the remembered two-chunk prefix does not."""
    policy = PrefixAwarePolicy()
    replicas = _replicas()
    urls = [r.url for r in replicas]
    system = "x" * 128
    first = policy.choose(prefix_key(_chat(system, "a" * 300)), replicas, urls, 0)
    reasons = set()
    for q in "bcdefgh":
        choice = policy.choose(prefix_key(_chat(system, q * 300)), replicas, urls, 0)
        assert choice.replica is first.replica
        reasons.add(choice.reason)
    assert first.reason == "ring" and reasons == {"affinity"}


def test_bounded_load_spills_a_hot_prefix_to_the_least_loaded_replica():
    policy = PrefixAwarePolicy(load_factor=1.25)
    replicas = _replicas()
    urls = [r.url for r in replicas]
    key = prefix_key(_chat(SYSTEM, "hot question"))
    home = policy.choose(key, replicas, urls, 0).replica
    home.in_flight = 3  # 3 in flight in all: the bound is ceil(1.25 * 4 / 3) = 2
    spill = policy.choose(key, replicas, urls, 0)
    assert spill.reason == "least_loaded" and spill.replica is not home and spill.replica.in_flight == 0
    home.in_flight = 1  # over the bound (ceil(1.25 * 2 / 3) = 1) but within the spread of the others
    assert policy.choose(key, replicas, urls, 0).replica is home  # the prefix did not move


def test_a_prefix_whose_replica_is_gone_finds_a_new_home():
    policy = PrefixAwarePolicy()
    replicas = _replicas()
    urls = [r.url for r in replicas]
    key = prefix_key(_chat(SYSTEM, "q"))
    home = policy.choose(key, replicas, urls, 0).replica
    rest = [r for r in replicas if r is not home]
    new_home = policy.choose(key, rest, urls, 0).replica
    assert new_home in rest and policy.choose(key, rest, urls, 0).replica is new_home


def test_affinity_table_is_bounded():
    policy = PrefixAwarePolicy(table_size=50)
    replicas = _replicas()
    for i in range(40):
        policy.choose(prefix_key(f"{i:04d}".encode() * 64), replicas, [r.url for r in replicas], 0)
    assert len(policy._affinity) == 50


def test_round_robin_cycles_over_healthy_replicas():
    policy = RoundRobinPolicy()
    replicas = _replicas()
    key = prefix_key(b"same prompt" * 10)
    picks = [policy.choose(key, replicas, [], 0).replica.url for _ in range(6)]
    assert picks == sorted(r.url for r in replicas) * 2


def test_make_policy_rejects_unknown_names_and_bad_load_factors():
    with pytest.raises(ValueError, match="unknown --policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="at least 1"):
        make_policy("prefix", load_factor=0.5)


def test_router_command_is_registered_and_refuses_bad_replica_flags():
    from typer.testing import CliRunner

    from llmctl.cli import app

    runner = CliRunner()
    assert "router" in runner.invoke(app, ["--help"]).output
    no_replicas = runner.invoke(app, ["router"], env={"LLMCTL_ROUTER_REPLICAS": ""})
    assert no_replicas.exit_code == 1 and "--replica URL" in no_replicas.output
    not_a_url = runner.invoke(app, ["router", "--replica", "10.0.0.7:8000"])
    assert not_a_url.exit_code == 1 and "http://" in not_a_url.output
    bad_discover = runner.invoke(app, ["router", "--discover", "llmctl-headless"])
    assert bad_discover.exit_code == 1 and "NAME:PORT" in bad_discover.output
    bad_policy = runner.invoke(app, ["router", "--replica", "http://127.0.0.1:1", "--policy", "random"])
    assert bad_policy.exit_code == 1 and "unknown --policy" in bad_policy.output
