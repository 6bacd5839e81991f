"""The mixture-of-experts layer (llmctl/layers/moe.py): the fused expert computation against a dense
per-expert reference, that unchosen experts are never read, batch invariance, the router against
transformers', checkpoint layouts, tensor-parallel sharding, and what is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_factory import make_config, make_hf_model
from safetensors.torch import load_file, save_file

from llmctl.distributed import TensorParallel
from llmctl.errors import ModelLoadError
from llmctl.layers.moe import (
    ExpertShard,
    RouterSpec,
    SparseMoeBlock,
    StackedExperts,
    expert_checkpoint_target,
    expert_stats,
    route,
)
from llmctl.layers.ops import TorchOps
from llmctl.layers.quantization import linear_method_for
from llmctl.models.config import ModelConfig
from llmctl.models.loader import build_model, init_random_weights, load_model
from llmctl.platform import native_gemm
from llmctl_kernels.activation import silu_and_mul_torch

E, H, I = 6, 24, 20  # noqa: E741


def _experts(dtype: torch.dtype, seed: int = 0, tp: TensorParallel = TensorParallel()) -> StackedExperts:
    experts = StackedExperts(E, H, I, dtype=dtype, tp=tp, act=silu_and_mul_torch)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64).to(dtype) * 0.3)
        experts.w2.copy_(torch.randn(E, H, I, generator=gen, dtype=torch.float64).to(dtype) * 0.3)
    return experts


def _dense_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """Every expert over every token (float64), then each token's chosen ones, weighted and summed."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    per_expert = torch.stack([F.linear(silu_and_mul_torch(F.linear(x, w13[e])), w2[e]) for e in range(E)])  # [E, T, H]
    tokens = torch.arange(x.shape[0])[:, None]
    return (per_expert[ids, tokens] * weights[..., None]).sum(1)


def _routing(num_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 routing where expert 0 takes every token, expert 1 exactly one, expert 5 none, and the
    others a random share."""
    gen = torch.Generator().manual_seed(seed)
    second = torch.randint(2, 5, (num_tokens,), generator=gen)
    second[num_tokens // 2] = 1
    ids = torch.stack([torch.zeros(num_tokens, dtype=torch.long), second], 1)
    swap = torch.rand(num_tokens, generator=gen) < 0.5  # slot order does not follow expert order
    ids[swap] = ids[swap].flip(1)
    weights = torch.rand(num_tokens, 2, generator=gen, dtype=torch.float64)
    return weights / weights.sum(1, keepdim=True), ids


def test_fused_experts_match_a_dense_reference_in_float64():
    experts = _experts(torch.float64)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    weights, ids = _routing(11)
    out = experts(x, weights, ids)
    torch.testing.assert_close(out, _dense_reference(x, experts.w13, experts.w2, weights, ids), rtol=1e-12, atol=1e-12)
    counts = experts.recent_counts[-1].tolist()
    assert counts == torch.bincount(ids.flatten(), minlength=E).tolist()
    assert (counts[0], counts[1], counts[5]) == (11, 1, 0)  # every token, one token, none


@pytest.mark.parametrize("num_tokens", [0, 1, 2, 40])
def test_fused_experts_float32_with_its_cpu_layout(num_tokens):
    """fp32: after ``process_weights_after_loading`` (panels for the native GEMM where it runs)."""
    experts = _experts(torch.float32)
    w13, w2 = experts.w13.data.clone(), experts.w2.data.clone()
    experts.process_weights_after_loading()
    assert experts.panels == (native_gemm() is not None)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(3))
    weights, ids = _routing(num_tokens) if num_tokens else (torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    out = experts(x, weights.float(), ids)
    assert out.shape == (num_tokens, H) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _dense_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_experts_no_token_chose_are_never_read(dtype):
    experts = _experts(dtype)
    with torch.no_grad():
        experts.w13[5].fill_(float("nan"))
        experts.w2[5].fill_(float("nan"))
    experts.process_weights_after_loading()
    x = torch.randn(9, H, dtype=dtype)
    weights, ids = _routing(9)
    out = experts(x, weights.to(dtype), ids)
    assert torch.isfinite(out).all()


@pytest.mark.skipif(native_gemm() is None, reason="the native fp32 panel GEMM does not run here")
def test_a_tokens_output_does_not_depend_on_its_batch():
    """With the native panel GEMM each row's product is summed in k order whatever the batch, so a
    token's output is bitwise the same alone and among 16 (the router's softmax and top-k are
    per row). ``F.linear`` makes no such promise: there it is equal within float rounding."""
    torch.manual_seed(4)
    spec = RouterSpec(E, 2, norm_topk_prob=True)
    block = SparseMoeBlock(H, I, spec, dtype=torch.float32, tp=TensorParallel(), act=TorchOps().silu_and_mul)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    block.experts.process_weights_after_loading()
    block.gate.process_weights_after_loading()
    x = torch.randn(16, H)
    batched = block(x)
    for i in range(16):
        assert torch.equal(block(x[i : i + 1])[0], batched[i]), i


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_route_matches_transformers_router(family):
    """Softmax in fp32, top-k, renormalization (Mixtral always, Qwen2-MoE per norm_topk_prob), and
    the weights' dtype."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    config = make_config(family)
    hf = (MixtralTopKRouter if family == "mixtral" else Qwen2MoeTopKRouter)(config)
    torch.nn.init.normal_(hf.weight, std=0.5)
    x = torch.randn(32, config.hidden_size, dtype=torch.float64)
    hf = hf.double()
    logits, hf_weights, hf_ids = hf(x)
    num_experts = config.num_local_experts if family == "mixtral" else config.num_experts
    spec = RouterSpec(
        num_experts,
        config.num_experts_per_tok,
        norm_topk_prob=family == "mixtral" or config.norm_topk_prob,
        weights_dtype="float32" if family == "mixtral" else "input",
    )
    weights, ids = route(logits, spec)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype
    assert torch.equal(weights, hf_weights)


def test_router_spec_refuses_what_is_not_implemented():
    with pytest.raises(ValueError, match="scoring 'sigmoid' is not implemented"):
        RouterSpec(8, 2, scoring="sigmoid")
    with pytest.raises(ValueError, match="grouped top-k"):
        RouterSpec(8, 2, num_groups=3, topk_groups=2)
    with pytest.raises(ValueError, match="top_k=9"):
        RouterSpec(8, 9)


def test_checkpoint_names_map_to_the_stacked_parameters():
    layer = "model.layers.3"
    assert expert_checkpoint_target(f"{layer}.block_sparse_moe.experts.7.w1.weight") == (
        f"{layer}.mlp.experts.w13",
        ExpertShard(7, "gate"),
    )
    assert expert_checkpoint_target(f"{layer}.block_sparse_moe.experts.0.w2.weight")[1] == ExpertShard(0, "down")
    assert expert_checkpoint_target(f"{layer}.block_sparse_moe.gate.weight") == (f"{layer}.mlp.gate.weight", None)
    assert expert_checkpoint_target(f"{layer}.mlp.experts.12.up_proj.weight") == (
        f"{layer}.mlp.experts.w13",
        ExpertShard(12, "up"),
    )
    assert expert_checkpoint_target(f"{layer}.mlp.experts.gate_up_proj") == (
        f"{layer}.mlp.experts.w13",
        ExpertShard(None, "gate_up"),
    )
    assert expert_checkpoint_target(f"{layer}.mlp.experts.down_proj")[1] == ExpertShard(None, "down")
    for other in ("mlp.gate.weight", "mlp.shared_expert.gate_proj.weight", "mlp.gate_proj.weight"):
        assert expert_checkpoint_target(f"{layer}.{other}") is None


def test_stacked_expert_checkpoints_load_as_per_expert_ones(tmp_path):
    """transformers' in-memory layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) loads into the same weights as the per-expert tensors it saves."""
    per_expert = make_hf_model("qwen3_moe", tmp_path / "per_expert", seed=5)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((per_expert / "config.json").read_text())
    tensors = load_file(per_expert / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            out[name] = tensor
        elif name.endswith(".experts.0.gate_proj.weight"):
            prefix = name.removesuffix("0.gate_proj.weight")
            count = sum(1 for n in tensors if n.startswith(prefix) and n.endswith(".down_proj.weight"))
            gate = torch.stack([tensors[f"{prefix}{e}.gate_proj.weight"] for e in range(count)])
            up = torch.stack([tensors[f"{prefix}{e}.up_proj.weight"] for e in range(count)])
            out[f"{prefix}gate_up_proj"] = torch.cat([gate, up], 1)
            out[f"{prefix}down_proj"] = torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in range(count)])
    save_file(out, stacked / "model.safetensors")
    kw = {"dtype": "float32", "device": torch.device("cpu"), "ops": TorchOps()}
    a = load_model(per_expert, **kw).state_dict()
    b = load_model(stacked, **kw).state_dict()
    assert a.keys() == b.keys() and any(".experts.w13" in name for name in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_missing_expert_is_named(tmp_path):
    model_dir = make_hf_model("mixtral", tmp_path / "m", seed=6)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.w13#3\.up"):
        load_model(model_dir, dtype="float32", device=torch.device("cpu"), ops=TorchOps())


def test_tensor_parallel_ranks_hold_slices_whose_partial_sums_add_up():
    """Each rank holds its slice of every expert's intermediate features; the partial outputs sum
    (the block's all-reduce) to the unsharded result."""
    full = _experts(torch.float64)
    x = torch.randn(13, H, dtype=torch.float64)
    weights, ids = _routing(13)
    want = full(x, weights, ids)
    partials = []
    for rank in range(2):
        shard = StackedExperts(E, H, I, dtype=torch.float64, tp=TensorParallel(rank, 2), act=silu_and_mul_torch)
        for e in range(E):  # per-expert tensors for rank 0, stacked ones for rank 1
            if rank == 0:
                gate, up = full.w13.data[e].chunk(2)
                shard.weight_loader(shard.w13, gate, ExpertShard(e, "gate"))
                shard.weight_loader(shard.w13, up, ExpertShard(e, "up"))
                shard.weight_loader(shard.w2, full.w2.data[e], ExpertShard(e, "down"))
        if rank == 1:
            shard.weight_loader(shard.w13, full.w13.data, ExpertShard(None, "gate_up"))
            shard.weight_loader(shard.w2, full.w2.data, ExpertShard(None, "down"))
        assert shard.w13.shape == (E, I, H) and shard.w2.shape == (E, H, I // 2)
        partials.append(shard(x, weights, ids))
    torch.testing.assert_close(partials[0] + partials[1], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_quantization_packs_the_experts_and_the_shared_expert_and_keeps_the_gates_float(kind):
    """Qwen2-MoE (tests/layers/test_moe_quantized.py runs Qwen3-MoE and Mixtral end to end): the
    routed experts packed, the shared expert's layers packed as dense layers, its gate and the
    router float."""
    cfg = ModelConfig.from_dict(make_config("qwen2_moe").to_dict() | {"architectures": ["Qwen2MoeForCausalLM"]})
    model = build_model(
        cfg, dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps(), linear_method=linear_method_for(kind)
    )
    init_random_weights(model, seed=0)
    model.process_weights_after_loading()
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(blocks) == 2  # the middle layer is dense (mlp_only_layers)
    for block in blocks:
        assert block.experts.w13 is None and len(block.experts.packed) == block.experts.num_experts
        assert block.experts.packed[0].gate_up.packed_format == block.experts.packed[0].down.packed_format == kind
        assert block.shared_expert.gate_up_proj.packed_format == kind
        assert all("qweight" not in m._parameters for m in (block.gate, block.shared_expert_gate))  # still float
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(blocks[0](x)).all()


def test_qwen2_moe_layers_follow_mlp_only_layers_and_sparse_step():
    from llmctl.layers.moe import SparseMoeBlock as Block
    from llmctl.models.llama import LlamaMLP

    raw = make_config("qwen2_moe", num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2).to_dict()
    cfg = ModelConfig.from_dict(raw | {"architectures": ["Qwen2MoeForCausalLM"]})
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps())
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [LlamaMLP, Block, LlamaMLP, Block]  # layer 0 listed; (i + 1) % 2 for the others
    assert model.model.layers[1].mlp.shared_expert is not None
    assert model.model.layers[1].self_attn.qkv_proj.bias is not None


def test_expert_stats_count_every_routed_token():
    cfg = ModelConfig.from_dict(make_config("mixtral").to_dict() | {"architectures": ["MixtralForCausalLM"]})
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps())
    assert expert_stats(model)["layers"][0]["steps"] == 0
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
        block = model.model.layers[0].mlp
        for num_tokens in (5, 3):
            block(torch.randn(num_tokens, cfg.hidden_size))
    stats = expert_stats(model)
    first = stats["layers"][0]
    assert first["layer"] == "model.layers.0" and first["steps"] == 2
    assert sum(first["tokens"]) == (5 + 3) * 2 and len(first["tokens"]) == 8
    # layer 0 read at most 8 and 6 of its 8 experts in the two passes; layer 1 ran none
    assert 0.0 < stats["read_share_per_step"] <= (8 + 6) / 2 / 16
    assert stats["weight_bytes"] == 2 * 8 * (2 * 48 * 64 + 64 * 48) * 4
