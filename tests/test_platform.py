"""llmctl/platform.py: the one place that decides which kernels an engine runs on."""

from __future__ import annotations

import warnings

import pytest
import torch

from llmctl import platform
from llmctl.config import EngineConfig
from llmctl.errors import ConfigError
from llmctl.platform import KernelSet, select_kernels

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_unknown_backend_is_an_error_naming_the_choices():
    with pytest.raises(ConfigError, match="unknown kernel backend 'cutlass'; choose one of auto, torch, triton"):
        select_kernels("cutlass", CPU)


def test_auto_is_triton_on_cuda_and_torch_on_a_cpu():
    cuda = select_kernels("auto", CUDA)
    assert (cuda.backend, cuda.native_cpu, cuda.isa, cuda.description) == ("triton", False, None, "triton")
    assert cuda.decode_loop_why_not() == "not a CPU"
    cpu = select_kernels("auto", CPU)
    assert cpu.backend == "torch" and cpu.isa == platform.cpu_isa()
    assert cpu.native_cpu == (cpu.native_cpu_why_not is None)
    interpreted = select_kernels("triton", CPU)  # Triton's interpreter: no native kernels beside it
    assert interpreted.backend == "triton" and not interpreted.native_cpu and interpreted.description == "triton"


def test_the_switch_turns_every_native_kernel_off(monkeypatch):
    monkeypatch.setenv("LLMCTL_NATIVE_CPU_KERNELS", "0")
    monkeypatch.setenv("LLMCTL_NATIVE_GEMM", "1")  # the master switch wins
    reason = "disabled by LLMCTL_NATIVE_CPU_KERNELS=0"
    assert platform.native_cpu_off() == reason
    assert platform.fused_cpu_kernels() is None and platform.quant_cpu_kernels() is None
    assert platform.kv_quant_cpu_kernels() is None and platform.native_gemm() is None
    assert not platform.native_gemm_wanted() and not platform.kv_codes_native(64)
    assert platform.decode_loop_kernels() == (None, reason)
    kernels = select_kernels("torch", CPU)
    assert not kernels.native_cpu and kernels.native_cpu_why_not == reason
    assert kernels.description == f"torch (native CPU kernels off: {reason})"


def _cpu_set(**kw) -> KernelSet:
    base = dict(backend="torch", device=CPU, native_cpu=True, native_cpu_why_not=None, isa="avx2")
    return KernelSet(**{**base, **kw})


def test_why_the_decode_loop_is_off():
    assert _cpu_set().decode_loop_why_not() is None
    assert _cpu_set().description == "torch + native CPU kernels (avx2)"
    assert _cpu_set(decode_loop=False, quant_exact_activations=True).decode_loop_why_not() == "LLMCTL_DECODE_LOOP=0"
    assert _cpu_set(isa="generic").decode_loop_why_not() == "generic kernel variant"
    assert _cpu_set(quant_exact_activations=True).decode_loop_why_not() == "--quant-exact-activations"
    assert (
        _cpu_set(native_cpu=False, native_cpu_why_not="no compiler").decode_loop_why_not()
        == "native CPU kernels off: no compiler"
    )
    assert _cpu_set(backend="triton", native_cpu=False).decode_loop_why_not() == "triton kernels"


def test_the_engine_reads_the_switch_when_it_is_built(monkeypatch):
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "0")
    kernels = select_kernels("torch", CPU)
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    assert kernels.decode_loop_why_not() == "LLMCTL_DECODE_LOOP=0"
    assert select_kernels("torch", CPU).decode_loop


def test_the_cpu_isa_cap_is_handed_to_the_kernels(monkeypatch):
    from llmctl_kernels import cpu_features

    caps = []
    monkeypatch.setattr(cpu_features, "set_isa_cap", caps.append, raising=False)
    monkeypatch.setenv("LLMCTL_CPU_ISA", "avx2")
    select_kernels("torch", CPU)
    monkeypatch.delenv("LLMCTL_CPU_ISA")
    platform.apply_isa_cap()
    assert caps == ["avx2", None]


def test_the_old_backend_keyword_still_works():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = EngineConfig(attention_backend="triton")
    assert config.kernel_backend == "triton"
    assert [w.category for w in caught] == [DeprecationWarning]
    assert EngineConfig().kernel_backend == "auto"


def test_the_engine_runs_on_its_kernel_set(llama_dir, monkeypatch):
    from llmctl.engine.llm_engine import LLMEngine

    monkeypatch.setenv("LLMCTL_NATIVE_CPU_KERNELS", "0")
    engine = LLMEngine(model=str(llama_dir), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20)
    assert engine.ops.kernels is engine.kernels and not engine.ops.native
    assert engine.ops.description == engine.kernels.description
    assert "disabled by LLMCTL_NATIVE_CPU_KERNELS=0" in engine.runner.decode_path


@pytest.mark.skipif(platform.quant_cpu_kernels() is None, reason="the native quantized kernels are not built here")
def test_exact_activations_reach_the_bound_kernels(llama_dir, monkeypatch):
    """``EngineConfig.quant_exact_activations``: every packed layer is bound to the exact-activation
    path, and the decode loop (which runs the integer path) steps aside, saying why."""
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.layers.quantization.params import kernel_packed
    from llmctl_kernels.quant_native import quant_linear_native

    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    kw = dict(model=str(llama_dir), skip_tokenizer=True, dtype="float32", quantization="int8", kv_cache_memory=8 << 20)
    engine = LLMEngine(quant_exact_activations=True, **kw)
    layer = engine.model.model.layers[0].mlp.down_proj
    assert layer.__dict__["_bound_cpu_kernel"][2] is True
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    exact = quant_linear_native(x, kernel_packed(layer), True)  # slab: the exact activations
    assert torch.equal(layer(x), exact)
    if engine.kernels.native_cpu and engine.kernels.isa in platform.DECODE_LOOP_ISAS:
        assert engine.runner.decode_path == "decode: Python modules (--quant-exact-activations)"
    default = LLMEngine(**kw).model.model.layers[0].mlp.down_proj
    assert default.__dict__["_bound_cpu_kernel"][2] is False
    assert not torch.equal(default(x), exact)  # int16-rounded activations: not the same bits


def test_below_avx2_the_engine_decodes_through_the_modules(llama_dir, monkeypatch):
    """The generic kernel variant (a CPU without AVX2, or ``LLMCTL_CPU_ISA=generic``) has no decode
    loop: the engine says so and decodes through the Python modules (whose tokens the ISA-capped
    rerun of the exactness tests checks against transformers)."""
    from llmctl.engine.llm_engine import LLMEngine

    try:
        monkeypatch.setenv("LLMCTL_CPU_ISA", "generic")
        engine = LLMEngine(model=str(llama_dir), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20)
        assert engine.kernels.isa == "generic"
        assert engine.runner.native_decode is None
        assert engine.runner.decode_path == "decode: Python modules (generic kernel variant)"
    finally:
        monkeypatch.undo()
        platform.apply_isa_cap()
