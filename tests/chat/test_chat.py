"""``llmctl chat``: the conversation state (prompt rendering, trimming, base-model fallback), the
REPL in process, and the command driven through a pseudo-terminal as a user drives it."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import signal
import subprocess
import sys

import pexpect
import pytest
import torch

from llmctl.chat.repl import INTERRUPTED, PROMPT, ChatRepl, WordWrap, terminal_safe
from llmctl.chat.session import PLAIN_CONTINUATION_NOTICE, ChatSession, Message, plain_transcript
from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import InvalidRequestError
from llmctl.models.embedded import embedded_tokenizer
from llmctl.sampling_params import SamplingParams
from llmctl.tokenizer import Tokenizer

THREADS = os.environ.get("LLMCTL_TEST_THREADS", "1")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return embedded_tokenizer()


def chatml(*messages: tuple[str, str], generation_prompt: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


# ---- ChatSession ------------------------------------------------------------------------------


def test_prompt_is_the_chat_template_without_an_extra_bos(tok):
    session = ChatSession(tok, max_model_len=4096, max_tokens=64)
    prepared = session.prepare("hi there")
    assert prepared.dropped_messages == 0
    assert tok.decode(prepared.token_ids, skip_special_tokens=False) == chatml(("user", "hi there"))
    assert prepared.token_ids == tok.encode(chatml(("user", "hi there")), add_special_tokens=False)
    assert prepared.token_ids[0] == tok.backend.token_to_id("<|im_start|>")  # no <s> in front


def test_history_and_system_prompt_are_in_the_next_prompt(tok):
    session = ChatSession(tok, max_model_len=4096, max_tokens=64, system_prompt="Be brief.")
    session.prepare("first question")
    session.add_answer("first answer")
    prepared = session.prepare("second question")
    expected = chatml(
        ("system", "Be brief."), ("user", "first question"), ("assistant", "first answer"), ("user", "second question")
    )
    assert tok.decode(prepared.token_ids, skip_special_tokens=False) == expected
    assert session.num_turns == 2


def test_reset_and_context_tokens(tok):
    session = ChatSession(tok, max_model_len=4096, max_tokens=64)
    assert session.context_tokens() == 0
    session.prepare("a question")
    session.add_answer("an answer")
    full = tok.encode(
        chatml(("user", "a question"), ("assistant", "an answer"), generation_prompt=False), add_special_tokens=False
    )
    assert session.context_tokens() == len(full)
    session.set_system("You are terse.")
    session.reset()
    assert session.messages == []
    assert session.system_prompt == "You are terse."
    system_only = tok.encode(chatml(("system", "You are terse."), generation_prompt=False), add_special_tokens=False)
    assert session.context_tokens() == len(system_only)


def test_oldest_turns_are_dropped_to_leave_room_for_the_answer(tok):
    session = ChatSession(tok, max_model_len=96, max_tokens=32, system_prompt="Stay on topic.")
    assert session.prompt_budget == 64
    dropped_total = 0
    for i in range(12):
        prepared = session.prepare(f"question number {i} about the engine")
        assert len(prepared.token_ids) <= session.prompt_budget
        dropped_total += prepared.dropped_messages
        assert prepared.dropped_messages % 2 == 0  # whole turns: a question and its answer
        session.add_answer(f"answer {i} about pages")
    assert dropped_total > 0
    assert session.messages[0].role == "user"
    assert session.messages[-1] == Message("assistant", "answer 11 about pages")
    assert session.messages[-2] == Message("user", "question number 11 about the engine")
    text = tok.decode(session.encode(session.messages[:-1], generation_prompt=True), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nStay on topic.<|im_end|>")  # the system prompt is kept
    assert "question number 0 " not in text


def test_a_message_too_long_to_fit_is_refused_and_changes_nothing(tok):
    session = ChatSession(tok, max_model_len=64, max_tokens=16)
    session.prepare("short")
    session.add_answer("ok")
    before = list(session.messages)
    with pytest.raises(InvalidRequestError, match="at most 48 fit"):
        session.prepare("engine " * 100)
    assert session.messages == before


def test_answer_room_is_at_most_half_the_context(tok):
    assert ChatSession(tok, max_model_len=512, max_tokens=4096).answer_room == 256
    assert ChatSession(tok, max_model_len=4096, max_tokens=100).answer_room == 100


def test_base_model_falls_back_to_plain_continuation(stories_dir):
    tok = Tokenizer.from_dir(stories_dir)
    session = ChatSession(tok, max_model_len=512, max_tokens=30)
    assert session.plain_continuation
    prepared = session.prepare("Once upon a time")
    assert prepared.token_ids == [1, 403, 407, 261, 378]  # BOS + the text, as a completion would be
    session.add_answer(", there was a girl.")
    prepared = session.prepare("Lily")
    assert prepared.token_ids == tok.encode("Once upon a time, there was a girl. Lily")


def test_terminal_safe_drops_control_characters_but_keeps_layout():
    assert terminal_safe("a\x1b[2Jb\x07c\rd\x9be\tf\ng é🙂") == "a[2Jbcde\tf\ng é🙂"


def test_plain_transcript_spacing():
    assert (
        plain_transcript([Message("user", "Once"), Message("assistant", " upon"), Message("user", "a time")])
        == "Once upon a time"
    )
    assert (
        plain_transcript([Message("system", "Title:"), Message("user", "Lily"), Message("assistant", "!")])
        == "Title: Lily!"
    )
    assert plain_transcript([Message("user", "line\n"), Message("user", "next")]) == "line\nnext"


# ---- the REPL, in process -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(model="tiny-random-llama", kv_cache_memory=32 << 20, max_model_len=256, max_num_seqs=1)


class InterruptingOutput(io.StringIO):
    """Sends this process a SIGINT (as Ctrl-C would) once ``after`` writes have been made."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        written = super().write(text)
        if self.writes == self.after:
            self.at = len(self.getvalue())  # what was on screen when Ctrl-C was pressed
            os.kill(os.getpid(), signal.SIGINT)
        return written


def make_repl(engine, file, max_tokens=8, ignore_eos=False, system=None):
    from rich.console import Console

    session = ChatSession(engine.tokenizer, engine.max_model_len, max_tokens, system_prompt=system)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.7, ignore_eos=ignore_eos)
    return ChatRepl(engine, session, params, Console(file=file, width=300, highlight=False))


def test_repl_commands_in_process(engine):
    out = io.StringIO()
    repl = make_repl(engine, out)
    assert repl.handle("/system Be brief.")
    assert repl.handle("hello")
    assert repl.handle("//etc is a directory")
    assert repl.session.messages[-2] == Message("user", "/etc is a directory")
    assert repl.handle("/frobnicate")
    assert repl.handle("/system")
    assert repl.handle("/stats")
    assert repl.handle("/system -")
    assert repl.session.system_prompt is None
    assert not repl.handle("/exit")
    assert not repl.handle("/quit")
    text = out.getvalue()
    assert "unknown command /frobnicate" in text
    assert "system prompt: Be brief." in text
    assert re.search(r"last answer: \d+ tokens \((stop|length)\) · TTFT \d+ ms", text)
    assert "session: 2 answers" in text
    assert repl.totals.answers == 2 and repl.last is not None


def test_run_loop_continuation_lines_ctrl_c_at_the_prompt_and_eof(engine):
    script = iter(["first line\\", "second line", KeyboardInterrupt, "   ", EOFError])
    prompts = []

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        item = next(script)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item

    out = io.StringIO()
    repl = make_repl(engine, out)
    repl.read_line = read_line
    repl.run()  # returns at end of input
    assert prompts == [">>> ", "... ", ">>> ", ">>> ", ">>> "]
    assert repl.session.messages[0] == Message("user", "first line\nsecond line")
    assert repl.totals.answers == 1
    assert "use /exit or Ctrl-D to quit" in out.getvalue()


def test_repl_trims_and_says_so(engine):
    out = io.StringIO()
    repl = make_repl(engine, out, max_tokens=8)  # context 256: 248 tokens for the conversation
    for i in range(12):
        repl.handle(f"question {i}: " + "tell me about the pages of the engine " * 4)
    assert "oldest messages to fit the context (256 tokens, 8 kept for the answer)" in out.getvalue()
    assert repl.session.messages[0].role == "user" and "question 0:" not in repl.session.messages[0].content


def test_ctrl_c_aborts_the_answer_frees_its_blocks_and_keeps_the_partial_text(engine):
    handler_before = signal.getsignal(signal.SIGINT)
    out = InterruptingOutput(after=6)  # a few streamed pieces, then Ctrl-C
    repl = make_repl(engine, out, max_tokens=200, ignore_eos=True)
    stats = repl.answer("tell me a long story")
    assert stats is not None and stats.finish_reason == "interrupted"
    assert 0 < stats.generated_tokens < 200
    assert INTERRUPTED in out.getvalue()
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    partial = repl.session.messages[-1]
    assert partial.role == "assistant" and partial.content
    assert terminal_safe(partial.content) in out.getvalue()  # what was shown is what the conversation keeps
    # the conversation goes on, and Ctrl-C outside an answer is handled as before
    repl.params = SamplingParams(max_tokens=4)
    assert repl.handle("and then?")
    assert repl.session.num_turns == 2
    assert signal.getsignal(signal.SIGINT) is handler_before


def test_ctrl_c_stops_printing_at_once(engine):
    """Nothing of the answer reaches the screen after the Ctrl-C: not the rest of the step's
    token, not a held-back word."""
    out = InterruptingOutput(after=5)
    repl = make_repl(engine, out, max_tokens=200, ignore_eos=True)
    assert repl.answer("tell me a long story").finish_reason == "interrupted"
    after_ctrl_c = out.getvalue()[out.at :]
    assert after_ctrl_c.strip() == INTERRUPTED, after_ctrl_c
    assert repl.session.messages[-1].content == out.getvalue()[: out.at]  # the conversation keeps what was seen


def test_long_answers_wrap_at_word_boundaries(engine):
    from rich.console import Console

    out = io.StringIO()
    session = ChatSession(engine.tokenizer, engine.max_model_len, 60)
    repl = ChatRepl(
        engine,
        session,
        SamplingParams(max_tokens=60, temperature=0.7, seed=1, ignore_eos=True),
        Console(file=out, width=24, force_terminal=True, color_system=None, highlight=False),
    )
    repl.answer("tell me a long story")
    answer = session.messages[-1].content
    lines = out.getvalue().splitlines()[:-1] if not answer.endswith("\n") else out.getvalue().splitlines()
    shown = "\n".join(lines)
    assert shown.count("\n") >= 2, shown  # it did wrap
    assert all(len(line) <= 24 for line in lines), lines
    assert shown.split() == answer.split()  # every word whole, on one line


def test_word_wrap_holds_a_word_until_it_is_complete():
    written: list[str] = []
    wrap = WordWrap(written.append, width=12)
    for piece in ["Once up", "on a long tim", "e there", " was\nan engine"]:
        wrap.feed(piece)
    wrap.flush()
    assert "".join(written) == "Once upon a\nlong time\nthere was\nan engine" == wrap.shown
    wrap = WordWrap(written.append, width=10)
    wrap.feed("abcdefghijklmnop ")  # longer than a line: broken, nothing lost
    wrap.flush()
    assert wrap.shown == "abcdefghij\nklmnop"


def test_embedded_model_stops_at_im_end(engine):
    im_end = engine.tokenizer.backend.token_to_id("<|im_end|>")
    assert im_end in engine.scheduler.config.eos_token_ids  # the stop tokens the scheduler checks
    # force the end-of-turn token: only <|im_end|> is allowed, so the answer must end on it at once
    params = SamplingParams(max_tokens=50, temperature=0)
    request_id = engine.add_request(engine.tokenizer.encode("hi", add_special_tokens=False), params)
    logits_hook = engine.runner.execute

    def only_im_end(sched):
        output = logits_hook(sched)
        forced = torch.full_like(output.logits, float("-inf"))
        forced[:, im_end] = 0.0
        return dataclasses.replace(output, logits=forced)

    engine.runner.execute = only_im_end
    try:
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                final = out
    finally:
        engine.runner.execute = logits_hook
    assert final.request_id == request_id
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].token_ids == [im_end]
    assert final.outputs[0].text == ""


# ---- the command, driven through a terminal -------------------------------------------------------


def clean(text: str) -> str:
    return ANSI.sub("", text).replace("\r", "")


def _ctrl_c_as_in_a_terminal() -> None:
    """A child inherits an ignored or blocked SIGINT from this process, and Python then leaves Ctrl-C
    ignored at the prompt; something earlier in the full suite leaves SIGINT so (seen in CI twice,
    never with this file alone), so the chat starts as a shell would start it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def spawn_chat(*args: str, timeout: int = 60) -> pexpect.spawn:
    env = dict(os.environ, COLUMNS="300", LINES="50", TERM="xterm-256color", TOKENIZERS_PARALLELISM="false")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "llmctl.cli", "chat", *args, "--threads", THREADS],
        env=env,
        encoding="utf-8",
        timeout=timeout,
        dimensions=(50, 300),
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    return child


def send(child: pexpect.spawn, line: str) -> str:
    """Type a line, wait for the next prompt, return what was printed in between (echo excluded)."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    text = clean(child.before)
    return text.split(line, 1)[1] if line in text else text


def prompt_tokens(tok: Tokenizer, *messages: tuple[str, str]) -> int:
    return len(tok.encode(chatml(*messages), add_special_tokens=False))


def test_chat_turns_stats_system_reset_and_ctrl_d(tok):
    child = spawn_chat("tiny-random-llama", "--max-tokens", "12", "--kv-cache-memory", "64MiB")
    try:
        child.expect_exact("RANDOM weights")
        child.expect_exact(PROMPT)

        first = send(child, "hello engine")
        assert first.strip(), "the first answer printed nothing"
        stats = send(child, "/stats")
        assert f"prompt {prompt_tokens(tok, ('user', 'hello engine'))} tokens" in stats
        assert re.search(r"TTFT \d+ ms", stats) and re.search(r"[\d.]+ tokens/s", stats)
        send(child, "how are pages shared?")
        stats = send(child, "/stats")
        assert "session: 2 answers" in stats
        context_before = int(re.search(r"context (\d+) of 4096 tokens", stats).group(1))
        assert context_before > prompt_tokens(tok, ("user", "hello engine"), ("user", "how are pages shared?"))

        assert "system prompt set" in send(child, "/system You are terse.")
        assert "conversation cleared" in send(child, "/reset")
        stats = send(child, "/stats")
        context_after = int(re.search(r"context (\d+) of 4096 tokens", stats).group(1))
        system_only = tok.encode(
            chatml(("system", "You are terse."), generation_prompt=False), add_special_tokens=False
        )
        assert context_after == len(system_only) < context_before
        send(child, "what now?")
        stats = send(child, "/stats")  # the prompt after /reset holds no earlier turn
        expected = prompt_tokens(tok, ("system", "You are terse."), ("user", "what now?"))
        assert f"prompt {expected} tokens" in stats

        assert "unknown command /nope" in send(child, "/nope")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, clean(child.before or "")


def test_ctrl_c_stops_the_answer_not_the_chat():
    child = spawn_chat("tiny-random-llama", "--max-tokens", "3000", "--ignore-eos", "--kv-cache-memory", "64MiB")
    try:
        child.expect_exact(PROMPT)
        child.sendline("tell me everything")
        child.expect_exact("tell me everything")
        child.expect(r"[A-Za-z]{2}")  # the answer is streaming (escape sequences have no two letters in a row)
        child.sendintr()
        child.expect_exact(INTERRUPTED)
        child.expect_exact(PROMPT)
        stats = send(child, "/stats")
        generated = int(re.search(r"last answer: (\d+) tokens \(interrupted\)", stats).group(1))
        assert 0 < generated < 3000
        first_prompt = int(re.search(r"prompt (\d+) tokens", stats).group(1))

        child.sendintr()  # at the prompt: a hint, not an exit
        child.expect_exact("use /exit or Ctrl-D")
        child.expect_exact(PROMPT)

        child.sendline("and then?")
        child.expect_exact("and then?")
        child.expect(r"[A-Za-z]{2}")
        child.sendintr()
        child.expect_exact(INTERRUPTED)
        child.expect_exact(PROMPT)
        stats = send(child, "/stats")
        second_prompt = int(re.search(r"prompt (\d+) tokens", stats).group(1))
        assert second_prompt > first_prompt + generated // 2  # the partial first answer stayed in the conversation
        assert "session: 2 answers" in stats
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def run_chat(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmctl.cli", "chat", *args, "--threads", THREADS],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, COLUMNS="300", **(env or {})),
    )


def test_base_model_chat_is_plain_continuation(stories_dir):
    proc = run_chat(
        str(stories_dir),
        "--temperature",
        "0",
        "--max-tokens",
        "30",
        "--kv-cache-memory",
        "4MiB",
        stdin="Once upon a time\nShe\n/stats\n",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count(PLAIN_CONTINUATION_NOTICE) == 1
    assert ", there was a little girl named Lily. She loved to play outside in the park. One day," in out
    first = ", there was a little girl named Lily. She loved to play outside in the park. One day,"
    expected = len(Tokenizer.from_dir(stories_dir).encode(f"Once upon a time{first} She"))
    assert f"prompt {expected} tokens" in out  # the second turn continues the whole transcript


def test_hub_model_absent_without_a_terminal_says_how_to_get_it(tmp_path):
    proc = run_chat("Qwen/Qwen2.5-0.5B-Instruct", env={"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1
    message = " ".join(proc.stderr.split())
    assert "Qwen/Qwen2.5-0.5B-Instruct" in message and "llmctl pull Qwen/Qwen2.5-0.5B-Instruct" in message
    assert "Traceback" not in proc.stderr


def test_chat_template_and_its_variables_from_the_command_line(tok, tmp_path):
    template = tmp_path / "loud.jinja"
    template.write_text(tok.chat_template + "{% if loud %}LOUD {% endif %}", encoding="utf-8")
    proc = run_chat(
        "tiny-random-llama",
        "--max-tokens",
        "4",
        "--kv-cache-memory",
        "4MiB",
        "--chat-template",
        str(template),
        "--chat-template-kwargs",
        '{"loud": true}',
        stdin="hello engine\n/stats\n",
    )
    assert proc.returncode == 0, proc.stderr
    expected = len(tok.encode(chatml(("user", "hello engine")) + "LOUD ", add_special_tokens=False))
    assert f"prompt {expected} tokens" in proc.stdout


def test_bad_chat_template_kwargs_are_one_line():
    proc = run_chat("tiny-random-llama", "--chat-template-kwargs", "enable_thinking=false")
    assert proc.returncode == 1
    assert "--chat-template-kwargs: not JSON" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
