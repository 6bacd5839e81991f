"""GGUF files written by llama.cpp's own converter (tests/llama_cpp_converter.py) from a tiny
random-weight Llama 3.1-style checkpoint (llama3 ``rope_scaling``, which the converter stores as the
``rope_freqs.weight`` factors): F32 runs token for token as transformers on the checkpoint, Q8_0 as
transformers on the weights the file dequantizes to."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_converter import convert, write_llama_tokenizer
from model_factory import hf_greedy, make_config, make_hf_model

from llmctl.engine.llm_engine import LLMEngine
from llmctl.models.gguf import gguf_config_dict, llama3_scaling_from_factors, read_metadata, rope_freqs_of
from llmctl.models.gguf_reader import read_gguf
from llmctl.sampling_params import SamplingParams

PROMPTS = [[5], list(range(10, 30)), list(range(40, 110))]  # the last beyond the original 64 positions


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama_cpp")
    model_dir = make_hf_model("llama", root / "llama31", seed=21)
    write_llama_tokenizer(model_dir, make_config("llama").vocab_size)
    files = {"hf": model_dir}
    for outtype in ("f32", "q8_0"):
        files[outtype] = convert(model_dir, root / f"llama31-{outtype}.gguf", outtype)
    return files


def _greedy(model: Path, n: int = 20, **kw) -> list[list[int]]:
    engine = LLMEngine(model=str(model), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20, **kw)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, params)]


def test_rope_freqs_give_back_the_llama3_parameters(converted):
    reader = read_gguf(converted["f32"])
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}
    meta = read_metadata(reader, converted["f32"])
    cfg = gguf_config_dict(meta, {t.name for t in reader.tensors}, converted["f32"], rope_freqs_of(reader))
    want = make_config("llama").rope_scaling
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": want["factor"],
        "low_freq_factor": want["low_freq_factor"],
        "high_freq_factor": want["high_freq_factor"],
        "original_max_position_embeddings": want["original_max_position_embeddings"],
    }


def test_rope_factors_that_fit_no_parameters_are_used_as_llama_cpp_does():
    scaling = llama3_scaling_from_factors([1.0, 1.0, 1.7, 2.9, 3.3, 8.0, 8.0, 8.0], 16, 10000.0)
    assert scaling == {"rope_type": "llama3", "freq_factors": [1.0, 1.0, 1.7, 2.9, 3.3, 8.0, 8.0, 8.0]}


def test_f32_file_matches_transformers(converted):
    assert _greedy(converted["f32"]) == hf_greedy(converted["hf"], PROMPTS, 20)


def _dequantized_checkpoint(gguf_path: Path, hf_dir: Path, out_dir: Path) -> Path:
    """The HF checkpoint with every weight replaced by the GGUF file's dequantized tensor."""
    from gguf import dequantize
    from transformers import AutoModelForCausalLM

    from llmctl.models.gguf import _hf_name, _unpermute_order

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for tensor in read_gguf(gguf_path).tensors:
            name = _hf_name(tensor.name)
            if name is None:
                continue
            values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            values = values.reshape(params[name].shape)
            proj = name.split(".")[-2]
            if proj in heads:
                values = values[_unpermute_order(values.shape[0], heads[proj])]
            params[name].copy_(values)
    model.save_pretrained(out_dir)
    return out_dir


def test_q8_0_file_matches_transformers_on_its_dequantized_weights(converted, tmp_path):
    reference = _dequantized_checkpoint(converted["q8_0"], converted["hf"], tmp_path / "dequantized")
    want = hf_greedy(reference, PROMPTS, 20)
    assert _greedy(converted["q8_0"], quantization="none") == want
    assert _greedy(converted["q8_0"]) == want  # kept packed, computed by the int8 kernels


YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "attention_factor": 1.25,
}


def test_a_yarn_file_from_the_converter_matches_transformers(tmp_path):
    """YaRN as the converter stores it (``rope.scaling.type`` yarn, factor, original context,
    attention factor, betas) runs token for token as transformers on the checkpoint."""
    model_dir = make_hf_model(
        "llama", tmp_path / "llama-yarn", seed=23, rope_scaling=dict(YARN)
    )  # transformers adds to the dict it is given
    write_llama_tokenizer(model_dir, make_config("llama").vocab_size)
    gguf_file = convert(model_dir, tmp_path / "llama-yarn.gguf", "f32")
    reader = read_gguf(gguf_file)
    cfg = gguf_config_dict(read_metadata(reader, gguf_file), {t.name for t in reader.tensors}, gguf_file)
    assert cfg["rope_scaling"] == YARN
    assert _greedy(gguf_file) == hf_greedy(model_dir, PROMPTS, 20)
