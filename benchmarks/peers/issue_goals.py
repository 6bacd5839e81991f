"""The speed goals of docs/benchmarks.md, read from the result files one run of benchmarks/peers/issue_goals.sh
wrote into one folder: a table of goal, measured value and met or not, with the CPU it ran on.

    python -m benchmarks.peers.issue_goals RESULTS_DIR [--json OUT]

Each goal is stated as its issue states it ("Done when"); a goal whose files are missing is shown
as not measured, never as met. A folder of rounds (``round-1``, ``round-2``, ... from
``ROUNDS=N benchmarks/peers/issue_goals.sh``) gives each round's table, then per goal the rounds that met
it and the median of its figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.harness import cpu_line


@dataclass
class Goal:
    issue: int
    name: str
    measured: str
    goal: str
    met: bool | None  # None: not measured
    value: float | None = None  # the figure the goal compares (a ratio, a fraction of the goal, seconds)


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _same_tokens(a: dict | None, b: dict | None) -> str:
    if not a or not b or "out_ids" not in a or "out_ids" not in b:
        return "?"
    pairs = list(zip(a["out_ids"], b["out_ids"]))
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


def _ratio_goal(issue: int, name: str, ours: dict | None, theirs: dict | None, at_least: float) -> Goal:
    """One stream's tok/s against a peer's, as a multiple."""
    if not ours or not theirs:
        return Goal(issue, name, "not measured", f">= {at_least:g}x", None)
    ratio = ours["tok_s"] / theirs["tok_s"]
    return Goal(
        issue,
        name,
        f"{ours['tok_s']:.1f} vs {theirs['tok_s']:.1f} tok/s = {ratio:.2f}x",
        f">= {at_least:g}x",
        ratio >= at_least,
        ratio,
    )


def goals(folder: Path) -> list[Goal]:
    out: list[Goal] = []
    llama, q41 = _load(folder, "smollm2/llamacpp.json"), _load(folder, "smollm2/llmctl_q4_1.json")
    fp32_one, hf_one = _load(folder, "smollm2/llmctl_fp32.json"), _load(folder, "smollm2/hf_fp32.json")
    int8_64 = _load(folder, "bench_int8.json")
    vllm, hf = _load(folder, "peer/vllm_float32.json"), _load(folder, "peer/hf_float32.json")
    ours = [_load(folder, f"peer/{name}_float32.json") for name in ("llmctl", "llmctl_nopreload")]
    spec, readme = _load(folder, "spec_ngram.json"), _load(folder, "bench_readme.json")

    out.append(_ratio_goal(12, "SmolLM2 one stream: llmctl (same Q4_1 file) vs llama.cpp", q41, llama, 1))
    if llama and int8_64:
        got = int8_64["result"]["output_throughput"]
        out.append(
            Goal(
                12,
                "SmolLM2 64 concurrent (int8) vs 3x llama.cpp one stream",
                f"{got:.1f} vs {3 * llama['tok_s']:.1f} tok/s = {got / (3 * llama['tok_s']):.2f} of it",
                ">= 1 of it",
                got >= 3 * llama["tok_s"],
                got / (3 * llama["tok_s"]),
            )
        )
    else:
        out.append(Goal(12, "SmolLM2 64 concurrent vs 3x llama.cpp", "not measured", ">= 1 of it", None))
    if vllm and hf and any(ours):
        slower = min((o for o in ours if o), key=lambda o: o["out_tok_s"])  # the slower of llmctl's two runs
        figures = " / ".join(f"{o['out_tok_s']:.1f}" for o in ours if o)
        out.append(
            Goal(
                16,
                "246M fp32, 64 x 128 -> 128: llmctl vs vLLM",
                f"{figures} vs {vllm['out_tok_s']:.1f} tok/s = {slower['out_tok_s'] / vllm['out_tok_s']:.2f}x "
                f"(tokens equal {_same_tokens(slower, vllm)})",
                ">= 1.3x",
                slower["out_tok_s"] >= 1.3 * vllm["out_tok_s"],
                slower["out_tok_s"] / vllm["out_tok_s"],
            )
        )
        out.append(
            Goal(
                16,
                "246M fp32: llmctl vs transformers",
                f"{slower['out_tok_s']:.1f} vs {hf['out_tok_s']:.1f} tok/s = "
                f"{slower['out_tok_s'] / hf['out_tok_s']:.2f}x "
                f"(tokens equal {_same_tokens(slower, hf)})",
                ">= 1.5x",
                slower["out_tok_s"] >= 1.5 * hf["out_tok_s"],
                slower["out_tok_s"] / hf["out_tok_s"],
            )
        )
    else:
        out.append(Goal(16, "246M fp32 vs vLLM and transformers", "not measured", ">= 1.3x, >= 1.5x", None))
    vllm_bf16 = _load(folder, "peer/vllm_bfloat16.json")
    ours_bf16 = [_load(folder, f"peer/{name}_bfloat16.json") for name in ("llmctl", "llmctl_nopreload")]
    if vllm_bf16 and any(ours_bf16):  # measured only on CPUs with AMX (issue_goals.sh)
        slower = min((o for o in ours_bf16 if o), key=lambda o: o["out_tok_s"])
        figures = " / ".join(f"{o['out_tok_s']:.1f}" for o in ours_bf16 if o)
        ratio = slower["out_tok_s"] / vllm_bf16["out_tok_s"]
        out.append(
            Goal(
                16,
                "AMX: 246M bf16, 64 x 128 -> 128: llmctl vs vLLM",
                f"{figures} vs {vllm_bf16['out_tok_s']:.1f} tok/s = {ratio:.2f}x",
                ">= 1.27x",
                ratio >= 1.27,
                ratio,
            )
        )
    out.append(_ratio_goal(16, "SmolLM2 one stream, fp32 weights: llmctl vs transformers", fp32_one, hf_one, 2))
    bf16_one, hf_bf16_one = _load(folder, "smollm2/llmctl_bf16.json"), _load(folder, "smollm2/hf_bf16.json")
    if bf16_one or hf_bf16_one:  # measured only on CPUs with native bf16 (run_smollm2_comparison.sh)
        out.append(
            _ratio_goal(16, "SmolLM2 one stream, bf16 weights: llmctl vs transformers (bf16)", bf16_one, hf_bf16_one, 2)
        )
    if spec:
        out.append(
            Goal(
                16,
                "n-gram speculation on the edit workload (fp32 weights)",
                f"{spec['plain_tok_s']} -> {spec['spec_tok_s']} tok/s = {spec['speedup']}x, identical output "
                f"{spec['identical_output']}",
                ">= 1.5x, identical",
                spec["speedup"] >= 1.5 and spec["identical_output"],
                spec["speedup"],
            )
        )
    else:
        out.append(Goal(16, "n-gram speculation", "not measured", ">= 1.5x", None))
    if readme:
        seconds = readme["result"]["duration_s"]
        out.append(
            Goal(
                16,
                "README main command (llmctl bench --concurrency 64): bench part",
                f"{seconds:.1f} s, {readme['result']['output_throughput']:.1f} tok/s",
                "<= 90 s",
                seconds <= 90,
                seconds,
            )
        )
    else:
        out.append(Goal(16, "README main command", "not measured", "<= 90 s", None))
    return out


def rounds_summary(rounds: list[list[Goal]]) -> list[dict]:
    """Per goal (in the tables' order): the rounds that measured it, those that met it, its figures
    and their median."""
    summary = []
    for first in rounds[0]:
        same = [g for table in rounds for g in table if g.issue == first.issue and g.name == first.name]
        measured = [g for g in same if g.met is not None]
        values = [g.value for g in measured if g.value is not None]
        summary.append(
            {
                "issue": first.issue,
                "name": first.name,
                "goal": first.goal,
                "rounds": len(rounds),
                "measured": len(measured),
                "met": sum(bool(g.met) for g in measured),
                "values": [round(v, 3) for v in values],
                "median": round(statistics.median(values), 3) if values else None,
            }
        )
    return summary


def _print_table(table: list[Goal], indent: str = "  ") -> None:
    for goal in table:
        mark = {True: "met", False: "NOT met", None: "not measured"}[goal.met]
        print(f"{indent}issue {goal.issue}: {goal.name}: {goal.measured} (goal {goal.goal}): {mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    emulated = (args.folder / "EMULATE_ISA").read_text().strip() if (args.folder / "EMULATE_ISA").exists() else ""
    print(f"CPU: {cpu_line()}" + (f"; every engine on its {emulated} code paths (EMULATE_ISA)" if emulated else ""))
    round_dirs = sorted((d for d in args.folder.glob("round-*") if d.is_dir()), key=lambda d: int(d.name[6:]))
    report: dict = {"cpu": cpu_line(), "emulate_isa": emulated}
    if not round_dirs:
        table = goals(args.folder)
        _print_table(table)
        report["goals"] = [asdict(g) for g in table]
    else:
        tables = [goals(d) for d in round_dirs]
        for d, table in zip(round_dirs, tables):
            print(f"  {d.name}:")
            _print_table(table, "    ")
        summary = rounds_summary(tables)
        print(f"  over {len(round_dirs)} rounds:")
        for s in summary:
            figures = ", ".join(f"{v:g}" for v in s["values"]) or "-"
            print(
                f"    issue {s['issue']}: {s['name']}: met in {s['met']} of {s['rounds']} rounds "
                f"(goal {s['goal']}; figures {figures}; median {s['median']})"
            )
        report["rounds"] = [[asdict(g) for g in table] for table in tables]
        report["summary"] = summary
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
