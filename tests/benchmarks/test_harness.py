"""benchmarks/harness.py records every result the same way: the CPU as the engine's own probe sees it (also in a
peer's interpreter without llmctl), the least of several timed calls, and JSON whose printed line leaves out the
bulky fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import harness
from llmctl_kernels.cpu_features import cpu_flags, cpu_model

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_record_is_the_engines_probe():
    record = harness.cpu_record()
    assert record["cpu"] == cpu_model()
    assert record["isa"].split() == [f for f in harness.ISA_FLAGS if f in cpu_flags()]
    assert record["cpu"] in harness.cpu_line() and record["isa"] in harness.cpu_line()


def test_cpu_record_without_llmctl_installed():
    """A peer's interpreter (llama-cpp-python) has no llmctl_kernels: the checkout's file answers the same."""
    code = "import sys, json; sys.modules['llmctl_kernels'] = None; from benchmarks import harness; "
    code += "print(json.dumps(harness.cpu_record()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == harness.cpu_record()


def test_best_of_warms_up_then_keeps_the_least(monkeypatch):
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 23.0])  # calls of 5, 2 and 3 seconds
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
    calls = []
    assert harness.best_of(lambda: calls.append(1), reps=3, warmup=2) == 2.0
    assert len(calls) == 5


def test_write_result_keeps_everything_in_the_file_and_prints_one_short_line(tmp_path, capsys):
    result = {"tok_s": 12.5, "out_ids": [[1, 2, 3]], "text": "long"}
    harness.write_result(result, tmp_path / "r.json", hidden=("out_ids", "text"))
    assert json.loads((tmp_path / "r.json").read_text()) == result
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("RESULT ") and json.loads(line.removeprefix("RESULT ")) == {"tok_s": 12.5}
