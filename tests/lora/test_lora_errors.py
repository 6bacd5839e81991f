"""Adapters that cannot be served are refused by name, each alone: the engine keeps serving the
others (and the base model) with the same tokens, and every KV block comes back."""

from __future__ import annotations

import json
import shutil

import pytest
from lora_factory import MAX_NEW, engine_with, make_adapter, run_alone
from model_factory import random_prompts

from llmctl.errors import ConfigError, InvalidRequestError
from llmctl.lora.adapter import LoRAAdapterError


def _edit_config(adapter_dir, tmp_path, name: str, **changes):
    copy = shutil.copytree(adapter_dir, tmp_path / name)
    config = json.loads((copy / "adapter_config.json").read_text())
    config.update(changes)
    (copy / "adapter_config.json").write_text(json.dumps(config))
    return copy


def test_bad_adapters_fail_alone(lora_bases, lora_adapters, tmp_path) -> None:
    base, adapters = lora_bases["llama"], lora_adapters["llama"]
    engine = engine_with(base, {"r8": adapters["r8"]}, max_lora_rank=16)
    prompt = random_prompts(1, 320, 8, 8, seed=1)[0]
    before = run_alone(engine, prompt, "r8")
    corrupt = shutil.copytree(adapters["r8"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    truncated = shutil.copytree(adapters["r8"], tmp_path / "truncated")
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    bad_json = shutil.copytree(adapters["r8"], tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    lm_head = make_adapter(base, tmp_path / "lm_head", rank=4, targets=["q_proj", "lm_head"], seed=1)
    cases = {
        tmp_path / "missing": "no such directory",
        corrupt: "cannot read adapter_model.safetensors",
        truncated: "cannot read adapter_model.safetensors",
        bad_json: "cannot read adapter_config.json",
        adapters["r64"]: "rank 64 exceeds --max-lora-rank 16",
        _edit_config(adapters["r8"], tmp_path, "dora", use_dora=True): "DoRA",
        _edit_config(adapters["r8"], tmp_path, "bias", bias="all"): "bias",
        lm_head: "embedding and lm_head targets are not supported",
        _edit_config(adapters["r8"], tmp_path, "big_pattern", rank_pattern={"q_proj": 32}): "rank 32 exceeds",
        _edit_config(adapters["r8"], tmp_path, "pattern_rank", rank_pattern={"v_proj": 4}): "gives it rank 4",
        _edit_config(adapters["r8"], tmp_path, "bad_regex", alpha_pattern={"q_proj(": 8}): "not a regular expr",
        _edit_config(adapters["r8"], tmp_path, "bad_alpha", alpha_pattern={"q_proj": -1}): "positive number",
    }
    for path, message in cases.items():
        with pytest.raises(LoRAAdapterError, match=message):
            engine.add_lora("bad", path)
        assert engine.lora_names() == ["r8"]  # nothing registered
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'"):
        engine.add_request(prompt, lora="nope")
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        engine.add_lora("r8", adapters["r8"])
    assert run_alone(engine, prompt, "r8") == before  # the engine serves on, unchanged
    assert not engine.block_manager.usage


def test_module_the_model_has_not_got(lora_bases, lora_adapters, tmp_path) -> None:
    """An adapter of another architecture (a target module this model lacks, or other shapes)."""
    from safetensors.torch import load_file, save_file

    base, adapters = lora_bases["llama"], lora_adapters["llama"]
    engine = engine_with(base, {}, enable_lora=True)
    foreign = shutil.copytree(adapters["r8"], tmp_path / "foreign")
    tensors = load_file(str(foreign / "adapter_model.safetensors"))
    save_file(
        {k.replace("q_proj", "c_attn"): v for k, v in tensors.items()}, str(foreign / "adapter_model.safetensors")
    )
    with pytest.raises(LoRAAdapterError, match="no linear module 'model.layers.0.self_attn.c_attn'"):
        engine.add_lora("foreign", foreign)
    other_base = lora_adapters["qwen3"]["r8"]  # qwen3's q_proj is 64 -> 128 (head_dim 32)
    with pytest.raises(LoRAAdapterError, match="another base model"):
        engine.add_lora("other", other_base)


def test_bad_adapter_at_start_is_a_config_error(lora_bases, tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such directory"):
        engine_with(lora_bases["llama"], {"gone": tmp_path / "gone"})


def test_engine_without_lora_refuses_adapters(lora_bases) -> None:
    engine = engine_with(lora_bases["llama"], {})  # no adapters, LoRA off
    assert engine.lora is None
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
        engine.add_request([1, 2, 3], lora="r8")
    assert run_alone(engine, [5, 6, 7], None) and len(run_alone(engine, [5, 6, 7], None)) == MAX_NEW
