"""benchmarks/peers/issue_goals.py reads one run's result files into goal verdicts: a goal is met only
by the figures its issue names, and a goal without its files is "not measured", never met."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def _module():
    return importlib.import_module("benchmarks.peers.issue_goals")


def _write(folder: Path, name: str, data: dict) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_goal_verdicts_from_result_files(tmp_path):
    goals = _module().goals
    assert all(g.met is None for g in goals(tmp_path))  # nothing measured: nothing met

    ids = [[1, 2, 3]] * 4
    _write(tmp_path, "smollm2/llamacpp.json", {"tok_s": 100.0})
    _write(tmp_path, "smollm2/llmctl_q4_1.json", {"tok_s": 150.0})
    _write(tmp_path, "smollm2/llmctl_fp32.json", {"tok_s": 30.0})
    _write(tmp_path, "smollm2/hf_fp32.json", {"tok_s": 20.0})
    _write(tmp_path, "bench_int8.json", {"result": {"output_throughput": 290.0}})
    _write(tmp_path, "peer/vllm_float32.json", {"out_tok_s": 100.0, "out_ids": ids})
    _write(tmp_path, "peer/hf_float32.json", {"out_tok_s": 80.0, "out_ids": ids[:3] + [[9, 9, 9]]})
    _write(tmp_path, "peer/llmctl_float32.json", {"out_tok_s": 135.0, "out_ids": ids})
    _write(tmp_path, "peer/llmctl_nopreload_float32.json", {"out_tok_s": 128.0, "out_ids": ids})
    _write(
        tmp_path, "spec_ngram.json", {"plain_tok_s": 80, "spec_tok_s": 200, "speedup": 2.5, "identical_output": False}
    )
    _write(tmp_path, "bench_readme.json", {"result": {"duration_s": 12.0, "output_throughput": 600.0}})
    verdicts = {g.name: g for g in goals(tmp_path)}
    assert verdicts["SmolLM2 one stream: llmctl (same Q4_1 file) vs llama.cpp"].met is True
    assert verdicts["SmolLM2 64 concurrent (int8) vs 3x llama.cpp one stream"].met is False  # 290 < 300
    vs_vllm = verdicts["246M fp32, 64 x 128 -> 128: llmctl vs vLLM"]
    assert vs_vllm.met is False and "1.28x" in vs_vllm.measured  # the slower llmctl run decides
    vs_hf = verdicts["246M fp32: llmctl vs transformers"]
    assert vs_hf.met is True and "tokens equal 3/4" in vs_hf.measured
    assert verdicts["SmolLM2 one stream, fp32 weights: llmctl vs transformers"].met is False  # 1.5x < 2x
    assert verdicts["n-gram speculation on the edit workload (fp32 weights)"].met is False  # output differs
    assert verdicts["README main command (llmctl bench --concurrency 64): bench part"].met is True


def test_rounds_are_summarised_per_goal(tmp_path, capsys, monkeypatch):
    """ROUNDS=N: each round's verdicts, then per goal the rounds that met it and the median figure;
    a round without a goal's files counts as not measured, not as met."""
    module = _module()
    for round_, (int8, llama) in enumerate([(330.0, 100.0), (290.0, 100.0), (None, 100.0)], start=1):
        folder = tmp_path / f"round-{round_}"
        _write(folder, "smollm2/llamacpp.json", {"tok_s": llama})
        if int8 is not None:
            _write(folder, "bench_int8.json", {"result": {"output_throughput": int8}})
    tables = [module.goals(tmp_path / f"round-{r}") for r in (1, 2, 3)]
    summary = {s["name"]: s for s in module.rounds_summary(tables)}
    int8 = summary["SmolLM2 64 concurrent (int8) vs 3x llama.cpp one stream"]
    assert (int8["rounds"], int8["measured"], int8["met"]) == (3, 2, 1)
    assert int8["values"] == [1.1, 0.967] and int8["median"] == 1.033
    assert summary["SmolLM2 one stream: llmctl (same Q4_1 file) vs llama.cpp"]["measured"] == 0

    monkeypatch.setattr(sys, "argv", ["issue_goals.py", str(tmp_path), "--json", str(tmp_path / "goals.json")])
    module.main()
    printed = capsys.readouterr().out
    assert "round-3:" in printed and "met in 1 of 3 rounds" in printed
    report = json.loads((tmp_path / "goals.json").read_text())
    assert len(report["rounds"]) == 3 and report["summary"][1]["met"] == 1
