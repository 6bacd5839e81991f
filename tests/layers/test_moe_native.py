"""Packed experts in one native call per layer (kernels/cpu/moe_experts.cpp through
``StackedExperts.bind_native``) against the Python loop over the experts, which stays the
reference: bit for bit on random packed experts of every layout the bound kernels read (tiles,
rows, per-channel int8; gate and up merged or not; zero-padded inputs), at every row count around
the int8-digit GEMM's threshold, top-k 1 / 2 / 8, under each ISA variant; gpt-oss's experts (biases,
clamped SwiGLU) likewise; and whole models' greedy tokens and logits, alone and batched.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_factory import make_hf_model, random_prompts
from test_moe_packed import TYPES, _quantized_file

from llmctl.engine.llm_engine import LLMEngine
from llmctl.layers.moe import PackedExpertWeights, StackedExperts, clamped_swiglu
from llmctl.layers.ops import TorchOps
from llmctl.layers.quantization import quantize_int4, quantize_int8
from llmctl.sampling_params import SamplingParams
from llmctl_kernels.cpu_features import set_isa_cap
from llmctl_kernels.moe_native import load_moe_native
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8

pytestmark = pytest.mark.skipif(load_moe_native() is None, reason="the native MoE kernels are not built here")

E, H = 12, 64
ROW_COUNTS = (1, 2, 7, 8, 9, 33, 64)
TOP_KS = (1, 2, 8)


def _int4(w: torch.Tensor, group: int) -> PackedInt4:
    return quantize_int4(w, group)


def _int8(w: torch.Tensor, group: int | None, mins: bool = False) -> PackedInt8:
    packed = quantize_int8(w, group)
    if not mins:
        return packed
    return PackedInt8(packed.qweight, packed.scales, torch.randn_like(packed.scales) * 0.01, packed.group_size)


# name -> (intermediate size, gate, up and down quantizers: f(w [N, K]) -> packed, K a whole number of groups)
FORMATS = {
    "int4-g32": (64, lambda w: _int4(w, 32), lambda w: _int4(w, 32), lambda w: _int4(w, 32)),
    "int4-g64": (64, lambda w: _int4(w, 64), lambda w: _int4(w, 64), lambda w: _int4(w, 32)),
    "int8-g32": (64, lambda w: _int8(w, 32), lambda w: _int8(w, 32), lambda w: _int8(w, 32, mins=True)),
    "int8-g16-rows": (64, lambda w: _int8(w, 16, True), lambda w: _int8(w, 16, True), lambda w: _int8(w, 16)),
    "int8-per-channel": (64, lambda w: _int8(w, None), lambda w: _int8(w, None), lambda w: _int8(w, None)),
    # gate and up in different formats (two projections), down's inputs zero-padded from 48 to 64
    "mixed-padded": (48, lambda w: _int4(w, 32), lambda w: _int8(w, 32), lambda w: _int4(w, 32)),
}


def _experts(fmt: str, native_act: bool = True, gpt_oss: bool = False) -> StackedExperts:
    """``gpt_oss``: with biases and the clamped SwiGLU (a limit the activations cross)."""
    inner, gate_q, up_q, down_q = FORMATS[fmt]
    gen = torch.Generator().manual_seed(0)
    act = TorchOps(native_cpu=native_act).silu_and_mul  # native_act False: the torch activation
    if gpt_oss:
        act = functools.partial(clamped_swiglu, alpha=1.3, limit=0.5)
    experts = StackedExperts(E, H, inner, dtype=torch.float32, act=act, bias=gpt_oss)
    if gpt_oss:
        with torch.no_grad():
            experts.w13_bias.copy_(torch.randn(E, 2 * inner, generator=gen) * 0.3)
            experts.w2_bias.copy_(torch.randn(E, H, generator=gen) * 0.3)

    def padded(w: torch.Tensor) -> torch.Tensor:
        return F.pad(w, (0, -w.shape[1] % 32))

    gate, up, down = [], [], []
    for _ in range(E):
        gate.append(gate_q(torch.randn(inner, H, generator=gen) * 0.2))
        up.append(up_q(torch.randn(inner, H, generator=gen) * 0.2))
        down.append(down_q(padded(torch.randn(H, inner, generator=gen) * 0.2)))
    experts.install_packed(PackedExpertWeights(gate, up, down))
    return experts


def _routing(tokens: int, top_k: int, gen: torch.Generator, skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing; ``skewed``: every token's first choice expert 0 (more than a thread's share)."""
    if skewed:
        ids = torch.stack(
            [
                torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(E - 1, generator=gen)[: top_k - 1] + 1])
                for _ in range(tokens)
            ]
        )
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return weights, ids


def _both(experts: StackedExperts, x, weights, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The native call's output and the Python loop's (``native`` False: the loop runs)."""
    fused = experts(x, weights, ids)
    native, experts.native = experts.native, False
    try:
        loop = experts(x, weights, ids)
    finally:
        experts.native = native
    return fused, loop


@pytest.fixture(params=["avx512", "avx2", "generic"])
def isa(request):
    set_isa_cap(None if request.param == "avx512" else request.param)
    yield request.param
    set_isa_cap(None)


@pytest.mark.parametrize("interleave", ["1", "0"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_call_equals_the_python_loop_bit_for_bit(fmt, interleave, isa, monkeypatch):
    monkeypatch.setenv("LLMCTL_QUANT_INTERLEAVE", interleave)
    experts = _experts(fmt)
    gen = torch.Generator().manual_seed(1)
    for tokens in ROW_COUNTS:
        for top_k in TOP_KS:
            for skewed in (False, True):
                x = torch.randn(tokens, H, generator=gen)
                weights, ids = _routing(tokens, top_k, gen, skewed)
                fused, loop = _both(experts, x, weights, ids)
                assert experts.native, "the native call did not bind"
                assert torch.equal(fused.view(torch.int32), loop.view(torch.int32)), (tokens, top_k, skewed)
            assert experts.recent_counts[-1].tolist() == torch.bincount(ids.reshape(-1), minlength=E).tolist()


@pytest.mark.parametrize("fmt", ["int8-g32", "int4-g32", "mixed-padded"])
def test_gpt_oss_experts_native_call_equals_the_python_loop_bit_for_bit(fmt, isa):
    experts = _experts(fmt, gpt_oss=True)
    gen = torch.Generator().manual_seed(2)
    for tokens in ROW_COUNTS:
        x = torch.randn(tokens, H, generator=gen)
        weights, ids = _routing(tokens, 2, gen, skewed=tokens > 8)
        fused, loop = _both(experts, x, weights, ids)
        assert experts.native, "the native call did not bind"
        assert torch.equal(fused.view(torch.int32), loop.view(torch.int32)), tokens
    without_biases = _both(_experts(fmt), x, weights, ids)[0]
    assert not torch.equal(fused, without_biases)  # the biases and the clamp bite


def test_what_it_cannot_take_keeps_the_python_loop(monkeypatch):
    assert _experts("int8-g32", native_act=False).bind_native() is False
    monkeypatch.setenv("LLMCTL_MOE_NATIVE", "0")
    assert _experts("int8-g32").bind_native() is False
    monkeypatch.delenv("LLMCTL_MOE_NATIVE")
    assert _experts("int8-g32").bind_native()


# ---- a whole model ------------------------------------------------------------------------------
VOCAB = 320
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return make_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_native") / "qwen3_moe", seed=3)


def _run(model: Path, prompts: list[list[int]], native: str, monkeypatch, **kw) -> list:
    """Each prompt's greedy tokens and top logprobs, with the native call (``native`` "1") or the loop."""
    monkeypatch.setenv("LLMCTL_MOE_NATIVE", native)
    engine = LLMEngine(model=str(model), skip_tokenizer=True, dtype="float32", kv_cache_memory=16 << 20, **kw)
    outs = engine.generate(prompts, GREEDY)
    bound = [m.native for m in engine.runner.model.modules() if isinstance(m, StackedExperts)]
    assert bound and all(bool(b) == (native == "1") for b in bound)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _native_equals_loop(model: Path, prompts: list[list[int]], monkeypatch, **kw) -> None:
    """Batched and alone, the native call's tokens and logprobs are the loop's."""
    batched = _run(model, prompts, "1", monkeypatch, **kw)
    assert batched == _run(model, prompts, "0", monkeypatch, **kw)
    for prompt in prompts[:2]:
        assert _run(model, [prompt], "1", monkeypatch, **kw) == _run(model, [prompt], "0", monkeypatch, **kw)


def test_int4_quantized_float_moe_decodes_the_same_with_the_native_call(moe_dir, monkeypatch):
    _native_equals_loop(moe_dir, random_prompts(4, VOCAB, 2, 30, seed=5), monkeypatch, quantization="int4")


@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES.keys())
@pytest.mark.parametrize("case", ["qwen3moe", "mixtral"])
def test_a_quantized_gguf_moe_decodes_the_same_with_the_native_call(case, types, tmp_path_factory, monkeypatch):
    """tests/layers/test_moe_packed.py's tiny files: experts in Q4_0, Q4_1 and Q8_0, merged or not."""
    root = tmp_path_factory.getbasetemp() / "moe_native_gguf"
    root.mkdir(exist_ok=True)
    prompts = [[5], list(range(10, 30)), list(range(40, 110))]
    _native_equals_loop(_quantized_file(case, types, root), prompts, monkeypatch)


def test_a_gpt_oss_mxfp4_file_decodes_the_same_with_the_native_call(tmp_path_factory, monkeypatch):
    """gpt-oss with MXFP4 experts (kept packed as int8 groups), biases and clamped SwiGLU."""
    from gguf_cases import mxfp4_gguf_file

    root = tmp_path_factory.getbasetemp() / "moe_native_gpt_oss"
    root.mkdir(exist_ok=True)
    prompts = [[5], list(range(10, 30)), list(range(40, 110))]
    _native_equals_loop(mxfp4_gguf_file(root), prompts, monkeypatch)
