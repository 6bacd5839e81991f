"""Bad input gets a clear error, allocates nothing, and the engine serves the next request."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ConfigError, InvalidRequestError, ModelLoadError, UnsupportedModelError
from llmctl.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(stories_dir):
    return LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20, max_model_len=64)


def assert_untouched(engine: LLMEngine) -> None:
    assert not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.has_unfinished()
    (out,) = engine.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=5))
    assert out.outputs[0].text == ", there was a little"


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ("word " * 80, {}, "max_model_len is 64"),
        ([1, 99999], {}, "token ids must be integers in [0, 512)"),
        ("hello", {"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ("hello", {"max_tokens": -3}, "max_tokens must be an integer >= 1"),
        ("hello", {"temperature": -0.5}, "temperature must be in [0, 100]"),
        ("hello", {"top_p": 0.0}, "top_p must be in (0, 1]"),
        ("hello", {"top_p": 1.5}, "top_p must be in (0, 1]"),
        ("hello", {"top_k": -2}, "top_k must be an integer >= -1"),
        ("hello", {"n": 0}, "n must be an integer >= 1"),
        ("hello", {"logprobs": 50}, "logprobs must be an integer in [0, 20]"),
        ("hello", {"stop": [""]}, "stop must be a list of non-empty strings"),
        ("hello", {"n": 2, "seed": 2**64 - 1}, "seed must be an integer in [-2**63, 2**64 - n]"),
    ],
)
def test_bad_request_is_refused_cleanly(engine, prompt, params, message):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt, _params(params))
    assert message in str(info.value)
    assert_untouched(engine)


def _params(kwargs: dict) -> SamplingParams:
    """Build without validation so the engine's own check is what refuses it."""
    params = object.__new__(SamplingParams)
    defaults = SamplingParams()
    params.__dict__.update(defaults.__dict__)
    params.__dict__.update(kwargs)
    return params


def test_sampling_params_validate_at_construction():
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)


def test_duplicate_request_id_refused(engine):
    engine.add_request("Once", SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("Once", SamplingParams(max_tokens=2), request_id="dup")
    while engine.has_unfinished():
        engine.step()
    assert_untouched(engine)


def test_abort_returns_every_block(engine):
    ids = [engine.add_request("Once upon a time", SamplingParams(max_tokens=40, ignore_eos=True)) for _ in range(3)]
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert all(engine.abort(i) for i in ids)
    assert not engine.abort(ids[0])
    assert_untouched(engine)


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="no such model directory"):
        LLMEngine(model="/nonexistent/model")


@pytest.fixture
def model_copy(tmp_path, llama_dir):
    dst = tmp_path / "model"
    shutil.copytree(llama_dir, dst)
    return dst


def test_unknown_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel is not supported"):
        LLMEngine(model=str(model_copy), skip_tokenizer=True)


def test_missing_weights_file(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        LLMEngine(model=str(model_copy), skip_tokenizer=True)


def test_corrupt_weights_file_is_named(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read safetensors file"):
        LLMEngine(model=str(model_copy), skip_tokenizer=True)


def test_garbage_header_is_named(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLMEngine(model=str(model_copy), skip_tokenizer=True)


def test_shape_mismatch_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight'.*shape"):
        LLMEngine(model=str(model_copy), skip_tokenizer=True)


def test_missing_tensor_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"lacks weights: model.layers.1.self_attn.qkv_proj.weight#k"):
        LLMEngine(model=str(model_copy), skip_tokenizer=True)


def test_missing_shard_of_index_is_named(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors: listed in"):
        LLMEngine(model=str(model_copy), skip_tokenizer=True)


def test_malformed_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        LLMEngine(model=str(model_copy), skip_tokenizer=True)


def test_kv_pool_too_small_for_max_model_len(llama_dir):
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        LLMEngine(model=str(llama_dir), skip_tokenizer=True, kv_cache_memory=4 * 4096, max_model_len=512)


def test_kv_pool_below_one_block_names_the_minimum(llama_dir):
    with pytest.raises(ConfigError, match=r"cannot hold a single KV block .*give --kv-cache-memory at least \d+KiB"):
        LLMEngine(model=str(llama_dir), skip_tokenizer=True, kv_cache_memory=1024)


def test_stop_strings_need_a_tokenizer(llama_dir):
    engine = LLMEngine(model=str(llama_dir), skip_tokenizer=True, kv_cache_memory=1 << 20)
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        engine.add_request([5, 6, 7], SamplingParams(stop=["x"]))
    assert not engine.requests


def test_kv_heads_that_tensor_parallelism_cannot_split():
    import torch

    from llmctl.distributed import TensorParallel
    from llmctl.layers.linear import QKVParallelLinear

    with pytest.raises(ValueError, match="6 KV heads cannot be split over tensor-parallel size 4"):
        QKVParallelLinear(64, 8, 8, 6, dtype=torch.float32, tp=TensorParallel(rank=0, size=4))
    QKVParallelLinear(64, 8, 8, 2, dtype=torch.float32, tp=TensorParallel(rank=3, size=4))  # replicated KV
