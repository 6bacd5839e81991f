"""The CPU ``llmctl chat`` spends printing an answer, per token, on the thread that also steps
the engine: every microsecond here is one the compute team waits for.

A greedy answer of TOKENS tokens is generated once; its per-token text is then fed through the
chat's printer (word wrap onto a terminal console) with the writer ``llmctl chat`` uses and with
``Console.out`` per piece, and the thread's CPU time per token is reported for both.

    python -m benchmarks.features.chat_print_cost [--model M] [--tokens N]
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from llmctl.chat.repl import WordWrap, styled_writer, terminal_safe
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

DEFAULT_MODEL = str(Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260k")


def deltas(model: str, tokens: int) -> list[str]:
    engine = LLMEngine(model=model)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    request_id = engine.add_request("Once upon a time", params)
    pieces = []
    while engine.has_unfinished():
        pieces += [out.outputs[0].delta_text for out in engine.step() if out.request_id == request_id]
    return pieces


def cpu_per_token_us(pieces: list[str], write: Callable[[str], None], rounds: int) -> float:
    start = time.thread_time()
    for _ in range(rounds):
        printer = WordWrap(write, 100)
        for text in pieces:
            printer.feed(terminal_safe(text))
        printer.flush()
    return (time.thread_time() - start) / (rounds * len(pieces)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    pieces = deltas(args.model, args.tokens)
    console = Console(file=io.StringIO(), width=100, force_terminal=True, highlight=False)
    for style in (None, "dim"):
        writers = {
            "styled_writer": styled_writer(console, style),
            "Console.out": lambda text, style=style: console.out(text, end="", style=style, highlight=False),
        }
        for name, write in writers.items():
            print(f"style {style!s:<5} {name:<14} {cpu_per_token_us(pieces, write, args.rounds):8.1f} us/token")


if __name__ == "__main__":
    main()
