"""The command line as a user meets it: help, the embedded default, clear one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest


def llmctl(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_command():
    proc = llmctl("--help")
    assert proc.returncode == 0
    for command in ("generate", "pull", "ls", "rm", "chat", "serve", "bench", "top"):
        assert command in proc.stdout


def test_generate_on_embedded_default_is_labelled_random():
    proc = llmctl("generate", "tiny-random-llama", "Once upon a time", "--max-tokens", "12", "--sample-seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time")
    assert "RANDOM weights" in proc.stderr
    assert "generated 12 tokens" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-memory", "abc"], "cannot read memory size 'abc'"),
        (["--kv-cache-memory", "1.2.3"], "cannot read memory size '1.2.3'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--threads", "0"], "threads must be at least 1"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
        (["--attention-backend", "cuda-magic"], "unknown attention backend 'cuda-magic'"),
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
    proc = subprocess.run([sys.executable, "-m", "llmctl.cli", "generate", str(stories_dir), "-", "-n", "5", "-t", "0"],
                          input="Once upon a time\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prompt 5 tokens" in proc.stderr
    assert proc.stdout.startswith("Once upon a time, there was")
