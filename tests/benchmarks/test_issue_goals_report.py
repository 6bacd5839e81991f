"""benchmarks/peers/issue_goals.py decides which speed goals a benchmark run met: it must compare the
slower of llmctl's runs, never call a goal met whose files are missing, and report the AMX (bf16)
goal only where that run happened."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def issue_goals():
    return importlib.import_module("benchmarks.peers.issue_goals")


def _write(folder: Path, name: str, data: dict) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _peer_run(folder: Path, dtype: str, vllm: float, llmctl: float, plain: float, hf: float = 100.0) -> None:
    _write(folder, f"peer/vllm_{dtype}.json", {"out_tok_s": vllm, "out_ids": [[1, 2], [3, 4]]})
    _write(folder, f"peer/hf_{dtype}.json", {"out_tok_s": hf, "out_ids": [[1, 2], [3, 4]]})
    _write(folder, f"peer/llmctl_{dtype}.json", {"out_tok_s": llmctl, "out_ids": [[1, 2], [3, 5]]})
    _write(folder, f"peer/llmctl_nopreload_{dtype}.json", {"out_tok_s": plain, "out_ids": [[1, 2], [3, 5]]})


def _by_name(table, fragment: str):
    found = [g for g in table if fragment in g.name]
    assert len(found) == 1, [g.name for g in table]
    return found[0]


def test_missing_files_are_not_measured_never_met(issue_goals, tmp_path):
    table = issue_goals.goals(tmp_path)
    assert table and all(g.met is None for g in table)
    assert not any("AMX" in g.name or "bf16" in g.name for g in table)


def test_bf16_one_stream_row_where_measured(issue_goals, tmp_path):
    """The issue allows fp32 or bf16 weights for SmolLM2's one stream: the bf16 row appears once
    the comparison ran it (CPUs with native bf16), against transformers in bf16; fp32's stays."""
    _write(tmp_path, "smollm2/llmctl_bf16.json", {"tok_s": 47.9})
    table = issue_goals.goals(tmp_path)
    assert _by_name(table, "bf16 weights").met is None  # transformers' run missing: not measured
    _write(tmp_path, "smollm2/hf_bf16.json", {"tok_s": 23.1})
    table = issue_goals.goals(tmp_path)
    goal = _by_name(table, "bf16 weights")
    assert goal.met is True and goal.value == pytest.approx(47.9 / 23.1)
    assert _by_name(table, "fp32 weights").met is None


def test_vllm_goal_uses_the_slower_llmctl_run(issue_goals, tmp_path):
    _peer_run(tmp_path, "float32", vllm=100.0, llmctl=140.0, plain=125.0)
    goal = _by_name(issue_goals.goals(tmp_path), "246M fp32, 64 x 128")
    assert goal.value == pytest.approx(1.25) and goal.met is False
    assert "tokens equal 1/2" in goal.measured


def test_amx_goal_appears_only_with_the_bf16_run(issue_goals, tmp_path):
    _peer_run(tmp_path, "float32", vllm=100.0, llmctl=140.0, plain=135.0)
    assert not any("AMX" in g.name for g in issue_goals.goals(tmp_path))
    _peer_run(tmp_path, "bfloat16", vllm=400.0, llmctl=520.0, plain=508.0)
    goal = _by_name(issue_goals.goals(tmp_path), "AMX")
    assert goal.value == pytest.approx(1.27) and goal.met is True
    _peer_run(tmp_path, "bfloat16", vllm=400.0, llmctl=520.0, plain=500.0)
    goal = _by_name(issue_goals.goals(tmp_path), "AMX")
    assert goal.value == pytest.approx(1.25) and goal.met is False


def test_rounds_summary_counts_met_rounds_and_median(issue_goals, tmp_path):
    tables = []
    for ratio in (1.2, 1.35, 1.4):
        folder = tmp_path / f"r{ratio}"
        _peer_run(folder, "float32", vllm=100.0, llmctl=100.0 * ratio, plain=100.0 * ratio)
        tables.append(issue_goals.goals(folder))
    row = next(s for s in issue_goals.rounds_summary(tables) if s["name"].startswith("246M fp32, 64"))
    assert (row["measured"], row["met"], row["median"]) == (3, 2, 1.35)
