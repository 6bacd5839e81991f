"""The CPU ``llmctl serve`` spends on its event loop per generated token, measured as CPU time
rather than wall time, so that a shared, busy machine barely moves the figure.

A ``llmctl serve`` child answers one greedy request at a time (``ignore_eos``, so every request
makes exactly TOKENS tokens), streamed and not streamed; the per-thread CPU of the child comes
from ``/proc/PID/task/TID/schedstat`` (nanoseconds on a CPU) before and after the requests:

    event loop   the main thread: uvicorn, the routes, the hand-off from the engine, SSE and JSON,
                 and how often it was woken (voluntary context switches) per token
    other        every other thread: the engine loop (the model's compute), OpenMP, workers

    python -m benchmarks.features.serve_overhead [--model M] [--tokens N] [--requests R] [--source DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = str(REPO_ROOT.parent / "shared" / "models" / "stories260k")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # stories260k has none


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds each thread of ``pid`` has run on a CPU."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return times


def wakeups(pid: int) -> int:
    """How often the main thread went to sleep waiting (epoll, a lock): one per event-loop wake-up."""
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def start_server(model: str, source: Path = REPO_ROOT) -> tuple[subprocess.Popen, str]:
    """``llmctl serve`` from the checkout ``source`` (another one: an A/B of two trees), and its URL."""
    cmd = [sys.executable, "-m", "llmctl.cli", "serve", model, "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--threads", "1", "--log-level", "warning", "--no-access-log", "--trust-request-chat-template"]
    proc = subprocess.Popen(cmd, cwd=source, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if " at http" in line:
            return proc, line.split(" at ", 1)[1].split("/v1", 1)[0]
    raise RuntimeError("llmctl serve did not start")


def request(client: httpx.Client, url: str, tokens: int, stream: bool) -> int:
    """One greedy chat completion of ``tokens`` tokens; the tokens the server counted."""
    body = {
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "chat_template": CHAT_TEMPLATE,
    }
    if not stream:
        response = client.post(f"{url}/v1/chat/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    completion = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                completion = usage["completion_tokens"] if usage else completion
    return completion


def measure(pid: int, url: str, tokens: int, requests: int, stream: bool) -> dict[str, float]:
    with httpx.Client(timeout=600) as client:
        request(client, url, tokens, stream)  # warm-up
        before, woken, start = thread_cpu_ns(pid), wakeups(pid), time.perf_counter()
        generated = sum(request(client, url, tokens, stream) for _ in range(requests))
        after, woken, wall = thread_cpu_ns(pid), wakeups(pid) - woken, time.perf_counter() - start
    spent = {tid: ns - before.get(tid, 0) for tid, ns in after.items()}
    loop = spent.get(pid, 0)
    other = sum(ns for tid, ns in spent.items() if tid != pid)
    return {
        "tokens": generated,
        "event_loop_us_per_token": loop / generated / 1e3,
        "event_loop_wakeups_per_token": woken / generated,
        "other_threads_us_per_token": other / generated / 1e3,
        "tok_per_s_wall": generated / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--source", type=Path, default=REPO_ROOT, help="the checkout whose llmctl serves")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    proc, url = start_server(args.model, args.source)
    try:
        results = {
            mode: measure(proc.pid, url, args.tokens, args.requests, mode == "stream")
            for mode in ("stream", "non-stream")
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"{'chat completions':<18}{'event loop us/tok':>18}{'wake-ups/tok':>14}{'other us/tok':>14}{'tok/s':>10}")
    for mode, r in results.items():
        print(
            f"{mode:<18}{r['event_loop_us_per_token']:>18.1f}{r['event_loop_wakeups_per_token']:>14.2f}"
            f"{r['other_threads_us_per_token']:>14.1f}{r['tok_per_s_wall']:>10.1f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
