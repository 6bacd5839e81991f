"""``llmctl serve --tensor-parallel-size 2``: the one command starts two ranks through torchrun,
passes the official ``openai`` client's completion tests (the same test functions as the
single-process server, against this server), stops every rank on SIGTERM, and exits non-zero within
seconds, naming the rank, when a rank dies."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from server_helpers import API_KEY, ServerProcess, wait_until
from test_server_openai_client import (  # noqa: F401  (collected again, against the TP=2 server)
    client,
    test_cached_prompt_tokens_are_reported,
    test_chat_on_a_base_model_is_a_clear_400,
    test_default_max_tokens_is_16_and_token_prompts_work,
    test_greedy_completion_is_the_reference_story,
    test_logprobs_in_the_completions_format,
    test_models_lists_the_served_name,
    test_n_and_seed_are_reproducible,
    test_several_prompts_and_echo,
    test_stop_strings_end_the_text_before_them,
    test_streamed_completion_arrives_token_by_token,
)

TP_FLAGS = (
    "--tensor-parallel-size",
    "2",
    "--api-key",
    API_KEY,
    "--kv-cache-memory",
    "64MiB",
    "--served-model-name",
    "stories",
)
EXIT_WITHIN_S = 30  # the agent notices a dead rank in 0.1 s; the rest is process teardown on a busy CI box


def children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; torchrun starts ranks in their own sessions)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent_of[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        kids = [p for p, ppid in parent_of.items() if ppid == current]
        found += kids
        frontier += kids
    return found


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


@pytest.fixture(scope="module")
def stories_server(start_server, stories_dir) -> ServerProcess:
    """Overrides the conftest's single-process server for the imported tests."""
    return start_server(str(stories_dir), *TP_FLAGS)


def test_two_ranks_run_and_sigterm_stops_them_all(stories_server):
    ranks = wait_until(
        lambda: (
            [p for p in children(stories_server.proc.pid) if rank_of(p) is not None]
            if len([p for p in children(stories_server.proc.pid) if rank_of(p) is not None]) >= 2
            else None
        ),
        timeout=10,
    )
    assert sorted(rank_of(p) for p in ranks) == [0, 1]
    descendants = children(stories_server.proc.pid)
    started = time.monotonic()
    code = stories_server.terminate(timeout=EXIT_WITHIN_S)
    assert time.monotonic() - started < EXIT_WITHIN_S
    assert code == 128 + signal.SIGTERM
    assert "llmctl: SIGTERM received; every rank was stopped" in stories_server.log()
    wait_until(lambda: not alive(descendants), timeout=10)


def test_a_killed_rank_stops_the_server_naming_it(start_server, stories_dir):
    server = start_server(str(stories_dir), *TP_FLAGS)
    descendants = children(server.proc.pid)
    worker = next(p for p in descendants if rank_of(p) == 1)
    started = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    code = server.proc.wait(timeout=EXIT_WITHIN_S)
    assert code != 0
    assert time.monotonic() - started < EXIT_WITHIN_S
    assert "llmctl: rank 1 failed first (signal SIGKILL" in server.log(), server.log()
    wait_until(lambda: not alive(descendants), timeout=10)
