"""Quantized experts kept packed (llmctl/layers/moe.py ``StackedExperts.install_packed``, loaded from
GGUF by llmctl/models/gguf.py): each expert's projections are packed linear layers; their output
against the dequantized fp32 experts; a row's result against its batch; the engine's greedy tokens
with 16 staggered requests against each request alone; the bytes they hold; what is refused.

The GGUF files are llama.cpp's converter's f32 files of tiny random checkpoints with every
expert's intermediate size a multiple of 32, their stacked expert tensors rewritten in the types a
test asks for by ``gguf.quants.quantize`` (the format authors' quantizer) with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize
from gguf_cases import VOCAB
from gguf_factory import encode_tensor
from llama_cpp_converter import convert, write_llama_tokenizer
from model_factory import make_hf_model, staggered

from llmctl.distributed import TensorParallel
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.model_runner import bind_cpu_kernels
from llmctl.layers.linear import LinearBase
from llmctl.layers.moe import PackedExpert, PackedExpertWeights, StackedExperts, expert_stats
from llmctl.layers.quantization import dequantize, weight_bytes
from llmctl.models import gguf_quants
from llmctl.models.gguf_reader import read_gguf
from llmctl.sampling_params import SamplingParams
from llmctl_kernels.activation import silu_and_mul_torch

T = GGMLQuantizationType
E, H, I = 6, 64, 96  # noqa: E741
# (gate, up, down) types: gate and up alike (one merged packed weight) or not (two)
TYPES = {
    "q4_0": (T.Q4_0, T.Q4_0, T.Q4_0),
    "q4_1-q8_0-down": (T.Q4_1, T.Q4_1, T.Q8_0),
    "q4_0-gate-q8_0-up": (T.Q4_0, T.Q8_0, T.Q4_1),
}
# GGUF case -> (model_factory family, overrides: expert intermediate sizes a multiple of 32)
FAMILIES = {
    "qwen3moe": ("qwen3_moe", {"mlp_only_layers": [], "moe_intermediate_size": 64}),
    "mixtral": ("mixtral", {"intermediate_size": 64}),
}
_EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _raw_stack(rows: int, cols: int, qtype: GGMLQuantizationType, gen: torch.Generator) -> np.ndarray:
    """GGUF bytes of ``E`` random ``[rows, cols]`` experts (K-quants: random blocks, as
    tests/gguf_factory.py makes them)."""
    values = (torch.randn(E, rows, cols, generator=gen) * 0.3).numpy()
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    return np.stack([encode_tensor(v, qtype, rng) for v in values])


def _stack(rows: int, cols: int, qtype: GGMLQuantizationType, gen: torch.Generator) -> list:
    return gguf_quants.repack_experts(_raw_stack(rows, cols, qtype, gen), qtype, (E, rows, cols))


def _packed_and_reference(
    types: tuple, seed: int = 0, hidden: int = H, size: int = I
) -> tuple[StackedExperts, StackedExperts]:
    """The same experts packed (``install_packed``) and as their dequantized fp32 stacks."""
    gen = torch.Generator().manual_seed(seed)
    gate, up = _stack(size, hidden, types[0], gen), _stack(size, hidden, types[1], gen)
    down = _stack(hidden, size, types[2], gen)
    reference = StackedExperts(E, hidden, size, dtype=torch.float32, act=silu_and_mul_torch)
    with torch.no_grad():
        reference.w13.copy_(torch.stack([torch.cat([dequantize(g), dequantize(u)]) for g, u in zip(gate, up)]))
        reference.w2.copy_(torch.stack([dequantize(d) for d in down]))
    packed = StackedExperts(E, hidden, size, dtype=torch.float32, act=silu_and_mul_torch)
    packed.install_packed(PackedExpertWeights(gate, up, down))
    return packed, reference


def _batch(num_tokens: int, seed: int = 1, hidden: int = H):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    first = torch.randint(0, E - 1, (num_tokens,), generator=gen)  # expert E - 1: chosen by none
    ids = torch.stack([first, (first + 1 + torch.randint(0, E - 2, (num_tokens,), generator=gen)) % (E - 1)], 1)
    weights = torch.rand(num_tokens, 2, generator=gen)
    return x, weights / weights.sum(1, keepdim=True), ids


@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES.keys())
def test_experts_are_packed_linear_layers_in_place_of_the_float_stacks(types):
    packed, reference = _packed_and_reference(types)
    assert packed.w13 is None and packed.w2 is None
    names = {name for name, _ in packed.named_parameters()}
    merged = types[0] == types[1]
    assert ("packed.0.gate_up.qweight" in names) == merged and ("packed.0.gate.qweight" in names) != merged
    formats = {T.Q4_0: "int4", T.Q4_1: "int4", T.Q8_0: "int8"}
    for expert in packed.packed:
        assert isinstance(expert, PackedExpert)
        layers = [expert.gate_up] if merged else [expert.gate, expert.up]
        for layer, qtype in zip([*layers, expert.down], [*types[: 2 - merged], types[2]]):
            assert isinstance(layer, LinearBase) and layer.packed_format == formats[qtype]
    # 4-bit blocks: at most ~0.19 bytes a weight of 4 in fp32 (the scales and mins in float32)
    assert weight_bytes(packed) < weight_bytes(reference) * (0.35 if T.Q8_0 not in types else 0.7)
    assert packed.expert_bytes() * E == weight_bytes(packed.packed)


@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES.keys())
def test_packed_experts_on_exact_activations_match_the_dequantized_experts(types):
    """Exact activations: the dequantized fp32 experts within 1e-5 of the largest output; the
    default int16-rounded activations within 1e-3."""
    packed, reference = _packed_and_reference(types)
    x, weights, ids = _batch(40)
    want = reference(x, weights, ids)
    for exact, tolerance in ((True, 1e-5), (False, 1e-3)):
        bind_cpu_kernels(packed, exact_activations=exact)
        got = packed(x, weights, ids)
        assert (got - want).abs().max() <= tolerance * want.abs().max()
    assert packed.recent_counts[-1][E - 1] == 0


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_each_experts_repacked_slice_is_gguf_dequantize_bit_for_bit(qtype):
    raw = _raw_stack(32, 256, qtype, torch.Generator().manual_seed(3))
    want = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32))
    got = torch.stack([dequantize(p) for p in gguf_quants.repack_experts(raw, qtype, (E, 32, 256))])
    assert torch.equal(got, want)


def test_k_quant_experts_match_the_dequantized_experts():
    """Q4_K gate and up (merged), Q6_K down, as llama.cpp's Q4_K_M files hold them; exact activations."""
    packed, reference = _packed_and_reference((T.Q4_K, T.Q4_K, T.Q6_K), hidden=256, size=256)
    assert packed.packed[0].gate_up.packed_format == "int4" and packed.packed[0].down.packed_format == "int8"
    x, weights, ids = _batch(24, hidden=256)
    want = reference(x, weights, ids)
    bind_cpu_kernels(packed, exact_activations=True)
    assert (packed(x, weights, ids) - want).abs().max() <= 1e-5 * want.abs().max()


def test_an_expert_no_token_chose_is_never_read():
    packed, _ = _packed_and_reference(TYPES["q4_0"])
    x, weights, ids = _batch(17)
    for name in ("qweight", "scales", "mins"):  # a read of the unchosen expert's weight would fail
        packed.packed[E - 1].gate_up._parameters[name] = torch.nn.Parameter(
            torch.empty(0, device="meta"), requires_grad=False
        )
    bind_cpu_kernels(packed)
    assert packed(x, weights, ids).isfinite().all()


@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES.keys())
def test_a_rows_result_does_not_depend_on_how_many_rows_share_its_expert(types, gemm_from_one_row):
    packed, _ = _packed_and_reference(types)
    bind_cpu_kernels(packed)
    x, weights, ids = _batch(40)
    batched = packed(x, weights, ids)
    alone = torch.cat([packed(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, batched)


def test_packed_experts_are_refused_under_tensor_parallelism():
    experts = StackedExperts(E, H, I, dtype=torch.float32, tp=TensorParallel(0, 2), act=silu_and_mul_torch)
    gen = torch.Generator().manual_seed(0)
    weights = PackedExpertWeights(_stack(I, H, T.Q8_0, gen), _stack(I, H, T.Q8_0, gen), _stack(H, I, T.Q8_0, gen))
    with pytest.raises(ValueError, match="tensor parallel size 1 only.*--quantization none"):
        experts.install_packed(weights)


def test_packed_experts_of_the_wrong_shape_are_named():
    experts = StackedExperts(E, H, I, dtype=torch.float32, act=silu_and_mul_torch)
    gen = torch.Generator().manual_seed(0)
    weights = PackedExpertWeights(_stack(I, H, T.Q8_0, gen), _stack(I, H, T.Q8_0, gen), _stack(H, 64, T.Q8_0, gen))
    with pytest.raises(ValueError, match=r"expert 0 down_proj: expected shape \(64, 96\), got \(64, 64\)"):
        experts.install_packed(weights)


# ---- GGUF files ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe_packed")


def _f32_file(case: str, root: Path) -> Path:
    out = root / f"{case}-f32.gguf"
    if not out.is_file():
        family, overrides = FAMILIES[case]
        model_dir = make_hf_model(family, root / case, seed=70, **overrides)
        write_llama_tokenizer(model_dir, VOCAB)
        convert(model_dir, out, "f32", pre_tokenizer="default" if family != "mixtral" else None)
    return out


def _quantized_file(case: str, types: tuple, root: Path) -> Path:
    """The case's f32 file with each layer's stacked experts in ``types`` (gate, up, down)."""
    out = root / f"{case}-{'-'.join(t.name for t in types)}.gguf"
    if out.is_file():
        return out
    reader = read_gguf(_f32_file(case, root))
    writer = GGUFWriter(str(out), arch=str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        data, qtype = np.array(tensor.data), tensor.tensor_type
        part = next((i for i, suffix in enumerate(_EXPERT_TENSORS) if tensor.name.endswith(suffix)), None)
        if part is not None:
            data, qtype = quantize(data.astype(np.float32), types[part]), types[part]
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(path), skip_tokenizer=True, dtype="float32", kv_cache_memory=16 << 20, **kw)


def _prompts(n: int = 16) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (int(length),), generator=gen).tolist() for length in torch.arange(n) * 3 + 2]


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("case", FAMILIES)
def test_a_quantized_file_keeps_its_experts_packed(case, root):
    path = _quantized_file(case, TYPES["q4_1-q8_0-down"], root)
    packed, dequantized = _engine(path), _engine(path, quantization="none")
    layers = [m for m in packed.model.modules() if isinstance(m, StackedExperts)]
    assert layers and all(m.packed is not None and m.w13 is None for m in layers)
    assert all(m.packed[0].gate_up.packed_format == "int4" for m in layers)
    assert all(m.packed[0].down.packed_format == "int8" for m in layers)
    # bound at load as every packed layer is: their tile-interleaved copies replace the rows
    assert all(m.packed[e].down.qweight.is_meta and m.packed[e].gate_up.qweight.is_meta for m in layers for e in (0, 7))
    assert all(m.packed is None for m in dequantized.model.modules() if isinstance(m, StackedExperts))
    # the experts hold 4-bit gate/up and 8-bit down blocks instead of fp32 (bound kernels' copies)
    experts_packed = sum(m.expert_bytes() * m.num_experts for m in layers)
    experts_float = sum(
        m.expert_bytes() * m.num_experts for m in dequantized.model.modules() if isinstance(m, StackedExperts)
    )
    assert experts_packed < 0.3 * experts_float
    assert weight_bytes(packed.model) < weight_bytes(dequantized.model) - 0.6 * experts_float
    packed.generate([[5, 6, 7]], GREEDY)
    assert expert_stats(packed.model)["weight_bytes"] == experts_packed


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("types", TYPES.values(), ids=TYPES.keys())
def test_packed_experts_on_exact_activations_decode_as_the_dequantized_file(case, types, root):
    path = _quantized_file(case, types, root)
    prompts = _prompts(4)
    want = [o.outputs[0].token_ids for o in _engine(path, quantization="none").generate(prompts, GREEDY)]
    engine = _engine(path, quant_exact_activations=True)
    layers = [m.down for m in engine.model.modules() if isinstance(m, PackedExpert)]
    assert layers and all(m.__dict__["_bound_cpu_kernel"][2] for m in layers)  # on the exact activations
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)] == want


@pytest.mark.parametrize("case", FAMILIES)
def test_sixteen_staggered_requests_decode_as_each_alone(case, root, gemm_from_one_row):
    engine = _engine(_quantized_file(case, TYPES["q4_0-gate-q8_0-up"], root))
    prompts = _prompts()
    together = staggered(engine, prompts, GREEDY_LOGPROBS)
    alone = [staggered(engine, [p], GREEDY_LOGPROBS)[0] for p in prompts]
    assert [tokens for tokens, _ in together] == [tokens for tokens, _ in alone]
    for (_, batched), (_, single) in zip(together, alone):  # the float-expert file: ~1e-5 apart too
        torch.testing.assert_close(torch.tensor(batched), torch.tensor(single), rtol=0, atol=1e-3)


@pytest.mark.parametrize("types", [None, (T.Q8_0, T.Q8_0, T.F16)], ids=["f32", "f16-down"])
def test_a_file_with_float_expert_stacks_keeps_them_float(types, root):
    path = _f32_file("qwen3moe", root) if types is None else _quantized_file("qwen3moe", types, root)
    engine = _engine(path)
    layers = [m for m in engine.model.modules() if isinstance(m, StackedExperts)]
    assert layers and all(m.packed is None and m.w13.dtype == torch.float32 for m in layers)
