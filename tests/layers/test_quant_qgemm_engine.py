"""The int8-digit GEMM (kernels/cpu/qgemm.h) inside the engine, on a GGUF file of packed Q4_0, Q4_1,
Q8_0 and K-quant layers (tests/gguf_factory.py) kept packed by ``--quantization auto``: a batch of
prompts decodes the same greedy tokens as the int16 passes give, and with the GEMM taking every
step (from one row on) each prompt decodes alone exactly as in the batch."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from gguf_factory import write_tiny_gguf  # noqa: E402

from llmctl.config import EngineConfig  # noqa: E402
from llmctl.engine.llm_engine import LLMEngine  # noqa: E402
from llmctl.sampling_params import SamplingParams  # noqa: E402
from llmctl_kernels.quant_native import load_quant_native, native_unavailable_reason  # noqa: E402

if native_unavailable_reason() is not None:
    pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}", allow_module_level=True)

PROMPTS = [[(5 * i + 11 * j) % 60 + 3 for j in range(4 + 3 * i)] for i in range(12)]  # 4..37 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("qgemm_engine")
    path = write_tiny_gguf(root / "llama.gguf", root / "llama-hf", arch="llama", tie=True)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=16 << 20, quantization="auto"))


@pytest.fixture
def min_rows():
    set_rows = load_quant_native().set_qgemm_min_rows
    previous = set_rows(8)
    yield set_rows
    set_rows(previous)


def _greedy(engine: LLMEngine, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]


def test_packed_layers_take_the_interleaved_kernels(engine):
    bound = [m.__dict__.get("_bound_cpu_kernel") for m in engine.model.modules()]
    assert sum(getattr(b[1], "tiles", None) is not None for b in bound if b is not None) >= 4


def test_batched_greedy_tokens_match_the_int16_passes(engine, min_rows):
    int8_digits = _greedy(engine, PROMPTS)  # prefill and 12-row decode steps take the GEMM
    min_rows(1 << 30)
    assert _greedy(engine, PROMPTS) == int8_digits
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_each_prompt_alone_decodes_as_in_the_batch(engine, min_rows):
    min_rows(1)
    batched = _greedy(engine, PROMPTS)
    for i in (0, 5, 11):
        assert _greedy(engine, [PROMPTS[i]]) == [batched[i]]
