"""Decode-only steps through the native decode loop (kernels/cpu/decode_loop.cpp): the model's
weights are bound once into a C++ layer list, and a step whose every row is one token of its
own sequence runs all decoder layers in one call instead of ~9 Python-dispatched kernel calls a
layer. Same kernels in the same order: the logits are bit-identical to the module path, which stays
the reference and runs prefill and mixed steps, and every model or setting the loop does not take
(``why_not`` names it; the engine's startup line shows it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from llmctl.layers.attention import Attention
from llmctl.layers.linear import LinearBase, RowParallelLinear, UnquantizedLinearMethod
from llmctl.layers.moe import Router, SparseMoeBlock, StackedExperts
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.models.gpt_oss import GptOssMLP
from llmctl.models.llama import LlamaDecoderLayer, LlamaMLP
from llmctl.models.registry import CausalLM, family_for
from llmctl.platform import cpu_isa, decode_loop_kernels, quant_native_takes, select_kernels

if TYPE_CHECKING:
    from llmctl.engine.kv_cache import QuantizedKVCache
    from llmctl.lora.manager import LoRAManager

ACTIVE = "decode: native loop"
# Activation dtypes the loop takes: float32 with every kind of weight and KV cache it knows; bfloat16
# (the auto dtype where the CPU computes it natively) with oneDNN-prepacked weights and a bf16 KV pool.
LOOP_DTYPES = (torch.float32, torch.bfloat16)


class LoopLoRA:
    """The engine's LoRA adapters inside the loop: every projection's slot stacks bound to it (again
    after each adapter copied into a slot, which may add a stack), and each step's rows by slot. The
    loop adds the deltas with the native kernel the module path calls (same bits)."""

    def __init__(self, loop: object, manager: LoRAManager, layers: list) -> None:
        self.loop, self.manager = loop, manager
        self.projections = [
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for layer in layers
        ]
        self.bound_loads = -1  # LoRASlots.loads when last bound

    def begin_step(self) -> None:
        """Hand the loop this step's plan (none: the step adds no delta; the loop drops a plan once used)."""
        plan = self.manager.batch.plan
        if plan is None:
            return
        if self.manager.slots.loads != self.bound_loads:
            for i, projections in enumerate(self.projections):
                for p, linear in enumerate(projections):
                    self.loop.set_lora(i, p, linear.lora.bound_stacks() if linear.lora is not None else [])
            self.bound_loads = self.manager.slots.loads
        self.loop.set_lora_plan(plan.spans)


class NativeDecode:
    """``(input_ids, positions, meta) -> final hidden states`` of a decode-only step."""

    def __init__(
        self,
        loop: object,
        embed: Callable[[torch.Tensor], torch.Tensor],
        kivi: QuantizedKVCache | None = None,
        lora: LoopLoRA | None = None,
        moe_experts: list[StackedExperts] | None = None,
    ) -> None:
        self.loop = loop  # set_profile / profile: per-op times (benchmarks/features/decode_breakdown.py)
        self._forward = loop.forward
        self._embed = embed
        self._kivi = kivi  # a KIVI pool: each step passes the plan its begin_batch made
        self._lora = lora  # the engine's LoRA adapters: each step passes its rows by slot
        self._moe_experts = moe_experts or []  # each step's expert counts go to their layers' stats

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self._lora is not None:
            self._lora.begin_step()
        if self._kivi is not None:
            plan = self._kivi.plan
            self.loop.set_kivi_plan(
                plan.residual_tokens,
                plan.residual_rows,
                plan.staging_tokens,
                plan.staging_rows,
                plan.staged_from,
                plan.finalize_blocks,
                plan.residual_table,
            )
        groups = meta.groups[1:] if meta.groups else ()  # KV-cache groups past the first: their own slots and tables
        hidden = self._forward(
            self._embed(input_ids),
            positions,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            [g.slot_mapping for g in groups],
            [g.decode_block_tables for g in groups],
        )
        if self._moe_experts:  # as StackedExperts.forward records them on the module path
            for experts, counts in zip(self._moe_experts, self.loop.expert_counts()):
                experts.recent_counts.append(counts)
        return hidden


def build_native_decode(
    model: CausalLM,
    kv_cache: torch.Tensor,
    quantized_kv: QuantizedKVCache | None = None,
    lora: LoRAManager | None = None,
    kv_slots: list[tuple[int, int]] | None = None,
) -> tuple[NativeDecode | None, str]:
    """The loop bound to ``model``'s weights and its KV pool: the float ``kv_cache`` [2, layer slots, ...],
    or a ``quantized_kv`` (int8, fp8, KIVI), and the decode path for start-up lines: ``ACTIVE``, or
    why the module path runs instead. With ``lora`` the loop adds the step's adapter deltas too.
    ``kv_slots``: each layer's (KV-cache group, slot of the pool) where the layers form groups
    (llmctl/engine/model_runner.py); None: one group, layer i in slot i."""
    reason = why_not(model, kv_cache, quantized_kv, kv_slots)
    if reason is not None:
        return None, f"decode: Python modules ({reason})"
    module, unavailable = decode_loop_kernels()
    if module is None:
        return None, f"decode: Python modules ({unavailable})"
    if lora is not None and not lora.kernel.transposed:  # the loop calls the native LoRA kernel
        return None, f"decode: Python modules (LoRA through {lora.kernel.name} kernels)"
    layers = model.model.stage_layers
    if lora is not None and any(isinstance(layer.mlp, SparseMoeBlock) for layer in layers):
        return None, "decode: Python modules (LoRA on a mixture of experts)"
    attn = layers[0].self_attn
    if quantized_kv is None:
        pool = dict(kv_kind="auto", k_pool=kv_cache[0], v_pool=kv_cache[1])
    elif quantized_kv.fmt.is_kivi:
        t, residual = quantized_kv.tensors, quantized_kv.residual
        pool = dict(
            kv_kind=quantized_kv.fmt.kind,
            k_pool=t["k"],
            v_pool=t["v"],
            k_scale=t["k_scale"],
            v_scale=t["v_scale"],
            k_zero=t["k_zero"],
            v_zero=t["v_zero"],
            residual_k=residual["k"],
            residual_v=residual["v"],
            value_group=quantized_kv.fmt.value_group,
        )
    else:
        t = quantized_kv.tensors
        pool = dict(
            kv_kind=quantized_kv.fmt.kind,
            k_pool=t["k"].view(torch.uint8),
            v_pool=t["v"].view(torch.uint8),
            k_scale=t["k_scale"],
            v_scale=t["v_scale"],
        )
    loop = module.DecodeLoop(
        cpu_isa(),
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        model.model.norm.eps,
        attn.attn.scale,
        attn.rotary_emb.cos_sin_cache,
        model.model.norm.weight,
        **pool,
    )
    moe_experts = []  # each MoE layer's experts, in layer order: the loop's expert counts go to them
    for i, layer in enumerate(layers):
        a, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        attention = (_bind_linear(module, a.qkv_proj), _bind_linear(module, a.o_proj))
        qk_norms = (a.q_norm.weight, a.k_norm.weight) if a.qk_norm else (None, None)
        if (moe := _moe_parts(mlp)) is not None:
            router, experts, shared_linears = moe
            spec = router.spec
            shared = [_bind_linear(module, linear) for linear in shared_linears]
            shared += [None] * (3 - len(shared))  # gate_up, down, gate: None where absent
            loop.add_moe_layer(
                *norms,
                *attention,
                _bind_linear(module, router),
                spec.top_k,
                spec.norm_topk_prob,
                experts.native.module,
                *qk_norms,
                *shared,
                spec.scoring,
            )
            moe_experts.append(experts)
        else:
            dense = (_bind_linear(module, mlp.gate_up_proj), _bind_linear(module, mlp.down_proj))
            loop.add_layer(*norms, *attention, *dense, *qk_norms)
        group, pool_slot = kv_slots[i] if kv_slots is not None else (0, i)
        attn = a.attn
        if (group, pool_slot) != (0, i) or attn.sliding_window is not None or attn.sinks is not None:
            loop.set_attention(i, group, pool_slot, attn.sliding_window or 0, attn.sinks)
    kivi = quantized_kv if quantized_kv is not None and quantized_kv.fmt.is_kivi else None
    adapters = None if lora is None else LoopLoRA(loop, lora, layers)
    return NativeDecode(loop, model.model.embed_tokens, kivi, adapters, moe_experts), ACTIVE


def why_not(
    model: CausalLM,
    kv_cache: torch.Tensor,
    quantized_kv: QuantizedKVCache | None = None,
    kv_slots: list[tuple[int, int]] | None = None,
) -> str | None:
    """Why this model and KV pool run decode on the module path (None: the loop takes them). The
    engine's kernel set (llmctl/platform.py, ``ops.kernels``) has its say after the model's checks,
    but for its switch, which comes first."""
    # a model built without an engine has no kernel set: the one an engine on its device would get
    kernels = model.model.norm.ops.kernels or select_kernels("torch", kv_cache.device)
    if not kernels.decode_loop:
        return kernels.decode_loop_why_not()
    stage, cfg = model.model.stage, model.config
    layers = model.model.stage_layers
    dtype = model.model.norm.weight.dtype  # of the activations
    family = family_for(cfg.architecture)
    family_reason = "no registry entry" if family is None else family.native_decode_why_not
    checks = [
        (kv_cache.device.type != "cpu", "not a CPU"),
        (stage.start != 0 or not stage.is_last, "pipeline parallel"),
        (not layers or not all(isinstance(layer, LlamaDecoderLayer) for layer in layers), "no decoder layers"),
        (family_reason is not None, family_reason),  # what the loop does not compute for this family
        (
            any({a.q_norm.eps, a.k_norm.eps} != {model.model.norm.eps} for a in _qk_normed_attentions(layers)),
            "q/k norms of another eps",
        ),
        (_any_attention_has(layers, "logit_softcap"), "attention-logit soft-capping"),
        (dtype not in LOOP_DTYPES, f"{dtype} activations"),
        (
            (dtype != torch.float32 or quantized_kv is not None) and _windowed(layers, kv_slots),
            "sliding windows, sinks or KV-cache groups with "
            + (f"{dtype} activations" if dtype != torch.float32 else "a quantized KV cache"),
        ),
        (
            dtype == torch.bfloat16 and quantized_kv is not None and quantized_kv.fmt.is_kivi,
            f"{dtype} activations with a KIVI KV cache",
        ),
        (
            quantized_kv is not None and not (quantized_kv.native_codes or quantized_kv.native_kivi_store),
            _quantized_kv_why_not(quantized_kv),
        ),
        (
            quantized_kv is None
            and (
                kv_cache.dtype != dtype
                or kv_cache.numel() == 0
                or kv_cache.shape[1] != (len(layers) if kv_slots is None else 1 + max(s for _, s in kv_slots))
            ),
            f"KV cache not of the {dtype} activations",
        ),
    ]
    for failed, reason in checks:
        if failed:
            return reason
    reason = kernels.decode_loop_why_not()
    if reason is not None:
        return reason
    ops = layers[0].input_layernorm.ops
    if type(ops) is not TorchOps or not ops.native:
        return "native CPU kernels off"
    for layer in layers:
        moe = _moe_parts(layer.mlp)
        if moe is not None and (reason := _moe_why_not(layer.mlp, moe[0], moe[1], dtype)) is not None:
            return reason
        mlp = (moe[0], *moe[2]) if moe is not None else (layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *mlp):
            reason = _linear_why_not(linear, dtype)
            if reason is not None:
                return reason
    return None


def _moe_parts(mlp: object) -> tuple[Router, StackedExperts, tuple[LinearBase, ...]] | None:
    """A mixture-of-experts MLP's router, experts and shared expert's linears (gate_up, down, gate),
    as the loop binds them; None for a dense MLP."""
    if isinstance(mlp, GptOssMLP):
        return mlp.router, mlp.experts, ()
    if not isinstance(mlp, SparseMoeBlock):
        return None
    shared = mlp.shared_expert
    if shared is None:
        return mlp.gate, mlp.experts, ()
    gate = () if mlp.shared_expert_gate is None else (mlp.shared_expert_gate,)
    return mlp.gate, mlp.experts, (shared.gate_up_proj, shared.down_proj, *gate)


def _moe_why_not(block: object, router: Router, experts: StackedExperts, dtype: torch.dtype) -> str | None:
    """Why the loop cannot run this mixture-of-experts MLP: it runs softmax top-k routing or the
    softmax of the top-k logits (a router bias included), the packed experts' native call
    (``StackedExperts.bind_native``: biases and clamped SwiGLU included) and a gated dense shared
    expert, in fp32, at tensor parallel size 1."""
    spec = router.spec
    shared_expert = getattr(block, "shared_expert", None)
    checks = [
        (dtype != torch.float32, f"mixture of experts with {dtype} activations"),
        (shared_expert is not None and not isinstance(shared_expert, LlamaMLP), "its shared expert"),
        (
            spec.scoring not in ("softmax", "topk_softmax") or spec.num_groups > 1 or spec.scaling_factor != 1.0,
            "its expert routing",
        ),
        (experts.tp.size != 1, "tensor parallel experts"),
        (experts.packed is None, "float experts (the loop runs packed ones: --quantization or a quantized GGUF)"),
    ]
    for failed, reason in checks:
        if failed:
            return reason
    if not experts.bind_native():
        return "experts without the native MoE call"
    return None


def _qk_normed_attentions(layers: list) -> list:
    return [layer.self_attn for layer in layers if getattr(getattr(layer, "self_attn", None), "qk_norm", False)]


def _windowed(layers: list, kv_slots: list[tuple[int, int]] | None) -> bool:
    """Whether some layer attends over a window, with sinks, or through a KV-cache group of its own:
    what the loop computes over a float32 pool only."""
    plain = kv_slots is None or all(slot == (0, i) for i, slot in enumerate(kv_slots))
    return not plain or _any_attention_has(layers, "sliding_window") or _any_attention_has(layers, "sinks")


def _any_attention_has(layers: list, feature: str) -> bool:
    """Whether some layer's attention has ``feature`` (a sliding window, sinks, a logit soft cap)."""
    for layer in layers:
        attn = getattr(getattr(layer, "self_attn", None), "attn", None)
        if isinstance(attn, Attention) and getattr(attn, feature) is not None:
            return True
    return False


def _quantized_kv_why_not(quantized_kv: QuantizedKVCache | None) -> str:
    if quantized_kv is None:
        return ""
    fmt = quantized_kv.fmt
    if fmt.is_kivi:
        return f"{fmt.kind} KV cache without its native kernels"
    return f"{fmt.kind} KV cache with head_dim {fmt.head_dim} (the loop's 8-bit KV kernels take 64 or 128)"


def _linear_why_not(layer: LinearBase, dtype: torch.dtype) -> str | None:
    from llmctl.layers.quantization.methods import PackedLinearMethod, SplitPackedMethod
    from llmctl.layers.quantization.params import read_packed

    if layer.tp.size != 1:
        return "tensor parallel"
    if type(layer.method) is SplitPackedMethod:  # each part as a layer of its own
        if layer.bias is not None and layer.bias.dtype != torch.float32:
            return "non-float32 bias"
        return next((r for part in layer.parts if (r := _linear_why_not(part, dtype)) is not None), None)
    if dtype == torch.bfloat16:  # the loop calls oneDNN's prepacked linear, as the module path does
        prepacked = type(layer.method) is UnquantizedLinearMethod and layer.weight.is_mkldnn
        return None if prepacked else "bf16 layers not prepacked for oneDNN"
    if layer.bias is not None and layer.bias.dtype != torch.float32:
        return "non-float32 bias"
    if type(layer.method) is PackedLinearMethod:
        if layer.packed_format not in ("int4", "int8"):
            return f"{layer.packed_format} weights"
        if not quant_native_takes(read_packed(layer)):
            return "packed weights on the torch reference"
        return None
    if type(layer.method) is UnquantizedLinearMethod:
        weight = layer.weight
        if weight.is_mkldnn or weight.dtype != torch.float32:
            return "prepacked or non-float32 dense weights"
        return None
    return f"{type(layer.method).__name__} linear layers"


def _bind_linear(module: object, layer: LinearBase) -> object:
    from llmctl.layers.quantization.methods import SplitPackedMethod

    bias = None if layer.bias is None else layer.bias.data.contiguous()
    if type(layer.method) is SplitPackedMethod:
        return module.make_split_linear([_bind_linear(module, part) for part in layer.parts], bias)
    bias_in_gemm = not isinstance(layer, RowParallelLinear)  # row-parallel adds it after the reduce
    if type(layer.method) is UnquantizedLinearMethod:
        # panel (fp32) and mkldnn (bf16): llmctl.layers.linear.prepack_for_cpu
        kind = "mkldnn" if layer.weight.is_mkldnn else "panel" if layer.weight.dim() == 3 else "dense"
        return module.make_linear(
            kind,
            layer.in_features,
            weight=layer.weight.data,
            bias=bias,
            bias_in_gemm=bias_in_gemm,
            out_features=layer.out_features,
        )
    from llmctl.layers.quantization.matmul import bound_cpu_kernel
    from llmctl.layers.quantization.params import kernel_packed

    kernel = bound_cpu_kernel(layer, release_rows=True)
    tiles = getattr(kernel, "tiles", None)  # the module path's copy, shared
    packed = kernel_packed(layer)  # after binding: a released qweight passes as its meta shape only
    return module.make_linear(
        layer.packed_format,
        layer.in_features,
        qweight=packed.qweight.data,
        scales=packed.scales.data,
        mins=None if packed.mins is None else packed.mins.data,
        group=layer.packed_group_size,
        bias=bias,
        tiles=tiles,
        tile_scale_bytes=getattr(kernel, "scale_bytes", 0),
        tile_kind=getattr(kernel, "kind", 0),
    )
