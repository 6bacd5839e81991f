"""The terminal loop of ``llmctl chat``: read a line, run a ``/command`` or stream an answer.

The engine is driven directly from this (main) thread, one ``step()`` at a time. Ctrl-C during an
answer only sets a flag (a SIGINT handler is installed for the length of the answer); the loop
sees it between two steps and aborts the request, so the engine is never interrupted half-way
through a step and the conversation goes on. Ctrl-C at the prompt is caught by ``input()`` and
only prints a hint; Ctrl-D (end of input) leaves.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape

from llmctl.chat.session import PLAIN_CONTINUATION_NOTICE, ChatSession
from llmctl.engine.compute_team import ComputeTeam
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.errors import InvalidRequestError
from llmctl.reasoning import ReasoningStream
from llmctl.sampling_params import SamplingParams

PROMPT = ">>> "
CONTINUATION_PROMPT = "... "
INTERRUPTED = "[interrupted]"
EXIT_HINT = "(use /exit or Ctrl-D to quit)"
# Control characters other than newline and tab are not printed: a model's output must not be able
# to move the cursor, clear the screen or retitle the terminal (ESC sequences, C1 controls).
_UNPRINTABLE = {c: None for c in [*range(0x00, 0x20), *range(0x7F, 0xA0)] if c not in (0x09, 0x0A)}


def terminal_safe(text: str) -> str:
    """``text`` without the control characters a terminal would act on (newline and tab stay)."""
    return text.translate(_UNPRINTABLE)


def styled_writer(console: Console, style: str | None) -> Callable[[str], None]:
    """Writes text to ``console``'s file in ``style``, as ``Console.out`` would, with the style's
    codes rendered once: ``Console.out`` renders every piece anew (about 150 us), a cost each word
    of an answer would pay on the thread that steps the engine."""
    prefix = suffix = ""
    if style is not None:
        with console.capture() as capture:
            console.out("x", style=style, end="", highlight=False)
        prefix, _, suffix = capture.get().partition("x")
    file = console.file

    def write(text: str) -> None:
        file.write(text if text == "\n" else prefix + text + suffix)
        file.flush()

    return write


class WordWrap:
    """Streams text to a terminal ``width`` columns wide, breaking lines at spaces only.

    A word is held back until it is complete (the next space or newline), so it can move to the
    next line whole; ``shown`` is what reached the screen. A word longer than a line is broken."""

    def __init__(self, write: Callable[[str], None], width: int) -> None:
        self.write = write
        self.width = max(width, 10)
        self.column = 0
        self.word = ""
        self.space = ""  # the spaces before ``word``: printed only if the word stays on this line
        self._shown: list[str] = []

    @property
    def shown(self) -> str:
        return "".join(self._shown)

    def feed(self, text: str) -> None:
        for char in text:
            if char == "\n":
                self.flush()
                self._emit("\n")
                self.column, self.space = 0, ""
            elif char in " \t":
                self.flush()
                self.space += char
            else:
                self.word += char
                if len(self.word) >= self.width:
                    self.flush()

    def flush(self) -> None:
        """Print the held word (on this line if it fits, else on the next)."""
        if not self.word:
            return
        if self.column and self.column + len(self.space) + len(self.word) > self.width:
            self._emit("\n")
            self.column, self.space = 0, ""
        self._emit(self.space + self.word)
        self.column += len(self.space) + len(self.word)
        self.word = self.space = ""

    def _emit(self, text: str) -> None:
        self.write(text)
        self._shown.append(text)


@dataclass
class AnswerStats:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    generated_tokens: int
    finish_reason: str  # "stop" | "length" | "interrupted"
    ttft_s: float | None
    decode_tokens_per_s: float | None  # after the first token
    elapsed_s: float

    @classmethod
    def from_output(
        cls, final: RequestOutput | None, prompt_tokens: int, started: float, interrupted: bool
    ) -> AnswerStats:
        elapsed = time.time() - started
        if final is None:  # interrupted before the first token
            return cls(prompt_tokens, 0, 0, "interrupted", None, None, elapsed)
        sample = final.outputs[0]
        metrics = final.metrics
        generated = len(sample.token_ids)
        rate = None
        if generated > 1 and metrics.first_token_time and metrics.last_token_time:
            span = metrics.last_token_time - metrics.first_token_time
            rate = (generated - 1) / span if span > 0 else None
        reason = "interrupted" if interrupted else (sample.finish_reason or "stop")
        return cls(len(final.prompt_token_ids), final.num_cached_tokens, generated, reason, metrics.ttft, rate, elapsed)


@dataclass
class SessionTotals:
    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0

    def add(self, stats: AnswerStats) -> None:
        self.answers += 1
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.generated_tokens += stats.generated_tokens


@contextmanager
def interrupt_flag() -> Iterator[threading.Event]:
    """While inside, SIGINT (Ctrl-C) sets the yielded event instead of raising KeyboardInterrupt."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signal handlers can only be installed from the main thread
        return
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def enable_line_editing() -> None:
    """Arrow keys, history (up/down) and Emacs-style editing for ``input()`` on a terminal."""
    if sys.stdin is not None and sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (importing it is what turns line editing on)
        except ImportError:  # not available on every platform; input() still works without it
            pass


class ChatRepl:
    """One chat session on one engine. ``read_line`` is ``input`` in the terminal."""

    def __init__(
        self,
        engine: LLMEngine,
        session: ChatSession,
        params: SamplingParams,
        console: Console,
        read_line: Callable[[str], str] = input,
        compute_team: ComputeTeam | None = None,
        lora: str | None = None,
    ) -> None:
        self.engine = engine
        self.lora = lora  # the LoRA adapter every answer runs through (chat --lora), or None
        # sizes the CPU compute team while an answer streams (llmctl/engine/compute_team.py)
        self.compute_team = compute_team
        self.session = session
        self.params = params
        self.console = console
        self.read_line = read_line
        self.last: AnswerStats | None = None
        self.totals = SessionTotals()
        self.show_thinking = True  # a thinking model's reasoning streams dimmed (/think off hides it)
        self.last_reasoning = ""
        self.commands: dict[str, tuple[Callable[[str], bool], str]] = {
            "system": (
                self._cmd_system,
                "/system TEXT  set the system prompt (/system alone shows it, /system - clears it)",
            ),
            "reset": (self._cmd_reset, "/reset        forget the conversation (the system prompt stays)"),
            "stats": (self._cmd_stats, "/stats        last answer's TTFT and tokens/s, and session totals"),
            "think": (
                self._cmd_think,
                "/think on|off|show  a thinking model's reasoning: shown dimmed (on); off turns thinking "
                "off in templates that have the switch (Qwen3's enable_thinking), else hides it behind a "
                "one-line summary; show prints the last answer's reasoning in full",
            ),
            "help": (self._cmd_help, "/help         this list"),
            "exit": (self._cmd_exit, "/exit, /quit  leave (Ctrl-D too)"),
            "quit": (self._cmd_exit, ""),
        }

    # ---- the loop ------------------------------------------------------------------------------
    def print_banner(self, load_seconds: float) -> None:
        engine = self.engine
        dtype = engine.dtype_description
        adapter = f" · LoRA {escape(self.lora)}" if self.lora else ""
        self.console.print(f"[bold]llmctl chat[/] · {escape(engine.model_label)}{adapter}")
        self.console.print(
            f"[dim]{dtype} · {engine.device} · context {engine.max_model_len} tokens · load {load_seconds:.1f} s[/]"
        )
        if self.session.plain_continuation:
            self.console.print(f"[yellow]{PLAIN_CONTINUATION_NOTICE}[/]")
        self.console.print("[dim]/help lists the commands · Ctrl-C stops an answer · Ctrl-D or /exit quits[/]")

    def run(self) -> None:
        """Read and answer until /exit or end of input."""
        while True:
            try:
                line = self._read_message()
            except EOFError:
                self.console.print()
                return
            except KeyboardInterrupt:
                self.console.print(f"\n[dim]{EXIT_HINT}[/]")
                continue
            try:
                if not self.handle(line):
                    return
            except KeyboardInterrupt:  # during a command; answers handle Ctrl-C themselves
                self.console.print(f"[yellow]{escape(INTERRUPTED)}[/]")

    def handle(self, line: str) -> bool:
        """One input line; False means leave."""
        if not line.strip():
            return True
        if line.startswith("/") and not line.startswith("//"):
            return self._run_command(line)
        self.answer(line[1:] if line.startswith("//") else line)  # "//x" sends "/x" as a message
        return True

    def _read_message(self) -> str:
        """One message; a line ending in a backslash continues on the next line."""
        lines = [self.read_line(PROMPT)]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(self.read_line(CONTINUATION_PROMPT))
        return "\n".join(lines)

    # ---- answers -------------------------------------------------------------------------------
    def answer(self, text: str) -> AnswerStats | None:
        """Stream the model's answer to ``text``; None if the message was refused.

        Ctrl-C anywhere in here (tokenizing, prefill, decoding) only raises the flag, so the request
        is either never queued or aborted between two steps, never left half-way."""
        with interrupt_flag() as stop:
            try:
                prepared = self.session.prepare(text)
            except InvalidRequestError as exc:
                self._error(str(exc))
                return None
            if prepared.dropped_messages:
                self.console.print(
                    f"[yellow]dropped the {prepared.dropped_messages} oldest messages to fit the "
                    f"context ({self.session.max_model_len} tokens, {self.session.answer_room} kept "
                    "for the answer)[/]"
                )
            started = time.time()
            try:
                request_id = self.engine.add_request(prepared.token_ids, self.params, lora=self.lora)
            except InvalidRequestError as exc:
                self.session.discard_pending()
                self._error(str(exc))
                return None

            printer = self._printer()
            thinking = _Thinking(self, prepared.token_ids)
            final: RequestOutput | None = None
            interrupted = False
            with self._team_listening():
                while self.engine.has_unfinished():
                    outputs = self.engine.step() if not stop.is_set() else []
                    if stop.is_set():  # Ctrl-C before or during the step: nothing more is printed
                        self.engine.abort(request_id)
                        interrupted = True
                        break
                    for out in outputs:
                        text = thinking.feed(out.outputs[0])
                        if text:
                            thinking.close()
                            printer.feed(terminal_safe(text))
                        final = out
        thinking.close()
        if not interrupted:
            printer.flush()
        answer = printer.shown
        if answer and not answer.endswith("\n"):
            self.console.out("")
        stats = AnswerStats.from_output(final, len(prepared.token_ids), started, interrupted)
        self._finish_turn(answer, stats)
        return stats

    @contextmanager
    def _team_listening(self) -> Iterator[None]:
        """The compute team follows this answer's steps, and is whole again when it ends (the
        terminal is idle until the next question)."""
        team = self.compute_team
        if team is None:
            yield
            return
        self.engine.stats.listeners.append(team)
        try:
            yield
        finally:
            self.engine.stats.listeners.remove(team)
            team.reset()

    def _printer(self, style: str | None = None) -> WordWrap:
        """Answers wrap at word boundaries on a terminal; piped, the text goes out as it is."""
        return WordWrap(styled_writer(self.console, style), self.console.width if self.console.is_terminal else 1 << 30)

    def _finish_turn(self, answer: str, stats: AnswerStats) -> None:
        """An interrupted answer keeps what was shown (the user saw it); one with no text at all is
        dropped with its question, as if never asked."""
        if stats.finish_reason == "interrupted":
            self.console.print(f"[yellow]{escape(INTERRUPTED)}[/]")
            if answer:
                self.session.add_answer(answer)
            else:
                self.session.discard_pending()
        else:
            self.session.add_answer(answer)
            if not answer:
                self.console.print("[dim](empty answer)[/]")
            if stats.finish_reason == "length":
                if stats.generated_tokens >= self.params.max_tokens:
                    why = f"--max-tokens {self.params.max_tokens}"
                else:
                    why = f"the context is full ({self.session.max_model_len} tokens)"
                self.console.print(f"[dim]{escape('[cut: ' + why + ']')}[/]")
        self.last = stats
        self.totals.add(stats)

    # ---- commands ------------------------------------------------------------------------------
    def _run_command(self, line: str) -> bool:
        name, _, argument = line[1:].partition(" ")
        entry = self.commands.get(name.strip().lower())
        if entry is None:
            self.console.print(
                f"[yellow]unknown command /{escape(name)}[/]: /help lists the commands "
                "(start a message with // to send a leading /)"
            )
            return True
        handler, _help = entry
        return handler(argument.strip())

    def _cmd_system(self, argument: str) -> bool:
        if not argument:
            current = self.session.system_prompt
            self.console.print(f"system prompt: {escape(current)}" if current else "no system prompt")
        elif argument == "-":
            self.session.set_system(None)
            self.console.print("system prompt cleared")
        else:
            self.session.set_system(argument)
            self.console.print(
                "system prompt set: it applies from the next answer (/reset also forgets the conversation)"
            )
        return True

    def _cmd_reset(self, _argument: str) -> bool:
        self.session.reset()
        kept = " (the system prompt stays)" if self.session.system_prompt else ""
        self.console.print(f"conversation cleared{kept}")
        return True

    def _cmd_stats(self, _argument: str) -> bool:
        last = self.last
        if last is None:
            self.console.print("last answer: none yet")
        else:
            ttft = "–" if last.ttft_s is None else f"{1000 * last.ttft_s:.0f} ms"
            rate = "–" if last.decode_tokens_per_s is None else f"{last.decode_tokens_per_s:.1f}"
            self.console.print(
                f"last answer: {last.generated_tokens} tokens ({last.finish_reason}) · TTFT {ttft} · "
                f"{rate} tokens/s · {last.elapsed_s:.2f} s"
            )
            self.console.print(f"  prompt {last.prompt_tokens} tokens ({last.cached_tokens} from the prefix cache)")
        totals = self.totals
        self.console.print(
            f"session: {totals.answers} answer{'' if totals.answers == 1 else 's'} · "
            f"{totals.prompt_tokens} prompt tokens ({totals.cached_tokens} cached) · "
            f"{totals.generated_tokens} generated"
        )
        self.console.print(
            f"  context {self.session.context_tokens()} of {self.session.max_model_len} tokens "
            "(the conversation so far)"
        )
        return True

    def _cmd_think(self, argument: str) -> bool:
        session = self.session
        if session.reasoning is None:
            self.console.print("this model does not think (no <think> block in its template and vocabulary)")
            return True
        if argument == "show":
            if self.last_reasoning:
                self.console.print(escape(terminal_safe(self.last_reasoning)), style="dim", highlight=False)
            else:
                self.console.print("no reasoning in the last answer")
        elif argument == "on":
            self.show_thinking = True
            session.template_kwargs.pop("enable_thinking", None)
            self.console.print("thinking on: the reasoning shows dimmed before each answer")
        elif argument == "off":
            if session.template_switches_thinking:
                session.template_kwargs["enable_thinking"] = False
                self.console.print("thinking off: the template's enable_thinking is false, the model answers at once")
            else:
                self.show_thinking = False
                self.console.print("reasoning hidden: one summary line per answer (/think show prints the last one)")
        else:
            state = "off" if session.splitter is None else ("on" if self.show_thinking else "hidden")
            self.console.print(f"thinking {state} ({session.reasoning.name}): /think on|off|show")
        return True

    def _cmd_help(self, _argument: str) -> bool:
        for _handler, text in self.commands.values():
            if text:
                self.console.print(escape(text))
        self.console.print(
            "Ctrl-C stops an answer (the text so far stays in the conversation) · a line ending "
            "in \\ continues on the next · // sends a message that starts with /"
        )
        return True

    def _cmd_exit(self, _argument: str) -> bool:
        return False

    def _error(self, message: str) -> None:
        self.console.print(f"[bold red]error:[/] {escape(message)}")


class _Thinking:
    """One answer's think block in the terminal: streamed dimmed as it comes (or, hidden, summed up
    in one line), set apart from the answer that follows. ``feed`` returns the answer's new text."""

    def __init__(self, repl: ChatRepl, prompt_token_ids: list[int]) -> None:
        self.repl = repl
        parser = repl.session.splitter
        self.stream = None if parser is None else ReasoningStream(parser, repl.engine.tokenizer, prompt_token_ids)
        self.printer = repl._printer(style="dim") if repl.show_thinking else None
        self.closed = False
        repl.last_reasoning = ""

    def feed(self, c: CompletionOutput) -> str:
        if self.stream is None:
            return c.delta_text
        thought, answer = self.stream.feed(c.text, c.token_ids, c.finished)
        self.repl.last_reasoning = self.stream.reasoning
        if thought and self.printer is not None and not self.closed:
            self.printer.feed(terminal_safe(thought))
        return answer

    def close(self) -> None:
        """The block is over (the answer starts, or the output ended): a line apart from the answer."""
        if self.closed or self.stream is None:
            return
        self.closed = True
        split = self.stream.split
        if not split.has_reasoning:
            return
        if self.printer is not None:
            self.printer.flush()
            if self.printer.shown:
                self.repl.console.out("\n")
            return
        self.repl.console.print(
            f"[dim]{escape(f'[thought for {split.reasoning_tokens} tokens · /think show prints it]')}[/]"
        )
