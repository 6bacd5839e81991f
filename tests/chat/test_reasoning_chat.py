"""``llmctl chat`` with a thinking model: the think block dimmed before the answer, ``/think``
on/off/show, and only the answer kept in the conversation; in process and in a pseudo-terminal."""

from __future__ import annotations

import io
import os
import re
import sys

import pexpect
import pytest
import reasoning_model
from rich.console import Console

from llmctl.chat.repl import PROMPT, ChatRepl
from llmctl.chat.session import ChatSession
from llmctl.engine.llm_engine import LLMEngine
from llmctl.reasoning import resolve_parser
from llmctl.sampling_params import SamplingParams

DIM = "\x1b[2m"
THREADS = os.environ.get("LLMCTL_TEST_THREADS", "1")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> dict:
    return reasoning_model.build(tmp_path_factory.mktemp("thinker") / "model")


@pytest.fixture(scope="module")
def engine(thinker) -> LLMEngine:
    return LLMEngine(model=thinker["dir"], kv_cache_memory=16 << 20, max_model_len=256, max_num_seqs=1)


def make_repl(engine, **template_kwargs):
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=True, color_system="standard", highlight=False)
    session = ChatSession(
        engine.tokenizer,
        engine.max_model_len,
        32,
        template_kwargs=template_kwargs,
        reasoning=resolve_parser("auto", engine.tokenizer),
    )
    return ChatRepl(engine, session, SamplingParams(max_tokens=32, temperature=0), console), out


def dimmed(screen: str) -> str:
    """The text printed between a dim escape and the next reset."""
    return "".join(re.findall(r"\x1b\[2m(.*?)\x1b\[0m", screen, flags=re.S))


def test_reasoning_streams_dimmed_and_only_the_answer_is_kept(engine, thinker):
    repl, out = make_repl(engine)
    repl.answer("alpha")
    screen = out.getvalue()
    reasoning, answer = (thinker["tokenizer"].decode(thinker[k]) for k in ("reasoning", "answer"))
    assert dimmed(screen) == reasoning
    assert answer in screen and answer not in dimmed(screen)
    assert screen.index(reasoning.split()[-1]) < screen.index(answer)
    assert repl.session.messages[-1].content == answer  # the reasoning is not sent back next turn
    assert repl.last_reasoning == reasoning


def test_think_off_hides_it_behind_a_summary_and_show_expands_it(engine, thinker):
    repl, out = make_repl(engine)
    repl.session.tokenizer.chat_template = repl.session.tokenizer.chat_template.replace("enable_thinking", "no_switch")
    try:
        repl.handle("/think off")
        repl.answer("alpha")
        screen = out.getvalue()
        reasoning = thinker["tokenizer"].decode(thinker["reasoning"])
        assert reasoning not in screen
        assert f"thought for {len(thinker['reasoning']) + 2} tokens" in screen
        repl.handle("/think show")
        assert reasoning in out.getvalue()
    finally:
        repl.session.tokenizer.chat_template = reasoning_model.TEMPLATE


def test_think_off_turns_the_template_switch_off(engine, thinker):
    repl, out = make_repl(engine)
    repl.handle("/think off")
    assert repl.session.template_kwargs == {"enable_thinking": False}
    repl.answer("alpha")
    screen = out.getvalue()
    assert thinker["tokenizer"].decode(thinker["answer"]) in screen and dimmed(screen) == ""
    repl.handle("/think on")
    assert repl.session.template_kwargs == {}
    repl.handle("/think")
    assert "thinking on (qwen3)" in out.getvalue()


@pytest.mark.subprocess
def test_chat_in_a_terminal_dims_the_reasoning(thinker):
    env = dict(os.environ, COLUMNS="200", LINES="50", TERM="xterm-256color", TOKENIZERS_PARALLELISM="false")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "llmctl.cli", "chat", thinker["dir"], "-t", "0", "--kv-cache-memory", "16MiB", "--threads", THREADS],
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 200),
    )
    try:
        if child.expect_exact([PROMPT, pexpect.EOF]) != 0:
            pytest.fail(f"chat ended before its prompt:\n{child.before}")
        child.sendline("alpha")
        if child.expect_exact([PROMPT, pexpect.EOF]) != 0:
            pytest.fail(f"chat ended during the answer:\n{child.before}")
        screen = child.before
        reasoning = thinker["tokenizer"].decode(thinker["reasoning"])
        answer = thinker["tokenizer"].decode(thinker["answer"])
        first_word = reasoning.split()[0]
        at = screen.index(first_word)
        assert "\x1b[2m" in screen[max(0, at - 12) : at]  # dim, right before the reasoning
        assert re.sub(r"\x1b\[[0-9;]*m", "", screen).count(reasoning) == 1
        assert answer in screen
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
