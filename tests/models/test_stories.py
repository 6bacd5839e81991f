"""The real pretrained stories260k model (../shared/models/stories260k), read in place."""

from __future__ import annotations

import subprocess
import sys

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

EXPECTED = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day,"


def test_greedy_continuation_matches_readme(stories_dir):
    engine = LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)
    (out,) = engine.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30))
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]
    assert len(out.outputs[0].token_ids) == 30
    assert "Once upon a time" + out.outputs[0].text == EXPECTED


def test_streamed_deltas_concatenate_to_the_text(stories_dir):
    engine = LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)
    engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30))
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
    assert len(deltas) == 30
    assert "Once upon a time" + "".join(deltas) == EXPECTED


def test_cli_generate_streams_text_and_stats(stories_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmctl.cli",
            "generate",
            str(stories_dir),
            "Once upon a time",
            "--max-tokens",
            "30",
            "--temperature",
            "0",
            "--kv-cache-memory",
            "4MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == EXPECTED
    assert "prompt 5 tokens" in proc.stderr and "generated 30 tokens" in proc.stderr
    assert "tokens/s" in proc.stderr
