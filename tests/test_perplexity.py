"""``llmctl perplexity``: the windows cover the text without scoring a token twice, and the figure
equals one computed with transformers (fp32) on the same windows of stories260k."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmctl.errors import InvalidRequestError
from llmctl.perplexity import windows
from llmctl.tokenizer import Tokenizer

FABLES = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "fables.txt"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmctl.cli", "perplexity", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(("n", "window", "stride"), [(10, 4, 3), (10, 4, 2), (11, 4, 4), (2, 8, 7), (100, 7, 1)])
def test_windows_score_each_token_at_most_once(n, window, stride):
    scored = []
    for w in windows(list(range(n)), window, stride):
        assert 2 <= len(w.token_ids) <= window and 1 <= w.first_scored < len(w.token_ids)
        scored += w.token_ids[w.first_scored :]
    if stride < window:  # overlapping windows: every token but the first
        assert scored == list(range(1, n))
    else:  # each window's first token has no context
        assert scored == [i for i in range(1, n) if i % stride]


def test_bad_windows_are_refused():
    with pytest.raises(InvalidRequestError, match="stride"):
        windows([1, 2, 3], 4, 5)
    assert windows([1], 4, 3) == []


def hf_perplexity(model_dir: Path, token_ids: list[int], window: int, stride: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll = []
    with torch.inference_mode():
        for w in windows(token_ids, window, stride):
            ids = torch.tensor([w.token_ids])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            picked = -logprobs[torch.arange(len(targets)), targets]
            nll += picked[w.first_scored - 1 :].tolist()
    return math.exp(math.fsum(nll) / len(nll)), len(nll)


@pytest.mark.parametrize(("window", "stride"), [(None, None), (96, 40)])
def test_perplexity_equals_transformers_on_the_same_windows(stories_dir, window, stride):
    args = [str(stories_dir), "--text", str(FABLES), "--json", "--dtype", "float32"]
    if window:
        args += ["--window", str(window), "--stride", str(stride)]
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    token_ids = Tokenizer.from_dir(stories_dir).encode(FABLES.read_text(encoding="utf-8"))
    assert got["text_tokens"] == len(token_ids)
    assert (got["window"], got["stride"]) == ((window, stride) if window else (511, 510))  # max_model_len 512
    want, scored = hf_perplexity(stories_dir, token_ids, got["window"], got["stride"])
    assert got["scored_tokens"] == scored == len(token_ids) - 1
    assert got["perplexity"] == pytest.approx(want, rel=1e-4)
    assert got["mean_nll"] == pytest.approx(math.log(want), rel=1e-4)


def test_plain_output_and_a_bad_path(stories_dir, tmp_path):
    done = run_cli(str(stories_dir), "--text", str(FABLES), "--window", "256")
    assert done.returncode == 0 and done.stdout.startswith("perplexity ") and "windows of 256" in done.stdout
    too_long = run_cli(str(stories_dir), "--text", str(FABLES), "--window", "600")
    assert too_long.returncode == 1 and too_long.stderr.strip().splitlines() == [
        "error: --window 600 is too long: at most max_model_len - 1 = 511 tokens (the engine samples one more)"
    ]
    missing = run_cli(str(stories_dir), "--text", str(tmp_path / "missing.txt"))
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [
        f"error: cannot read {tmp_path / 'missing.txt'}: No such file or directory"
    ]
