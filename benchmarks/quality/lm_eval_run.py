"""lm-evaluation-harness against ``llmctl serve``: a loglikelihood task and a generation task.

Starts ``llmctl serve MODEL`` on a free port, runs ``lm-eval run --model local-completions`` against
its ``/v1/completions`` and prints lm-eval's table, the wall time and the CPU. The tasks are
llmctl's own small ones with local data (``benchmarks/data/lm_eval``: a 32-question multiple-choice
task scored by loglikelihood, a 32-question one-word QA task scored by exact match on greedy
generations), because the Hugging Face hub, where lm-eval's stock tasks fetch their data, may be
out of reach. lm-eval tokenizes with the server's own tokenizer through the tokenizer endpoints
(``/tokenize``, ``/detokenize``, ``/tokenizer_info``; its "remote" backend), so nothing is
downloaded and a GGUF model works as well as a transformers directory.

    pip install -e '.[bench]'          # lm-eval
    python -m benchmarks.quality.lm_eval_run smollm2-135m
    python -m benchmarks.quality.lm_eval_run tiny-random-llama --limit 4 --max-model-len 256   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import cpu_line

REPO_ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO_ROOT / "benchmarks" / "data" / "lm_eval"
TASKS = "llmctl_mc,llmctl_qa"
READY = re.compile(r"llmctl serve: .* at (http://127\.0\.0\.1:\d+)/v1")
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_TRUST_REMOTE_CODE": "0",
}


class Server:
    """``llmctl serve MODEL --port 0``; its URL from the startup line."""

    def __init__(self, model: str, flags: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        command = [
            sys.executable,
            "-m",
            "llmctl.cli",
            "serve",
            model,
            "--port",
            "0",
            "--no-access-log",
            "--log-level",
            "warning",
            *flags,
        ]
        self.proc = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}
        )
        self.url = self._wait_ready(timeout=600)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if match := READY.search(self.log_path.read_text(errors="replace")):
                return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise SystemExit(f"llmctl serve did not start:\n{self.log_path.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def lm_eval_command(url: str, served_name: str, args: argparse.Namespace, output: Path) -> list[str]:
    model_args = ",".join(
        [
            f"base_url={url}/v1/completions",
            f"model={served_name}",
            "tokenizer_backend=remote",
            "tokenized_requests=True",
            f"num_concurrent={args.concurrent}",
            "max_retries=1",
            f"max_length={args.max_model_len}",
            "timeout=600",
        ]
    )
    command = [
        str(Path(sys.executable).with_name("lm-eval")),
        "run",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        args.tasks,
        "--include_path",
        str(TASKS_DIR),
        "--batch_size",
        str(args.batch_size),
        "--output_path",
        str(output),
        "--seed",
        "1234",
    ]
    return command + (["--limit", str(args.limit)] if args.limit else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--limit", type=int, default=0, help="items per task (0: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per request (lm-eval's --batch_size)")
    parser.add_argument("--concurrent", type=int, default=4, help="requests in flight (lm-eval's num_concurrent)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--serve-flag", action="append", default=[], help="extra flag for llmctl serve (repeatable)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="llmctl-lm-eval-") as tmp:
        server = Server(
            args.model, ["--max-model-len", str(args.max_model_len), *args.serve_flag], Path(tmp) / "serve.log"
        )
        try:
            command = lm_eval_command(server.url, args.model, args, Path(tmp) / "out")
            print("$", " ".join(command), flush=True)
            started = time.perf_counter()
            subprocess.run(command, cwd=REPO_ROOT, check=True, env={**os.environ, **OFFLINE})
            seconds = time.perf_counter() - started
        finally:
            server.stop()
        results = json.loads(next((Path(tmp) / "out").rglob("results_*.json")).read_text())["results"]
    summary = {
        "model": args.model,
        "tasks": results,
        "seconds": round(seconds, 1),
        "cpu": cpu_line(),
        "load": os.getloadavg()[0],
        "command": " ".join(command),
    }
    print(f"lm-eval on {args.model}: {seconds:.1f} s, load {summary['load']:.2f}, {summary['cpu']}")
    for task, metrics in results.items():
        shown = {k: v for k, v in metrics.items() if isinstance(v, float)}
        print(f"  {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
