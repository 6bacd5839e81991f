"""DeepSeek-V2 and V2-Lite (transformers' ``DeepseekV2ForCausalLM``): Llama's pre-norm decoder
layer with multi-head latent attention and DeepSeek's mixture of experts.

- Attention (MLA, llmctl/layers/mla.py): queries from ``q_proj`` or, with ``q_lora_rank``, from
  ``q_b_proj(q_a_layernorm(q_a_proj(x)))``; ``kv_a_proj_with_mqa`` gives the compressed latent
  (``kv_lora_rank``, RMS-normed by ``kv_a_layernorm``) and one rotary key part shared by every
  head (``qk_rope_head_dim``); ``kv_b_proj`` up-projects the latent to each head's ``k_nope`` and
  value. The paged cache holds the latent and the rotated key part only. The rotary embedding
  rotates interleaved pairs (dims ``2i, 2i + 1``), as transformers' complex ``apply_rotary_emb``:
  here the rope dims of q and k are reordered to rotate-half's layout first (the same reordering
  on both sides of the dot product). With YaRN the softmax scale is ``qk_head_dim ** -0.5`` times
  ``mscale(factor, mscale_all_dim) ** 2``, as transformers' ``yarn_apply_mscale``.
- Feed-forward: dense MLPs on the first ``first_k_dense_replace`` layers (and, with
  ``moe_layer_freq`` > 1, on layers off its stride), elsewhere routed experts (softmax scores,
  ``topk_method`` ``greedy`` or ``group_limited_greedy`` over ``n_group`` groups keeping
  ``topk_group``, weights times ``routed_scaling_factor``) plus ``n_shared_experts`` shared
  experts as one MLP every token runs. ``norm_topk_prob`` renormalizes the chosen weights before
  the scaling, as vLLM does; transformers ignores the field (no released V2 checkpoint sets it).
- The small norms inside attention (``q_a_layernorm``, ``kv_a_layernorm``) use eps 1e-6 whatever
  ``rms_norm_eps`` says, as transformers builds them.

GGUF files (llama.cpp's ``deepseek2``, llmctl/models/gguf.py): ``deepseek_gguf_config`` turns the
metadata back into this config, and ``kv_b_proj`` is put together from the converter's
``attn_k_b`` / ``attn_v_b`` halves (``LatentUpProjection``); the stacked experts load as the MoE
families' (``gguf_expert_tensors``).

Tensor parallel: each rank runs its share of the heads and computes the latent whole, so its cache
holds what one process's does; the experts shard as the MoE families'.

Refused, with the reason: ``--quantization`` (the latent attention is not quantized on the fly)
and the Triton kernels (the latent attention is a torch reference); quantized KV
pools are refused when the pool is bound (llmctl/layers/mla.py). Defaults of fields a config.json leaves out are
``DeepseekV2Config``'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.errors import UnsupportedModelError
from llmctl.layers.linear import ColumnParallelLinear, LinearMethod, RowParallelLinear, copy_checked
from llmctl.layers.mla import LatentAttention
from llmctl.layers.moe import RouterSpec, SparseMoeBlock
from llmctl.layers.norm import RMSNorm
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.rotary import RotaryEmbedding, rope_type_of, yarn_get_mscale
from llmctl.models.config import ModelConfig
from llmctl.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from llmctl.models.moe_families import gguf_expert_tensors as gguf_expert_tensors  # the registry's hook

# DeepseekV2Config's defaults (num_experts_per_tok: DeepSeek-V2's 6, where the config has None)
_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "moe_intermediate_size": 1407,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": None,
    "topk_group": None,
    "norm_topk_prob": False,
}
_LATENT_NORM_EPS = 1e-6  # DeepseekV2RMSNorm's default, which q_a_layernorm and kv_a_layernorm keep


def _field(cfg: ModelConfig, name: str) -> Any:
    """config.json's value (an explicit null included: V2-Lite's ``q_lora_rank``), else the default."""
    return cfg.raw[name] if name in cfg.raw else _DEFAULTS[name]


@dataclass(frozen=True)
class LatentDims:
    """The sizes of one MLA layer, from config.json."""

    num_heads: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> LatentDims:
        q_lora_rank = _field(cfg, "q_lora_rank")
        return cls(
            cfg.num_heads,
            None if q_lora_rank is None else int(q_lora_rank),
            int(_field(cfg, "kv_lora_rank")),
            int(_field(cfg, "qk_nope_head_dim")),
            int(_field(cfg, "qk_rope_head_dim")),
            int(_field(cfg, "v_head_dim")),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.nope_dim + self.rope_dim


def softmax_scale(cfg: ModelConfig, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a rope scaling
    that sets ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    scaling = cfg.rope_scaling or {}
    mscale_all_dim = scaling.get("mscale_all_dim", 0)
    if rope_type_of(scaling) != "default" and mscale_all_dim:
        mscale = yarn_get_mscale(float(scaling["factor"]), float(mscale_all_dim))
        scale = scale * mscale * mscale
    return scale


def to_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs ``(x0, x1), (x2, x3), ...`` reordered to ``x0, x2, ..., x1, x3, ...``, the
    layout the rotate-half kernels rotate as those pairs."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def moe_router(cfg: ModelConfig) -> RouterSpec:
    method = _field(cfg, "topk_method")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(
            f"{cfg.architecture}: topk_method {method!r} is not implemented (greedy, group_limited_greedy)"
        )
    grouped = method == "group_limited_greedy"
    return RouterSpec(
        int(_field(cfg, "n_routed_experts")),
        int(_field(cfg, "num_experts_per_tok")),
        norm_topk_prob=bool(_field(cfg, "norm_topk_prob")),
        num_groups=int(_field(cfg, "n_group")) if grouped else 1,
        topk_groups=int(_field(cfg, "topk_group")) if grouped else 1,
        scaling_factor=float(_field(cfg, "routed_scaling_factor")),
    )


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """DeepSeek-V2's rule: experts from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
    if not _field(cfg, "n_routed_experts"):
        return False
    return layer >= int(_field(cfg, "first_k_dense_replace")) and layer % int(_field(cfg, "moe_layer_freq")) == 0


class LatentUpProjection(nn.Module):
    """``kv_b_proj``'s ``[heads * (nope_dim + v_dim), kv_lora_rank]`` weight, kept as stored (each
    head's key rows, then its value rows): prefill multiplies by it, decode reads its key and value
    rows apart (llmctl/layers/mla.py). Under tensor parallelism a rank holds its own heads' rows,
    ``heads`` from ``first_head`` of the checkpoint's ``total_heads``.

    To the checkpoint loader it is a projection merged of two parts, ``k`` and ``v``
    (``DeepseekV2ForCausalLM.packed_modules``), so that a GGUF file's halves (``k_b_proj``, ``v_b_proj``)
    come together here. A checkpoint's whole ``kv_b_proj`` arrives as two ranges of its rows
    (``part_sizes``), and the rows of this rank's heads are copied where they lie."""

    def __init__(self, dims: LatentDims, dtype: torch.dtype, total_heads: int, first_head: int = 0) -> None:
        super().__init__()
        self.dims, self.tp = dims, TensorParallel()  # the loader's split: whole-checkpoint part sizes
        self.total_heads, self.first_head = total_heads, first_head
        self.part_sizes = [total_heads * dims.nope_dim, total_heads * dims.v_dim]
        rows = dims.num_heads * (dims.nope_dim + dims.v_dim)
        self.weight = nn.Parameter(torch.empty(rows, dims.kv_lora_rank, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """``loaded``: 2-D, a range of the checkpoint's rows (part ``k`` the first ``part_sizes[0]``);
        3-D, llama.cpp's split (``k``: ``[heads, kv_lora_rank, nope_dim]``, each head's key rows
        transposed; ``v``: ``[heads, v_dim, kv_lora_rank]``), put back into each head's rows."""
        first, dims = shard_id == "k", self.dims
        if loaded.dim() == 2:
            start = 0 if first else self.part_sizes[0]
            if start + loaded.shape[0] > sum(self.part_sizes):
                raise ValueError(f"kv_b_proj part {shard_id}: {loaded.shape[0]} rows from row {start} overrun it")
            per_head = dims.nope_dim + dims.v_dim
            mine = (self.first_head * per_head, (self.first_head + dims.num_heads) * per_head)
            lo, hi = max(start, mine[0]), min(start + loaded.shape[0], mine[1])
            if lo < hi:
                copy_checked(
                    param.data[lo - mine[0] : hi - mine[0]],
                    loaded[lo - start : hi - start],
                    f"kv_b_proj part {shard_id}",
                )
            return
        heads = slice(self.first_head, self.first_head + dims.num_heads)
        per_head = param.data.view(dims.num_heads, dims.nope_dim + dims.v_dim, dims.kv_lora_rank)
        rows = per_head[:, : dims.nope_dim] if first else per_head[:, dims.nope_dim :]
        copy_checked(rows, loaded[heads].transpose(1, 2) if first else loaded[heads], f"kv_b_proj part {shard_id}")


class DeepseekV2Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel, ops: TorchOps, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__()
        whole = LatentDims.of(cfg)
        heads, bias = whole.num_heads, cfg.attention_bias
        # Tensor parallel: each rank runs its share of the heads (q and kv_b_proj by rows, o_proj by
        # columns, one all-reduce); the latent and its norm are computed whole on every rank, so each
        # rank's cache holds the same latent as one process's
        dims = self.dims = dataclasses.replace(whole, num_heads=tp.shard(heads, "attention heads"))
        replicated = TensorParallel()
        q_out = heads * dims.qk_head_dim
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, q_out, dtype=dtype, tp=tp)
        else:
            self.q_a_proj = ColumnParallelLinear(
                cfg.hidden_size, dims.q_lora_rank, bias=bias, dtype=dtype, tp=replicated
            )
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, _LATENT_NORM_EPS, dtype=dtype, ops=ops)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, q_out, dtype=dtype, tp=tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            cfg.hidden_size, dims.kv_lora_rank + dims.rope_dim, bias=bias, dtype=dtype, tp=replicated
        )
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, _LATENT_NORM_EPS, dtype=dtype, ops=ops)
        self.kv_b_proj = LatentUpProjection(dims, dtype, heads, tp.rank * dims.num_heads)
        self.o_proj = RowParallelLinear(heads * dims.v_dim, cfg.hidden_size, bias=bias, dtype=dtype, tp=tp)
        self.rotary_emb = rotary_emb  # one table shared by every layer
        scale = softmax_scale(cfg, dims.qk_head_dim)
        self.attn = LatentAttention(dims.num_heads, dims.kv_lora_rank, dims.nope_dim, dims.rope_dim, dims.v_dim, scale)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        dims, num_tokens = self.dims, hidden.shape[0]
        if dims.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))[0])
        q_nope, q_pe = q.view(num_tokens, dims.num_heads, dims.qk_head_dim).split((dims.nope_dim, dims.rope_dim), -1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split((dims.kv_lora_rank, dims.rope_dim), -1)
        latent = self.kv_a_layernorm(latent.contiguous())[0]
        q_pe, k_pe = self.rotary_emb(positions, to_rotate_half(q_pe), to_rotate_half(k_pe[:, None]))
        return self.o_proj(self.attn(q_nope, q_pe, latent, k_pe[:, 0], self.kv_b_proj.weight, meta))


class DeepseekV2MoE(SparseMoeBlock):
    """Routed experts plus, when the config has them, the shared experts as one MLP
    (``shared_experts``, transformers' name), added without a gate."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel, ops: TorchOps, method: LinearMethod | None
    ) -> None:
        intermediate = int(_field(cfg, "moe_intermediate_size"))
        super().__init__(
            cfg.hidden_size,
            intermediate,
            moe_router(cfg),
            dtype=dtype,
            tp=tp,
            act=ops.silu_and_mul,
            fused_experts=ops.fused_experts,
        )
        shared = int(_field(cfg, "n_shared_experts") or 0)
        self.shared_experts = (
            LlamaMLP(dataclasses.replace(cfg, intermediate_size=intermediate * shared), dtype, tp, ops, method)
            if shared
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer and forward with MLA; ``mlp`` is set by ``DeepseekV2Model``, which knows the
    layer's index."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.self_attn = DeepseekV2Attention(cfg, dtype, tp, ops, rotary_emb)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, ops=ops)
        self.mlp: nn.Module | None = None


class DeepseekV2Model(LlamaModel):
    decoder_layer_cls = DeepseekV2DecoderLayer

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__(cfg, dtype, tp, ops, method, stage)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, DeepseekV2DecoderLayer):  # not another pipeline stage's
                moe = is_moe_layer(cfg, i)
                layer.mlp = DeepseekV2MoE(cfg, dtype, tp, ops, method) if moe else LlamaMLP(cfg, dtype, tp, ops, method)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV2Model
    packed_modules = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "k_b_proj": ("kv_b_proj", "k"),  # a GGUF file's kv_b_proj, split (LatentUpProjection)
        "v_b_proj": ("kv_b_proj", "v"),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype,
        ops: TorchOps,
        tp: TensorParallel = TensorParallel(),
        linear_method: LinearMethod | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        refusal = None
        if linear_method is not None:
            refusal = "--quantization is not supported (its latent attention is not quantized on the fly yet); use none"
        elif ops.name != TorchOps.name:
            refusal = f"the {ops.name} kernels do not take multi-head latent attention; run with --kernel-backend torch"
        if refusal is not None:
            raise UnsupportedModelError(f"{cfg.architecture}: {refusal}")
        # the rotary table spans the rope part of a head (config.json's head_dim may be absent)
        cfg = dataclasses.replace(cfg, head_dim=int(_field(cfg, "qk_rope_head_dim")))
        super().__init__(cfg, dtype=dtype, ops=ops, tp=tp, linear_method=None, stage=stage)


def _float32(value: float) -> float:
    """A float32 from the file as the shortest decimal that gives it back (config.json's value)."""
    return float(str(np.float32(value)))


def deepseek_gguf_config(cfg: dict[str, Any], field: Callable[..., Any], tensors: dict[str, list[float]]) -> None:
    """The config of a llama.cpp ``deepseek2`` file (the registry's ``gguf_metadata`` copied the
    plain fields): the converter writes MLA as one KV head of ``kv_lora_rank + rope`` dims and
    keeps the per-head sizes in ``key_length_mla`` / ``value_length_mla`` (older files: in
    ``key_length`` / ``value_length``); ``yarn_log_multiplier`` is ``0.1 * mscale_all_dim``, and
    llama.cpp takes the rotary ``mscale`` equal to it. Expert groups route as the checkpoint does
    (``group_limited_greedy``: a group's best score)."""
    from gguf import ExpertGatingFuncType

    gating = field("expert_gating_func", ExpertGatingFuncType.SOFTMAX)
    if gating != ExpertGatingFuncType.SOFTMAX:
        raise ValueError(
            f"expert_gating_func {gating} (DeepSeek-V3's sigmoid routing) is not supported; "
            "llmctl reads DeepSeek-V2 files (softmax routing)"
        )
    rope_dim = int(field("rope.dimension_count"))
    cfg.update(
        num_key_value_heads=cfg["num_attention_heads"],
        head_dim=rope_dim,
        q_lora_rank=field("attention.q_lora_rank", None),  # absent: V2-Lite's q_proj
        qk_nope_head_dim=int(field("attention.key_length_mla", None) or field("attention.key_length")) - rope_dim,
        v_head_dim=int(field("attention.value_length_mla", None) or field("attention.value_length")),
        norm_topk_prob=bool(field("expert_weights_norm", False)),  # written only when true
    )
    groups = int(cfg.get("n_group") or 1)
    grouped = int(cfg.get("topk_group") or groups) < groups
    cfg["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    log_mul = field("rope.scaling.yarn_log_multiplier", None)
    if cfg.get("rope_scaling") and log_mul is not None:
        mscale = _float32(float(np.float32(log_mul)) / 0.1)
        cfg["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)
