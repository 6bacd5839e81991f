"""Mixture-of-experts GGUF files written by llama.cpp's own converter (tests/gguf_cases.py): Mixtral
(``llama`` with experts), Qwen2-MoE (shared expert and its gate), Qwen3-MoE, OLMoE and gpt-oss
(expert biases; MXFP4 experts from an MXFP4 checkpoint, dequantized or kept packed). F32 runs
token for token and logprob for logprob as transformers on the checkpoint; Q8_0 as transformers on
the checkpoint's weights rounded the way the file stores them (gguf's own Q8_0 / F16 round trip,
so the oracle shares no layout code with llmctl's loader)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
from gguf.quants import dequantize, quantize
from gguf_cases import MOE, checkpoint, gguf_file, mxfp4_checkpoints, mxfp4_gguf_file
from model_factory import hf_greedy

from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ModelLoadError, UnsupportedModelError
from llmctl.layers.moe import StackedExperts
from llmctl.models.gguf import gguf_config_dict, read_metadata
from llmctl.models.gguf_reader import read_gguf
from llmctl.models.registry import family_for_gguf
from llmctl.sampling_params import SamplingParams

PROMPTS = [[5], list(range(10, 30)), list(range(40, 110))]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_moe")


def _engine(model: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(model), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20, **kw)


def _greedy(model: Path, n: int = 20, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [out.outputs[0].token_ids for out in _engine(model, **kw).generate(PROMPTS, params)]


@pytest.mark.parametrize("case", MOE)
def test_f32_file_matches_transformers(case, root):
    assert _greedy(gguf_file(case, "f32", root)) == hf_greedy(checkpoint(case, root), PROMPTS, 20)


@pytest.mark.parametrize("case", MOE)
def test_f32_file_logprobs_match_transformers(case, root):
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[-1]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    (out,) = _engine(gguf_file(case, "f32", root)).generate([prompt], params)
    tokens = out.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(checkpoint(case, root), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), want, rtol=0, atol=1e-4)


def _stored_types(hf_name: str, arch: str, types: dict[str, GGMLQuantizationType]) -> set[GGMLQuantizationType]:
    """The GGML types the converter stored ``hf_name`` in (gguf's own name table; stacked experts by
    their three file tensors)."""
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    if hf_name.endswith(".experts.gate_up_proj"):
        return {types[f"blk.{layer}.ffn_gate_exps.weight"], types[f"blk.{layer}.ffn_up_exps.weight"]}
    if hf_name.endswith(".experts.down_proj"):
        return {types[f"blk.{layer}.ffn_down_exps.weight"]}
    if hf_name.endswith(".kv_b_proj.weight") and f"blk.{layer}.attn_k_b.weight" in types:  # DeepSeek's, split
        return {types[f"blk.{layer}.attn_k_b.weight"], types[f"blk.{layer}.attn_v_b.weight"]}
    table = get_tensor_name_map({name: a for a, name in MODEL_ARCH_NAMES.items()}[arch], 8)
    gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    return {types[gguf_name]}


def _stored_rounding(hf_name: str, value: torch.Tensor, qtype: GGMLQuantizationType, gpt_oss: bool) -> torch.Tensor:
    """``value`` rounded as the file stores it: Q8_0 blocks run along each matrix's input features
    (the last dimension, except in gpt-oss's transposed expert tensors)."""
    if qtype == GGMLQuantizationType.F32:
        return value
    if qtype == GGMLQuantizationType.F16:
        return value.half().float()
    transposed = gpt_oss and ".experts." in hf_name
    rows = value.transpose(-1, -2) if transposed else value
    data = np.ascontiguousarray(rows.numpy(), dtype=np.float32)
    rounded = torch.from_numpy(np.array(dequantize(quantize(data, qtype), qtype), dtype=np.float32)).reshape(rows.shape)
    return rounded.transpose(-1, -2).contiguous() if transposed else rounded


def _rounded_checkpoint(gguf_path: Path, hf_dir: Path, out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    reader = read_gguf(gguf_path)
    arch = str(read_metadata(reader, gguf_path)["general.architecture"])
    types = {t.name: t.tensor_type for t in reader.tensors}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2 or name.endswith("bias"):  # biases stay float32
                continue
            (qtype,) = _stored_types(name, arch, types)
            param.copy_(_stored_rounding(name, param.detach().clone(), qtype, arch == "gpt-oss"))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("case", MOE)
def test_q8_0_file_matches_transformers_on_its_rounded_weights(case, root, tmp_path):
    path = gguf_file(case, "q8_0", root)
    assert any(t.name.endswith("_exps.weight") and t.tensor_type.name == "Q8_0" for t in read_gguf(path).tensors)
    want = hf_greedy(_rounded_checkpoint(path, checkpoint(case, root), tmp_path / "rounded"), PROMPTS, 20)
    assert _greedy(path, quantization="none") == want
    # attention kept packed, and the experts where all three stacks are Q8_0 (their int8 kernels on
    # the exact activations); experts with a float stack (rows not whole blocks) dequantized at load
    assert _greedy(path, quant_exact_activations=True) == want


def test_mxfp4_experts_match_transformers(root):
    dense, _ = mxfp4_checkpoints(root)
    path = mxfp4_gguf_file(root)
    types = {t.name: t.tensor_type.name for t in read_gguf(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_down_exps.weight"] == "MXFP4"
    want = hf_greedy(dense, PROMPTS, 20)
    assert _greedy(path, quantization="none") == want
    # kept packed (the default): int8 groups of 32 holding the same values, beside float biases
    engine = _engine(path)
    layers = [m for m in engine.model.modules() if isinstance(m, StackedExperts)]
    assert layers and all(m.packed is not None and m.w13_bias is not None for m in layers)
    assert all(m.packed[0].gate_up.packed_format == m.packed[0].down.packed_format == "int8" for m in layers)
    assert _greedy(path) == want
    assert _greedy(path, quant_exact_activations=True) == want


def test_mixtral_is_llama_with_experts(root):
    assert family_for_gguf("llama", experts=True).architecture == "MixtralForCausalLM"
    assert family_for_gguf("llama", experts=False).architecture == "LlamaForCausalLM"
    path = gguf_file("mixtral", "f32", root)
    reader = read_gguf(path)
    cfg = gguf_config_dict(read_metadata(reader, path), {t.name for t in reader.tensors}, path)
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["mlp_only_layers"]) == (8, 2, [])


def test_a_family_without_experts_refuses_an_expert_file(tmp_path):
    meta = {"general.architecture": "phi3", "phi3.expert_count": 16, "phi3.attention.head_count": 4}
    with pytest.raises(UnsupportedModelError, match="phi3 GGUF with experts"):
        gguf_config_dict(meta, set(), tmp_path / "phimoe.gguf")


def test_a_missing_expert_tensor_is_a_clear_error(root, tmp_path):
    from gguf import GGUFWriter

    source = gguf_file("qwen3moe", "f32", root)
    reader = read_gguf(source)
    broken = tmp_path / "broken.gguf"
    writer = GGUFWriter(str(broken), arch="qwen3moe")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        if tensor.name != "blk.1.ffn_up_exps.weight":
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="experts of 'model.layers.1.mlp'"):
        _engine(broken)
