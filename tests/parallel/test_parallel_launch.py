"""Launching: a TP size that cannot split the model is one clear line before any rank starts,
rank 0 failing at start-up ends every rank at once with its reason, two torchrun agents (two
"nodes" on 127.0.0.1, ``--nnodes 2``) give the one-process tokens, and a rank that leaves leaves
no communication thread behind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from parallel_helpers import HERE, REPO_ROOT, rank_env, torchrun

from llmctl.config import EngineConfig
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

PROMPT = "Once upon a time"


def llmctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmctl.cli", *args],
        cwd=REPO_ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_tp_size_that_does_not_divide_the_heads_is_a_clear_error(stories_dir):
    started = time.monotonic()
    done = llmctl("generate", str(stories_dir), PROMPT, "--tensor-parallel-size", "3")
    assert done.returncode == 1
    assert "--tensor-parallel-size 3 does not divide the model's 8 attention heads" in done.stderr
    assert "torch.distributed" not in done.stderr + done.stdout  # no rank was started
    assert time.monotonic() - started < 60


def test_pipeline_deeper_than_the_model_is_a_clear_error(stories_dir):
    done = llmctl("generate", str(stories_dir), PROMPT, "--pipeline-parallel-size", "6")
    assert done.returncode == 1
    assert "5 layers cannot be split over pipeline-parallel size 6" in done.stderr


def test_rank_0_failing_to_start_ends_every_rank_with_its_reason(stories_dir, tmp_path):
    """An error of rank 0's engine once the process group is up (here: no tokenizer file) would
    leave the other rank in a start-up collective: rank 0 ends at once with the reason, and
    torchrun's agent stops the rest."""
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).symlink_to(stories_dir / name)
    started = time.monotonic()
    done = llmctl("generate", str(model), PROMPT, "--tensor-parallel-size", "2", timeout=90)
    assert done.returncode == 1
    assert "rank 0 could not start the engine" in done.stderr
    assert "tokenizer.json: not found" in done.stderr
    assert "every rank was stopped" in done.stderr
    assert time.monotonic() - started < 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_give_the_single_process_tokens(stories_dir):
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "two-nodes",
        "--max-restarts",
        "0",
        "-m",
        "llmctl.cli",
        "generate",
        str(stories_dir),
        PROMPT,
        "-n",
        "24",
        "-t",
        "0",
        "--tensor-parallel-size",
        "2",
        "--kv-cache-memory",
        "16MiB",
    ]
    nodes = [
        subprocess.Popen(
            command, cwd=REPO_ROOT, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (_out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    engine = LLMEngine(EngineConfig(model=str(stories_dir), kv_cache_memory=16 << 20))
    expected = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    printed = [out for out, _ in outputs if out.strip()]
    assert len(printed) == 1  # only global rank 0 (on whichever node the rendezvous made it) prints
    assert printed[0] == PROMPT + expected + "\n"


def test_leaving_the_process_group_ends_its_threads(tmp_path):
    """What keeps a finished rank from aborting at exit (docs/parallelism.md, "A clean exit"): once
    a rank has left, no gloo thread of any group it used (the world, a stage's group) is left to
    outlive the interpreter."""
    torchrun(str(HERE / "leave_ranks.py"), "1", "2", str(tmp_path / "threads"), nproc=2)
    for rank in (0, 1):
        threads = json.loads((tmp_path / f"threads.{rank}").read_text())
        assert threads and not [name for name in threads if "gloo" in name], threads
