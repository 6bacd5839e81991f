"""llama.cpp as the second GGUF oracle: on each family's converter-written file (tests/gguf_cases.py;
F32 and Q8_0), llama-server's greedy continuation and its top-5 log-probabilities before sampling
against llmctl's on the same file (tests/llama_cpp_server.py). Every log-probability of the top 5,
up to the first step where the tokens part, is within the family's tolerance (a few times what was
measured: benchmarks/gguf_vs_llama_cpp.py prints it, docs/benchmarks.md keeps the table). F32: the
tokens are identical. Q8_0, where llama.cpp's matmuls round the activations to 8 bits too: tokens
may part only at a near tie (the two candidates within the tolerance in either engine); for the
MoE families a router's near tie may also send a token to another expert there.

Marked ``llama_cpp`` (tests/models/conftest.py): runs when a llama-server binary is configured."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_cases import CASES, MOE, gguf_file, mxfp4_dense_gguf_file, mxfp4_gguf_file
from llama_cpp_server import compare_with_llama_cpp, configured_binary, oracle_prompts

pytestmark = pytest.mark.llama_cpp

# max |Δ logprob| allowed, a few times what was measured (docs/benchmarks.md). F32: float32 rounding,
# except where ggml's GELU reads an fp16 table (the Gemma families). Q8_0: llama.cpp's matmuls round
# the activations to 8 bits as well.
F32_TOLERANCE = {case: 5e-3 if case.startswith("gemma") else 5e-5 for case in CASES}
Q8_0_TOLERANCE = {case: 0.3 if case in MOE else 0.15 for case in CASES}
MXFP4_TOLERANCE = 1.5  # gpt-oss with MXFP4 experts: llama.cpp's 8-bit activations on larger weights


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_vs_llama_cpp")


@pytest.fixture(scope="module")
def binary() -> Path:
    found = configured_binary()
    assert found is not None and found.is_file(), f"llama-server not found at {found}"
    return found


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_match_llama_cpp(case, outtype, root, binary):
    result = compare_with_llama_cpp(binary, gguf_file(case, outtype, root), oracle_prompts(case))
    tolerance = (F32_TOLERANCE if outtype == "f32" else Q8_0_TOLERANCE)[case]
    assert result.max_delta <= tolerance, result.max_delta
    if outtype == "f32":
        assert result.ours == result.theirs
    elif case not in MOE:  # tokens may part only at a near tie, which a difference of that size can flip
        assert result.tie_gap is None or result.tie_gap <= tolerance, (result.tie_gap, result.ours, result.theirs)
    # MoE Q8_0: the 8-bit activations can also tip a router's near tie to another expert, which moves
    # that step by more than the tolerance; the steps before the tokens part are compared (max_delta)


def test_mxfp4_experts_match_llama_cpp(root, binary):
    """gpt-oss with MXFP4 experts (the converter keeps them MXFP4), which llmctl keeps packed as int8
    groups. Against llama.cpp reading the same values from an F32 file: F32's tolerance and the same
    tokens (llmctl's packed kernels round the activations to int16's precision). Against llama.cpp
    on the MXFP4 file itself, whose MXFP4 matmuls round the activations to 8 bits: on this
    checkpoint (expert weights up to 0.75) that moves llama.cpp's log-probabilities by up to 0.6
    from its own F32 reading, so the bound there is MXFP4_TOLERANCE, up to where the tokens part."""
    ours = mxfp4_gguf_file(root)
    same_values = compare_with_llama_cpp(
        binary, mxfp4_dense_gguf_file(root), oracle_prompts("gpt-oss"), ours_model=ours
    )
    assert same_values.max_delta <= 2e-3 and same_values.ours == same_values.theirs, same_values
    result = compare_with_llama_cpp(binary, ours, oracle_prompts("gpt-oss"))
    assert result.max_delta <= MXFP4_TOLERANCE, result.max_delta
