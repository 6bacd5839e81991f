"""DeepSeek-V2 GGUF files (llama.cpp's ``deepseek2``) written by llama.cpp's own converter: the
config comes back as the checkpoint's, ``kv_b_proj`` comes back bit for bit from the converter's
``attn_k_b`` / ``attn_v_b`` split, and generation runs token for token and logprob for logprob as
transformers on the checkpoint, for the variants the llama.cpp oracle cannot load or would route
otherwise: V2-Lite's q_proj (llama.cpp tells V2-Lite by its 27 layers) and V2's group-limited
routing (llama.cpp ranks groups by their two best scores); and files of older converters, with
``attn_kv_b`` whole. The ``deepseek2`` case itself (F32 and
Q8_0) runs in test_gguf_moe.py and, against llama-server, in test_gguf_vs_llama_cpp.py; here its
Q8_0 file runs as transformers on the values gguf's own dequantizer reads from the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, get_tensor_name_map
from gguf.quants import dequantize
from gguf_cases import CASES, VOCAB, checkpoint, gguf_file
from llama_cpp_converter import convert, write_llama_tokenizer
from model_factory import hf_greedy, make_hf_model
from safetensors.torch import load_file

from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ModelLoadError
from llmctl.models.gguf import gguf_config_dict, read_metadata
from llmctl.models.gguf_reader import read_gguf
from llmctl.sampling_params import SamplingParams

PROMPTS = [[5], list(range(10, 30)), list(range(40, 110))]
_CASE_OVERRIDES = CASES["deepseek2"][1]
# variants beside the ``deepseek2`` case: model_factory family and overrides
VARIANTS = {
    "lite": ("deepseek_v2_lite", {"rms_norm_eps": 1e-6}),
    "grouped": ("deepseek_v2", {"rms_norm_eps": 1e-6, "rope_parameters": _CASE_OVERRIDES["rope_parameters"]}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_deepseek")


def _variant(name: str, root: Path) -> tuple[Path, Path]:
    """(checkpoint, the converter's F32 file of it)."""
    family, overrides = VARIANTS[name]
    model_dir = root / f"deepseek-{name}"
    if not (model_dir / "config.json").is_file():
        make_hf_model(family, model_dir, seed=7, **overrides)
        write_llama_tokenizer(model_dir, VOCAB)
    out = root / f"deepseek-{name}-f32.gguf"
    return model_dir, out if out.is_file() else convert(model_dir, out, "f32", pre_tokenizer="default")


def _engine(model: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(model), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20, **kw)


def _greedy(model: Path, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return [out.outputs[0].token_ids for out in _engine(model, **kw).generate(PROMPTS, params)]


def _config_of(path: Path) -> dict:
    reader = read_gguf(path)
    return gguf_config_dict(read_metadata(reader, path), {t.name for t in reader.tensors}, path)


@pytest.mark.parametrize("name", ["case", *VARIANTS])
def test_config_is_the_checkpoints(name, root):
    model_dir, path = (
        (checkpoint("deepseek2", root), gguf_file("deepseek2", "f32", root)) if name == "case" else _variant(name, root)
    )
    want = json.loads((model_dir / "config.json").read_text())
    got = _config_of(path)
    fields = (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "num_key_value_heads",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "norm_topk_prob",
        "topk_method",
    )
    assert {f: got.get(f) for f in fields} == {f: want[f] for f in fields}
    if want["topk_method"] == "group_limited_greedy":
        assert (got["n_group"], got["topk_group"]) == (want["n_group"], want["topk_group"])
    rope = want["rope_parameters"]
    if rope["rope_type"] == "yarn":
        scaling = got["rope_scaling"]
        for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            assert scaling[key] == rope[key], key


def test_kv_b_proj_comes_back_bit_for_bit(root):
    engine = _engine(gguf_file("deepseek2", "f32", root))
    params = dict(engine.runner.model.named_parameters())
    stored = load_file(checkpoint("deepseek2", root) / "model.safetensors")
    kv_b = [name for name in stored if name.endswith("kv_b_proj.weight")]
    assert len(kv_b) == 3
    for name in kv_b:
        assert torch.equal(params[name], stored[name]), name


@pytest.mark.parametrize("name", list(VARIANTS))
def test_f32_file_matches_transformers(name, root):
    model_dir, path = _variant(name, root)
    assert _greedy(path) == hf_greedy(model_dir, PROMPTS, 20)
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[-1]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    (out,) = _engine(path).generate([prompt], params)
    tokens = out.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), want, rtol=0, atol=1e-4)


def _file_values(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file as gguf's own dequantizer reads it, in torch order."""
    return {
        t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(
            [int(d) for d in reversed(t.shape)]
        )
        for t in read_gguf(path).tensors
    }


def _checkpoint_from_file(path: Path, hf_dir: Path, out_dir: Path) -> Path:
    """The checkpoint with every weight replaced by the file's value: the experts restacked, and
    kv_b_proj from the converter's split (k_b ``[H, rank, nope]``, v_b ``[H, v, rank]``)."""
    from transformers import AutoModelForCausalLM

    values = _file_values(path)
    table = get_tensor_name_map(MODEL_ARCH.DEEPSEEK2, 8)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
            if name.endswith("experts.gate_up_proj"):
                value = torch.cat([values[f"{blk}.ffn_gate_exps.weight"], values[f"{blk}.ffn_up_exps.weight"]], 1)
            elif name.endswith("experts.down_proj"):
                value = values[f"{blk}.ffn_down_exps.weight"]
            elif name.endswith("kv_b_proj.weight"):
                k_b, v_b = values[f"{blk}.attn_k_b.weight"], values[f"{blk}.attn_v_b.weight"]
                value = torch.cat([k_b.transpose(1, 2), v_b], 1).flatten(0, 1)
            else:
                value = values[table.get_name(name, try_suffixes=(".weight",))]
            param.copy_(value.reshape(param.shape))
    model.save_pretrained(out_dir)
    return out_dir


def test_q8_0_file_matches_transformers_on_its_values(root, tmp_path):
    path = gguf_file("deepseek2", "q8_0", root)
    types = {t.name: t.tensor_type.name for t in read_gguf(path).tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.0.attn_q_a.weight"] == "Q8_0"
    want = hf_greedy(_checkpoint_from_file(path, checkpoint("deepseek2", root), tmp_path / "from-file"), PROMPTS, 20)
    assert _greedy(path, quantization="none") == want
    # the quantized projections kept packed (their int8 kernel on exact activations)
    assert _greedy(path, quant_exact_activations=True) == want


def _legacy_file(path: Path, out: Path) -> Path:
    """``path`` as older converters wrote it: ``attn_kv_b`` whole, per-head key and value lengths in
    ``key_length`` / ``value_length``, no ``*_mla`` keys, the checkpoint's KV heads."""
    from gguf import GGUFWriter

    reader = read_gguf(path)
    meta = read_metadata(reader, path)
    values = _file_values(path)
    lengths = {
        "deepseek2.attention.key_length": meta["deepseek2.attention.key_length_mla"],
        "deepseek2.attention.value_length": meta["deepseek2.attention.value_length_mla"],
        "deepseek2.attention.head_count_kv": meta["deepseek2.attention.head_count"],
    }
    writer = GGUFWriter(str(out), arch="deepseek2")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.endswith("_mla"):
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, lengths.get(key, field.contents()), field.types[0], sub_type)
    for tensor in reader.tensors:
        if tensor.name.endswith("attn_v_b.weight"):
            continue
        if tensor.name.endswith("attn_k_b.weight"):
            blk = tensor.name.rsplit(".", 2)[0]
            k_b, v_b = values[f"{blk}.attn_k_b.weight"], values[f"{blk}.attn_v_b.weight"]
            writer.add_tensor(f"{blk}.attn_kv_b.weight", torch.cat([k_b.transpose(1, 2), v_b], 1).flatten(0, 1).numpy())
            continue
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_file_with_kv_b_proj_whole_runs_as_the_checkpoint(root, tmp_path):
    path = _legacy_file(gguf_file("deepseek2", "f32", root), tmp_path / "legacy.gguf")
    want = json.loads((checkpoint("deepseek2", root) / "config.json").read_text())
    got = _config_of(path)
    assert (got["qk_nope_head_dim"], got["v_head_dim"]) == (want["qk_nope_head_dim"], want["v_head_dim"])
    assert _greedy(path) == hf_greedy(checkpoint("deepseek2", root), PROMPTS, 20)


def test_deepseek_v3_routing_is_refused(root):
    path = gguf_file("deepseek2", "f32", root)
    reader = read_gguf(path)
    meta = dict(read_metadata(reader, path), **{"deepseek2.expert_gating_func": 2})
    with pytest.raises(ModelLoadError, match="sigmoid routing"):
        gguf_config_dict(meta, {t.name for t in reader.tensors}, path)
