"""DeepSeek-V2 in the engine: the KV pool holds latents (bytes per token, tokens per pool), prefix
hits and chunking over the latent cache, the group-limited router against transformers', and what
MLA refuses (its exactness against transformers is test_models_exact.py's)."""

from __future__ import annotations

import pytest
import torch
from model_factory import hf_greedy, make_config, make_hf_model

from llmctl.errors import UnsupportedModelError
from llmctl.layers.moe import route
from llmctl.models.config import ModelConfig
from llmctl.models.deepseek_v2 import moe_router
from llmctl.sampling_params import SamplingParams

MEMORY = 8 << 20


def make_engine(model_dir, **kw):
    from llmctl.engine.llm_engine import LLMEngine

    kw.setdefault("kv_cache_memory", MEMORY)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def test_the_pool_holds_latents_and_as_many_more_tokens(hf_model_dirs, tmp_path):
    """KV per token and layer is kv_lora_rank + qk_rope_head_dim numbers (32 + 16 here), against
    2 x heads x head_dim for plain attention of the same heads and q/k head size (a Llama of 4 KV
    heads of 32): the same memory holds that many times the tokens."""
    cfg = make_config("deepseek_v2_lite")
    engine = make_engine(hf_model_dirs["deepseek_v2_lite"])
    latent_bytes = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert engine.kv_format.bytes_per_token() == latent_bytes == 576
    assert engine.stats_snapshot()["config"]["kv_bytes_per_token"] == latent_bytes
    assert f"{latent_bytes} B/token, latent KV (MLA)" in engine.kv_description
    block_size = engine.block_manager.block_size
    assert engine.block_manager.num_blocks == MEMORY // (block_size * latent_bytes)

    plain_dir = make_hf_model(
        "llama",
        tmp_path / "plain",
        num_hidden_layers=cfg.num_hidden_layers,
        num_key_value_heads=cfg.num_attention_heads,
        head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
    )
    plain = make_engine(plain_dir)
    plain_bytes = cfg.num_hidden_layers * 2 * cfg.num_attention_heads * 32 * 4
    assert plain.kv_format.bytes_per_token() == plain_bytes
    assert plain.block_manager.num_blocks == MEMORY // (block_size * plain_bytes)
    assert engine.block_manager.num_blocks >= plain.block_manager.num_blocks * plain_bytes // latent_bytes - 1


def test_prefix_hits_and_small_chunks_read_the_latent_cache(hf_model_dirs):
    """A second request over a cached prefix up-projects latents it did not compute; 8-token chunks
    read every earlier chunk's from the pool: both still give transformers' tokens."""
    model_dir = hf_model_dirs["deepseek_v2"]
    prefix = list(range(10, 44))
    prompts = [prefix + [5, 6, 7], prefix + [50, 51]]
    expected = hf_greedy(model_dir, prompts, 10)
    engine = make_engine(model_dir, max_num_batched_tokens=8)
    got = [
        engine.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
        for p in prompts
    ]
    assert got == expected
    assert engine.counters().prefix_cache_hits >= 32
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_group_limited_routing_is_transformers():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = make_config("deepseek_v2", hidden_size=32)
    hf = DeepseekV2TopkRouter(config)
    torch.manual_seed(0)
    hidden = torch.randn(64, 32)
    with torch.no_grad():
        hf.weight.normal_(0, 1.0)
        _, hf_weights, hf_ids = hf(hidden)
    spec = moe_router(ModelConfig.from_dict(config.to_dict()))
    assert (spec.num_groups, spec.topk_groups, spec.scaling_factor) == (2, 1, 1.5)
    weights, ids = route(hidden @ hf.weight.T, spec)
    hf_ids, order = hf_ids.sort(dim=-1)  # transformers takes the top-k unsorted
    ids, mine = ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights.gather(1, mine), hf_weights.gather(1, order), rtol=0, atol=1e-6)
    groups = ids // 4  # both experts of a token from one group of 4, and not always the same group
    assert torch.equal(groups[:, 0], groups[:, 1]) and groups.unique().numel() == 2


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype auto"),
        ({"kernel_backend": "triton"}, "--kernel-backend torch"),
        ({"quantization": "int8"}, "--quantization is not supported"),
    ],
)
def test_what_mla_does_not_take_is_refused_with_the_reason(hf_model_dirs, setting, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        make_engine(hf_model_dirs["deepseek_v2_lite"], **setting)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_holds_its_heads_of_the_latent_up_projection(rank):
    """kv_b_proj's rows are each head's key rows then its value rows: a rank keeps its heads' rows
    whether the checkpoint's tensor arrives as the loader's two row ranges or as llama.cpp's split
    (the whole model under torchrun: tests/parallel/test_parallel_exact.py)."""
    from llmctl.models.deepseek_v2 import LatentDims, LatentUpProjection

    heads, nope, v, rank_dim = 4, 3, 5, 6
    whole = torch.randn(heads * (nope + v), rank_dim)
    mine = whole.view(heads, nope + v, rank_dim)[2 * rank : 2 * rank + 2].reshape(-1, rank_dim)
    dims = LatentDims(2, None, rank_dim, nope, 2, v)
    from_ranges = LatentUpProjection(dims, torch.float32, heads, 2 * rank)
    for part, rows in zip("kv", whole.split(from_ranges.part_sizes), strict=True):
        from_ranges.weight_loader(from_ranges.weight, rows, part)
    assert torch.equal(from_ranges.weight, mine)
    per_head = whole.view(heads, nope + v, rank_dim)
    from_split = LatentUpProjection(dims, torch.float32, heads, 2 * rank)
    from_split.weight_loader(from_split.weight, per_head[:, :nope].transpose(1, 2), "k")
    from_split.weight_loader(from_split.weight, per_head[:, nope:], "v")
    assert torch.equal(from_split.weight, mine)


def test_a_tensor_parallel_rank_runs_its_share_of_the_heads():
    from llmctl.distributed import TensorParallel
    from llmctl.layers.ops import TorchOps
    from llmctl.models.loader import build_model

    cfg = ModelConfig.from_dict(make_config("deepseek_v2_lite").to_dict())
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps(), tp=TensorParallel(1, 2))
    attn = model.model.layers[0].self_attn
    assert attn.attn.num_heads == attn.dims.num_heads == cfg.num_heads // 2
    assert attn.kv_b_proj.first_head == cfg.num_heads // 2
    # the latent is computed whole on every rank: the cache holds what one process's does
    assert attn.kv_a_proj_with_mqa.weight.shape[0] == attn.dims.kv_lora_rank + attn.dims.rope_dim


def test_decodes_on_the_module_path_and_says_why(hf_model_dirs, monkeypatch):
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    engine = make_engine(hf_model_dirs["deepseek_v2_lite"])
    assert engine.runner.native_decode is None
    if engine.model.model.norm.ops.kernels.decode_loop_why_not() is None:  # the kernels would take it
        assert "multi-head latent attention" in engine.runner.decode_path
