"""The command line as a user meets it: help, the embedded default, clear one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def llmctl(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command():
    proc = llmctl("--help")
    assert proc.returncode == 0
    for command in ("generate", "pull", "ls", "rm", "chat", "serve", "bench", "top"):
        assert command in proc.stdout


def test_generate_on_embedded_default_is_labelled_random():
    proc = llmctl("generate", "tiny-random-llama", "Once upon a time", "--max-tokens", "12", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time")
    assert "RANDOM weights" in proc.stderr
    assert "generated 12 tokens" in proc.stderr
    mib = float(re.search(r"weights (\d+\.\d) MiB", proc.stderr).group(1))  # the startup line's weight bytes
    assert 24e6 * 2 / 2**20 < mib < 30e6 * 4 / 2**20  # 24M+ parameters in bf16 or fp32


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-memory", "abc"], "cannot read memory size 'abc'"),
        (["--kv-cache-memory", "1.2.3"], "cannot read memory size '1.2.3'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--threads", "0"], "threads must be at least 1"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
        (["--kernel-backend", "cuda-magic"], "backend 'cuda-magic'"),
        (["--attention-backend", "cuda-magic"], "backend 'cuda-magic'"),  # the older name of --kernel-backend
        (["--temperature", "-1"], "temperature must be in [0, 100]"),
        (["--max-model-len", "999999"], "exceeds the model's limit 4096"),
    ],
)
def test_bad_settings_give_one_clear_line(args, message):
    proc = llmctl("generate", "tiny-random-llama", "hi", *args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_directory_is_a_clear_error(tmp_path):
    proc = llmctl("generate", str(tmp_path / "nope"), "hi")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "nope" in proc.stderr


def test_stdin_prompt_drops_the_trailing_newline(stories_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "llmctl.cli", "generate", str(stories_dir), "-", "-n", "5", "-t", "0"],
        input="Once upon a time\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "prompt 5 tokens" in proc.stderr
    assert proc.stdout.startswith("Once upon a time, there was")


def test_counts_are_singular_for_one():
    from llmctl.cli import tokens

    assert (tokens(1), tokens(2), tokens(0)) == ("1 token", "2 tokens", "0 tokens")


def test_stdin_prompt_on_a_terminal_says_it_is_waiting():
    """`generate MODEL -` on a terminal would wait in silence: it says it reads standard input."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "llmctl.cli",
            "generate",
            "tiny-random-llama",
            "-",
            "-n",
            "1",
            "--threads",
            "1",
            "--kv-cache-memory",
            "64MiB",
        ],
        encoding="utf-8",
        timeout=240,
        dimensions=(24, 200),
    )
    try:
        child.expect_exact("reading the prompt from standard input: type it, then Ctrl-D")
        child.sendline("Once")
        child.sendeof()
        child.expect(pexpect.EOF)
        text = re.sub(r"\x1b\[[0-9;]*m", "", child.before)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "prompt 2 tokens · generated 1 token (length)" in text


def test_kv_pool_too_small_names_the_minimum():
    from llmctl.config import kv_pool_too_small

    message = str(kv_pool_too_small(1024, 36864, 16, None))
    assert message == (
        "a KV pool of 1KiB cannot hold a single KV block (36KiB per block of 16 tokens for this "
        "model): give --kv-cache-memory at least 36KiB"
    )
    message = str(kv_pool_too_small(1 << 20, 36864, 16, 100))
    assert "cannot hold one sequence of max_model_len=100 tokens" in message
    assert "at least 252KiB or lower --max-model-len" in message  # ceil(100 / 16) = 7 blocks


# the engine options a command leaves out, because they mean nothing to it
NOT_OFFERED = {
    "generate": {"--max-num-seqs", "--enable-prefix-caching", "--chat-template"},  # one raw prompt
    "chat": {"--max-num-seqs", "--max-num-batched-tokens"},  # one conversation
    "serve": set(),
    "bench": {"--chat-template"},  # prompts as tokens or plain text; its own --seed seeds workload and engine
    "perplexity": {
        "--seed",
        "--chat-template",
        "--speculative-model",
        "--num-speculative-tokens",
        "--ngram-prompt-lookup-max",
        "--ngram-prompt-lookup-min",
    },  # scores, samples nothing
    "top": {"--chat-template", "--tensor-parallel-size", "--pipeline-parallel-size"},  # one in-process engine
}


@pytest.mark.parametrize("columns", ["80", "200"])
@pytest.mark.parametrize("command", sorted(NOT_OFFERED))
def test_help_shows_every_flag_whole(command, columns):
    """At 80 columns and piped, every flag appears whole (help text wraps instead), with no
    `<bool>` metavar on flags; the engine options come from EngineConfig, each command's only
    those that mean something to it, grouped in panels."""
    import os

    from llmctl.cli_options import engine_option_list

    proc = subprocess.run(
        [sys.executable, "-m", "llmctl.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, COLUMNS=columns),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= max(80, int(columns))
    assert "<bool>" not in proc.stdout and "…" not in proc.stdout
    words = set(proc.stdout.replace(",", " ").replace("/", " ").split())
    shown = {o.flag for o in engine_option_list() if o.flag in words}
    expected = {o.flag for o in engine_option_list()} - NOT_OFFERED[command]
    assert shown == expected, (expected - shown, shown - expected)
    assert "--attention-backend" not in words and "--kernel-backend" in words  # the older name is hidden
    assert any(line.startswith("KV cache") and line.endswith(":") for line in lines)
