"""``--dtype auto``: bf16 only where the CPU has bf16 arithmetic units, the same rule for every model."""

from __future__ import annotations

import pytest
import torch

from llmctl.errors import ConfigError
from llmctl.models.config import choose_dtype
from llmctl.models.embedded import embedded_config_dict
from llmctl_kernels.cpu_features import cpu_flags, isa_cap, native_bf16_units, set_isa_cap

CPU = torch.device("cpu")
AVX2_EPYC = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
SPR_XEON = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
COOPER_LAKE = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
SKYLAKE_X = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl"}


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_half_checkpoints_run_in_fp32_without_native_bf16(stored):
    for flags in (AVX2_EPYC, SKYLAKE_X):
        choice = choose_dtype("auto", stored, CPU, flags)
        assert choice.dtype == torch.float32
        assert "no native bf16" in choice.reason


@pytest.fixture
def uncapped():
    """These tests describe a CPU by its flags; a cap on this machine's kernels (scripts/test.sh
    reruns them as an AVX2-only CPU) is not that CPU's, so it is lifted for the test."""
    cap = isa_cap()
    set_isa_cap(None)
    yield
    set_isa_cap(cap)


@pytest.mark.parametrize(("flags", "unit"), [(SPR_XEON, "AMX-BF16"), (COOPER_LAKE, "AVX512-BF16")])
@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_half_checkpoints_run_in_bf16_with_native_units(flags, unit, stored, uncapped):
    choice = choose_dtype("auto", stored, CPU, flags)
    assert choice.dtype == torch.bfloat16 and unit in choice.reason


def test_a_lowered_kernel_level_lowers_the_dtype_choice_too(monkeypatch):
    """``LLMCTL_CPU_ISA=avx2`` on a bf16 CPU makes its kernels the AVX2 ones: auto then picks what
    an AVX2 CPU gets (fp32), not bf16 that those kernels only emulate. llmctl hands the variable to
    the kernels (``llmctl.platform.apply_isa_cap``) when an engine selects its kernels."""
    from llmctl.platform import apply_isa_cap

    try:
        for level in ("avx2", "avx512", "generic"):
            monkeypatch.setenv("LLMCTL_CPU_ISA", level)
            apply_isa_cap()
            assert native_bf16_units(SPR_XEON) == []
            assert choose_dtype("auto", "bfloat16", CPU, COOPER_LAKE).dtype == torch.float32
        monkeypatch.setenv("LLMCTL_CPU_ISA", "avx512bf16")
        apply_isa_cap()
        assert native_bf16_units(SPR_XEON) == ["AMX-BF16", "AVX512-BF16"]
        assert choose_dtype("auto", "bfloat16", CPU, COOPER_LAKE).dtype == torch.bfloat16
    finally:
        monkeypatch.undo()
        apply_isa_cap()  # the session's own cap again


def test_fp32_or_unstated_checkpoints_stay_fp32_everywhere():
    for stored in ("float32", None, "something-odd"):
        assert choose_dtype("auto", stored, CPU, SPR_XEON).dtype == torch.float32


def test_explicit_dtype_wins_and_bad_names_fail():
    assert choose_dtype("bfloat16", "float32", CPU, AVX2_EPYC).dtype == torch.bfloat16
    assert choose_dtype("float32", "bfloat16", CPU, SPR_XEON).reason == "requested with --dtype"
    with pytest.raises(ConfigError, match="unknown dtype"):
        choose_dtype("fp8", None, CPU)


def test_gpu_keeps_the_checkpoint_dtype():
    assert choose_dtype("auto", "float16", torch.device("cuda"), AVX2_EPYC).dtype == torch.float16


def test_embedded_model_follows_the_same_rule_on_this_cpu():
    from llmctl.engine.llm_engine import LLMEngine

    engine = LLMEngine(kv_cache_memory=8 << 20, skip_tokenizer=True)
    expected = torch.bfloat16 if native_bf16_units(cpu_flags()) else torch.float32
    assert embedded_config_dict(100)["torch_dtype"] == "bfloat16"
    assert engine.dtype == expected
    assert engine.model.config.dtype_choice.dtype == expected and engine.model.config.dtype_choice.reason
