"""Mixture-of-experts feed-forward: a router picks ``top_k`` of ``num_experts`` gated MLPs for each
token, and each active expert runs once over the tokens routed to it.

- ``RouterSpec`` / ``Router``: router logits (a replicated linear layer, the checkpoint's
  ``mlp.gate``, with a bias where the family has one), scores, top-k, optional renormalization of
  the chosen weights. Softmax scoring then top-k is what Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
  use; gpt-oss takes the top-k of the raw logits and a softmax over those k (``topk_softmax``).
  DeepSeek-V2's ``group_limited_greedy`` first keeps the ``topk_groups`` best of ``num_groups``
  expert groups (a group scores its best expert) and takes the top-k among their experts; its
  ``routed_scaling_factor`` scales the final weights.
- ``StackedExperts``: every expert's weights in one tensor per projection, ``w13: [E, 2 * I, H]``
  (gate rows, then up rows) and ``w2: [E, H, I]``, so a kernel gets one tensor. Its forward sorts
  the batch's (token, slot) pairs by expert id, gathers their rows once, runs each active expert's
  gate-up and down matmuls over its contiguous run of rows (no per-token loop; an expert no token
  chose is never read), scales each row by its routing weight, puts the rows back in (token, slot)
  order and sums each token's ``top_k`` rows: the arithmetic of transformers' default
  ``grouped_mm`` experts path, in the same order, so fp32 results agree to the matmul's rounding.
  Optional per-expert biases (gpt-oss: ``w13_bias [E, 2 * I]``, ``w2_bias [E, H]``) are added
  after each matmul, as that path adds them, and the activation is the caller's (SiLU-and-mul, or
  gpt-oss's ``clamped_swiglu``). Checkpoints in transformers' gpt-oss layout (``gate_up_proj``
  ``[E, H, 2 * I]`` with gate and up in interleaved columns, ``down_proj`` ``[E, I, H]``) load
  into the same stacked weights (``concatenated=False, transposed=True``, transformers' own names
  for the layout).
- Packed experts (a quantized GGUF file's blocks, or ``--quantization int8|int4|fp8`` on a float
  checkpoint: ``StackedExperts.quantize_experts``; ``StackedExperts.install_packed``): in place of
  ``w13`` / ``w2``, one ``PackedExpert`` per expert, whose projections are linear layers holding a
  packed weight (``install_packed_weight``): gate and up as one (gate rows, then up) where their
  formats and group sizes agree, else two, and down. The forward groups rows as above and calls
  each active expert's layers, so on a CPU they run the native kernels bound as every packed
  layer's (``bound_cpu_kernel``: the engine binds them at load with its
  ``quant_exact_activations``, their row layouts released for the tile-interleaved copies), the
  packed references elsewhere; ``expert_bytes`` counts what they hold. On a CPU that loop is the
  reference of one native call per layer (``bind_native``, kernels/moe_native.py, bound on the
  first forward after the engine has bound the layers' kernels): every active expert's chain
  (gate_up, the native SiLU-and-mul, down) is one work item of a single parallel region instead
  of ~3 short ones per expert from Python, each projection on the kernel its bound Python kernel
  runs over the same rows, and the weighted sum the same torch ops, so the output is the loop's
  bit for bit. The loop runs where the call cannot take the layer (``LLMCTL_MOE_NATIVE=0``, fp8,
  exact activations, a torch or clamped activation, a non-fp32 input). A row's result is then
  independent of how many rows share its expert where the int8-digit GEMM takes every row count
  (kernels/cpu/qgemm.h); below its row threshold the int16 passes round the activations
  differently, as for any packed layer. Packed experts are not sharded: tensor parallel size 1.
  A projection whose input features are not a whole number of the format's groups holds zero
  columns up to the next whole group (as on-the-fly quantized dense layers do); its inputs are
  zero-padded to match.
- ``SparseMoeBlock``: router + experts + optional shared expert (Qwen2-MoE: a dense MLP whose
  output is scaled by ``sigmoid(shared_expert_gate(x))`` and added).

fp32 on a CPU with the native panel GEMM (llmctl/platform.py): each expert's matrices are packed
into panels after loading (``[E, panels, K, 16]``, still one tensor per projection), and a row's
product is then bitwise independent of how many rows share its expert, so a token's output does
not depend on the batch (tests/layers/test_moe.py). Elsewhere the matmul is ``F.linear`` on the
expert's slice, equal to the batched result within float rounding.

Tensor parallelism shards each expert's intermediate dimension as ``MergedColumnParallelLinear``
and ``RowParallelLinear`` do (rank r holds gate and up rows ``[r * I / tp, (r + 1) * I / tp)`` and
the same columns of down); the block all-reduces the routed sum once, before the shared expert
(which reduces itself) is added. The router is replicated.

Each forward records its per-expert token counts (the bincount the grouping needs anyway) in a
short window, which ``expert_stats`` reads for the engine's statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmctl import envs
from llmctl.distributed import TensorParallel
from llmctl.layers.linear import LinearBase, copy_checked, linear
from llmctl.layers.quantization.matmul import bound_cpu_kernel, bound_exact_activations
from llmctl.layers.quantization.methods import OnTheFlyQuantMethod, install_packed_weight
from llmctl.layers.quantization.params import kernel_packed, weight_bytes
from llmctl.layers.quantization.quantize import quantize
from llmctl.platform import native_gemm, quant_cpu_kernels
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8, PackedWeight, packed_tensors

# "softmax": softmax over every expert's logit, then top-k (Mixtral, Qwen MoE, OLMoE);
# "topk_softmax": top-k of the raw logits, then a softmax over the k chosen (gpt-oss)
ROUTER_SCORINGS = ("softmax", "topk_softmax")
RECENT_STEPS = 64  # forward passes whose per-expert token counts each layer keeps


@dataclass(frozen=True)
class RouterSpec:
    """How a family routes tokens to experts.

    ``weights_dtype``: "input" casts the routing weights to the activations' dtype before they scale
    the experts' outputs (Qwen2-MoE, Qwen3-MoE, OLMoE); "float32" keeps them in fp32, so the scaled
    rows and their sum are fp32 until the result is cast back (Mixtral). Identical in fp32."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool = True  # divide the chosen weights by their sum
    scoring: str = "softmax"  # of the router logits, in fp32 (ROUTER_SCORINGS)
    weights_dtype: str = "input"  # "input" | "float32"
    num_groups: int = 1  # grouped top-k: the experts in groups, the best ``topk_groups`` groups first
    topk_groups: int = 1
    scaling_factor: float = 1.0  # times the final routing weights (DeepSeek's routed_scaling_factor)

    def __post_init__(self) -> None:
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(
                f"router scoring {self.scoring!r} is not implemented (llmctl routes by {', '.join(ROUTER_SCORINGS)})"
            )
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"grouped top-k: {self.num_experts} experts in {self.num_groups} groups, best {self.topk_groups}"
            )
        if self.num_groups > 1 and self.scoring != "softmax":
            raise ValueError("grouped top-k routing takes softmax scores")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} experts per token out of {self.num_experts}")
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(f"top_k={self.top_k} experts per token out of the {self.topk_groups} groups kept")
        if self.weights_dtype not in ("input", "float32"):
            raise ValueError(f"weights_dtype {self.weights_dtype!r}: 'input' or 'float32'")
        if self.scoring == "topk_softmax" and self.norm_topk_prob:
            raise ValueError("topk_softmax weights already sum to 1: norm_topk_prob must be False")


def route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` router logits -> routing weights ``[T, top_k]`` and expert ids ``[T, top_k]``
    (int64), best first: softmax in fp32 (zero outside the best groups with ``num_groups`` > 1),
    top-k, optional renormalization and scaling, as transformers'
    ``*TopKRouter`` modules compute them; or (``topk_softmax``, gpt-oss) top-k of the logits and
    the softmax of those k in fp32 (transformers' ``GptOssTopKRouter`` takes it in the logits'
    dtype: the same in fp32)."""
    if spec.scoring == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if spec.num_groups > 1:
            probs = _keep_best_groups(probs, spec.num_groups, spec.topk_groups)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.scaling_factor != 1.0:
        weights = weights * spec.scaling_factor
    if spec.weights_dtype == "input":
        weights = weights.to(logits.dtype)
    return weights, ids


def _keep_best_groups(probs: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """``probs [T, E]`` with every expert outside each token's ``topk_groups`` best groups set to
    0 (a group scores its best expert), as transformers' ``DeepseekV2TopkRouter`` masks them."""
    grouped = probs.view(probs.shape[0], num_groups, -1)
    best = torch.topk(grouped.amax(dim=-1), topk_groups, dim=-1).indices
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=probs.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], 0.0).view_as(probs)


class Router(LinearBase):
    """The router's ``[num_experts, hidden]`` weight and, with ``bias``, its ``[num_experts]`` bias
    (replicated under tensor parallelism); calling it gives ``route``'s weights and ids."""

    def __init__(
        self, hidden_size: int, spec: RouterSpec, *, dtype: torch.dtype, tp: TensorParallel, bias: bool = False
    ) -> None:
        super().__init__(hidden_size, spec.num_experts, bias, dtype, tp, None)
        self.spec = spec

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return route(self.logits(x), self.spec)


@dataclass(frozen=True)
class ExpertShard:
    """Which part of the stacked expert weights a checkpoint tensor holds: one expert's ``gate``,
    ``up`` or ``down`` matrix, or (``expert`` None) every expert's, stacked on a leading dimension
    (``gate_up`` being gate and up concatenated along the rows, as transformers stores them)."""

    expert: int | None
    part: str  # "gate" | "up" | "down" | "gate_up"

    def keys(self, num_experts: int) -> list[str]:
        """The loaded-part names this tensor fills (``"<expert>.<part>"``)."""
        parts = ("gate", "up") if self.part == "gate_up" else (self.part,)
        experts = range(num_experts) if self.expert is None else (self.expert,)
        return [f"{e}.{p}" for e in experts for p in parts]


# Mixtral's checkpoints name the block ``block_sparse_moe`` and the projections w1 (gate), w3 (up),
# w2 (down); the Qwen MoE families and OLMoE name them ``mlp``, gate_proj, up_proj, down_proj.
_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)$")
_STACKED_BIAS = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)_bias$")  # gpt-oss


def expert_checkpoint_target(name: str) -> tuple[str, ExpertShard | None] | None:
    """For a checkpoint tensor of a mixture-of-experts block: the parameter it loads into and the
    ``ExpertShard`` it holds (None for Mixtral's router, only renamed to ``mlp.gate``);
    None for any other tensor. Per-expert tensors (``experts.N.w1.weight``,
    ``experts.N.gate_proj.weight``, ...) and transformers' stacked ones (``experts.gate_up_proj``
    ``[E, 2 * I, H]``, ``experts.down_proj`` ``[E, H, I]``) both map to ``experts.w13`` / ``experts.w2``;
    gpt-oss's stacked biases (``experts.gate_up_proj_bias``, ``experts.down_proj_bias``) to
    ``experts.w13_bias`` / ``experts.w2_bias``."""
    renamed = name.replace(".block_sparse_moe.", ".mlp.")
    if (m := _PER_EXPERT.match(renamed)) is not None:
        part = _PART[m.group(3)]
        return f"{m.group(1)}.experts.{'w2' if part == 'down' else 'w13'}", ExpertShard(int(m.group(2)), part)
    if (m := _STACKED.match(renamed)) is not None:
        gate_up = m.group(2) == "gate_up_proj"
        return f"{m.group(1)}.experts.{'w13' if gate_up else 'w2'}", ExpertShard(None, "gate_up" if gate_up else "down")
    if (m := _STACKED_BIAS.match(renamed)) is not None:
        gate_up = m.group(2) == "gate_up_proj"
        target = f"{m.group(1)}.experts.{'w13_bias' if gate_up else 'w2_bias'}"
        return target, ExpertShard(None, "gate_up" if gate_up else "down")
    return (renamed, None) if renamed != name else None


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on ``[..., 2 * I]`` (gate features, then up): the gate clamped
    above at ``limit``, up to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``,
    in transformers' ``GptOssExperts._apply_gate`` order of operations."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


@dataclass
class PackedExpertWeights:
    """One layer's experts as packed weights (a quantized file's blocks), one per expert and
    projection: ``gate`` and ``up`` ``[I, H]``, ``down`` ``[H, I]``."""

    gate: list[PackedWeight]
    up: list[PackedWeight]
    down: list[PackedWeight]


def _rows_stacked(parts: list[PackedWeight]) -> PackedWeight | None:
    """The parts' rows one after another in one packed weight, or None where their formats, group
    sizes or mins differ (each part then stays a weight of its own: no re-encoding)."""
    first = parts[0]
    fields = packed_tensors(first)
    if any(
        type(p) is not type(first)
        or getattr(p, "group_size", None) != getattr(first, "group_size", None)
        or packed_tensors(p).keys() != fields.keys()
        for p in parts
    ):
        return None
    return dataclasses.replace(first, **{f: torch.cat([packed_tensors(p)[f] for p in parts]) for f in fields})


# input features a packed weight's K must be a multiple of, per kind: what the kernels take (the
# multiples OnTheFlyQuantMethod.quantize_layer pads a dense layer's K to)
_K_MULTIPLE = {"int8": 32, "fp8": 16}


def _quantized_expert(weight: torch.Tensor, method: OnTheFlyQuantMethod) -> PackedWeight:
    """One expert projection ``[N, K]`` quantized as ``method`` quantizes the dense layers (its kind
    and group size), with zero input columns appended up to a whole number of groups where K is not
    one (e.g. 40 intermediate features -> 64 at int4 group 64): the group size stays the dense
    layers', and the zero columns meet zero-padded inputs (``PackedExpert``)."""
    multiple = method.group_size if method.kind == "int4" else _K_MULTIPLE[method.kind]
    padding = -weight.shape[1] % multiple
    return quantize(F.pad(weight, (0, padding)) if padding else weight, method.kind, method.group_size)


def _packed_linear(packed: PackedWeight, in_features: int, device: torch.device) -> LinearBase:
    """A replicated linear layer of ``in_features`` inputs holding ``packed`` (``install_packed_weight``:
    up to 127 zero-padded input columns more), on ``device``; ``input_padding`` says how many."""
    out_features, packed_in = packed.shape
    with torch.device("meta"):  # the float weight it is built with is freed unallocated
        layer = LinearBase(in_features, out_features, False, torch.float32, TensorParallel(), None)
    install_packed_weight(layer, packed)
    layer.input_padding = packed_in - in_features
    return layer.to(device)


class PackedExpert(nn.Module):
    """One expert's projections as packed linear layers, so that its kernels are bound, released
    and counted as every packed layer's: ``gate_up`` (gate rows, then up) where gate and up share a
    format, else ``gate`` and ``up``; ``down``."""

    def __init__(self, gate: PackedWeight, up: PackedWeight, down: PackedWeight, device: torch.device) -> None:
        super().__init__()
        hidden, inner = down.shape[0], gate.shape[0]  # rows are never padded, input columns may be
        merged = _rows_stacked([gate, up])
        self.gate_up = None if merged is None else _packed_linear(merged, hidden, device)
        self.gate = None if merged is not None else _packed_linear(gate, hidden, device)
        self.up = None if merged is not None else _packed_linear(up, hidden, device)
        self.down = _packed_linear(down, inner, device)

    def forward(
        self,
        x: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Biases (gpt-oss's) are added after each product, as transformers adds them."""
        if self.gate_up is not None:
            gate_up = _packed_call(self.gate_up, x)
        else:
            gate_up = torch.cat([_packed_call(self.gate, x), _packed_call(self.up, x)], dim=-1)
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias
        down = _packed_call(self.down, act(gate_up))
        return down if down_bias is None else down + down_bias


def _packed_call(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for 2-D ``x``: on a CPU straight into its bound kernel (the same call
    ``PackedLinearMethod.apply`` makes), without the module call around it, which a decoded token
    pays ~2-3 times per active expert and layer. Inputs are zero-padded to a padded weight's columns."""
    if layer.input_padding:
        x = F.pad(x, (0, layer.input_padding))
    kernel = bound_cpu_kernel(layer, release_rows=True) if x.device.type == "cpu" else None
    return layer(x) if kernel is None else kernel(x)


def _native_projection(layer: LinearBase) -> Any | None:
    """``layer``'s bound CPU kernel described for the native MoE call (``ProjectionSpec``): its
    tile-interleaved copy, or the row layout / per-channel int8 with the scales that kernel reads;
    None where it runs anything else (fp8, exact activations, the torch reference)."""
    from llmctl_kernels.moe_native import PER_CHANNEL, ROWS, TILES, ProjectionSpec
    from llmctl_kernels.quant_native import INT4_TILES, INT8_TILES, InterleavedKernel

    kernel = bound_cpu_kernel(layer, release_rows=True)
    if kernel is None:
        return None
    in_features = layer.in_features
    if isinstance(kernel, InterleavedKernel):
        k = in_features + layer.input_padding
        return ProjectionSpec(
            TILES,
            kernel.kind,
            kernel.n,
            k,
            kernel.group,
            in_features,
            kernel.scale_bytes,
            kernel.has_mins,
            kernel.tiles,
        )
    if bound_exact_activations(layer):
        return None
    packed = kernel_packed(layer)
    if not isinstance(packed, (PackedInt4, PackedInt8)):
        return None
    (n, k), group, mins = packed.shape, packed.group_size, packed.mins
    int4 = isinstance(packed, PackedInt4)
    layout = PER_CHANNEL if not int4 and group == k and mins is None else ROWS
    scale_bytes = packed.scales.element_size()
    kind = INT4_TILES if int4 else INT8_TILES  # the row layouts' bool, as the tiles' kind
    return ProjectionSpec(
        layout, kind, n, k, group, in_features, scale_bytes, mins is not None, packed.qweight, packed.scales, mins
    )


def _native_activation(act: Callable[[torch.Tensor], torch.Tensor]) -> Any | None:
    """``act`` as the native MoE call runs it (``ActivationSpec``): the ops' SiLU-and-mul on the
    native CPU kernel, or gpt-oss's clamped SwiGLU (the same ATen ops); None for anything else (a
    torch SiLU-and-mul, another activation), which keeps the Python loop."""
    from llmctl.layers.ops import TorchOps
    from llmctl_kernels.moe_native import CLAMPED_SWIGLU, ActivationSpec

    if isinstance(act, functools.partial) and act.func is clamped_swiglu and not act.args:
        return ActivationSpec(CLAMPED_SWIGLU, float(act.keywords["alpha"]), float(act.keywords["limit"]))
    ops = getattr(act, "__self__", None)
    if getattr(act, "__func__", None) is TorchOps.silu_and_mul and isinstance(ops, TorchOps) and ops.native:
        return ActivationSpec()
    return None


class StackedExperts(nn.Module):
    """``num_experts`` gated MLPs (``act``: SiLU-and-mul, or gpt-oss's ``clamped_swiglu``) with
    their weights stacked, optional biases (``bias``), and the checkpoint's layout of stacked
    tensors (``concatenated``: gate rows then up rows, else interleaved; ``transposed``: ``[E, H,
    2 * I]`` / ``[E, I, H]``) (module docstring). With ``quant_method`` (``--quantization`` on a
    float checkpoint) the experts load as float and are quantized into packed experts after
    loading (``quantize_experts``)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype,
        tp: TensorParallel = TensorParallel(),
        act: Callable[[torch.Tensor], torch.Tensor],
        bias: bool = False,
        concatenated: bool = True,
        transposed: bool = False,
        fused: Callable[..., torch.Tensor] | None = None,
        quant_method: OnTheFlyQuantMethod | None = None,
    ) -> None:
        super().__init__()
        if quant_method is not None and tp.size != 1:
            raise ValueError(
                f"quantized experts run packed, with tensor parallel size 1 (this is {tp.size}); "
                "use --quantization none"
            )
        self.tp, self.act = tp, act
        self.quant_method = quant_method
        self.fused = fused  # the kernel set's fused experts (``TritonOps.fused_experts``), else the loop below
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.concatenated, self.transposed = concatenated, transposed
        self.intermediate_size = tp.shard(intermediate_size, "expert intermediate size")  # this rank's
        size = self.intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, size, dtype=dtype), requires_grad=False)
        params = [(self.w13, ("gate", "up"), self.weight_loader), (self.w2, ("down",), self.weight_loader)]
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:  # gate and up biases of this rank's features; the down bias whole (added on rank 0)
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * size, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
            params += [(self.w13_bias, ("gate", "up"), self.bias_loader), (self.w2_bias, ("down",), self.bias_loader)]
        for param, parts, loader in params:
            param.weight_loader = loader
            param.expert_shards = [f"{e}.{p}" for e in range(num_experts) for p in parts]
        self.panels = False  # w13 / w2 packed for the native GEMM (process_weights_after_loading)
        self.packed: nn.ModuleList | None = None  # PackedExpert per expert, in place of w13 / w2 (install_packed)
        # the packed experts' native per-layer call (``bind_native``): None until bound, False where
        # it cannot take them (the loop in ``forward`` runs)
        self.native: Any = None
        self.recent_counts: deque[torch.Tensor] = deque(maxlen=RECENT_STEPS)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: ExpertShard) -> None:
        """A full (unsharded) checkpoint tensor into this rank's slice of the stacked weight."""
        if not isinstance(shard, ExpertShard):
            raise ValueError("stacked expert weights load from per-expert or stacked expert tensors")
        if self.transposed and shard.part in ("gate_up", "down"):  # stored [.., H, 2I] / [.., I, H]
            loaded = loaded.transpose(-1, -2)
        if shard.part == "gate_up" and not self.concatenated:  # rows gate, up, gate, up, ...: gate rows, then up
            loaded = torch.cat([loaded[..., 0::2, :], loaded[..., 1::2, :]], dim=-2)
        size, rank = self.intermediate_size, self.tp.rank
        if shard.expert is None:
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"expected {self.num_experts} stacked experts, got shape {tuple(loaded.shape)}")
            dst_all = param.data
        else:
            if not 0 <= shard.expert < self.num_experts:
                raise ValueError(f"expert {shard.expert} of {self.num_experts}")
            dst_all = param.data[shard.expert]
        if shard.part == "gate_up":
            if loaded.shape[-2] % 2:
                raise ValueError(f"gate_up_proj has an odd number of rows ({loaded.shape[-2]})")
            gate, up = loaded.chunk(2, dim=-2)
            for part, piece in (("gate", gate), ("up", up)):
                self.weight_loader(param, piece, ExpertShard(shard.expert, part))
            return
        if shard.part == "down":
            src = loaded.narrow(-1, rank * size, size) if self.tp.size > 1 else loaded
            copy_checked(dst_all, src, "down_proj")
            return
        offset = 0 if shard.part == "gate" else size
        src = loaded.narrow(-2, rank * size, size) if self.tp.size > 1 else loaded
        copy_checked(dst_all.narrow(-2, offset, size), src, f"{shard.part}_proj")

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: ExpertShard) -> None:
        """A full checkpoint bias (``[E, 2I]`` / ``[E, H]`` stacked, or one expert's) into this rank's
        part: gate and up features sharded as the weights' rows, the down bias whole."""
        if not isinstance(shard, ExpertShard) or shard.part not in ("gate_up", "down"):
            raise ValueError("stacked expert biases load from stacked gate_up / down bias tensors")
        expected_dims = 2 if shard.expert is None else 1
        if loaded.dim() != expected_dims or (shard.expert is None and loaded.shape[0] != self.num_experts):
            raise ValueError(f"expected {self.num_experts} stacked expert biases, got shape {tuple(loaded.shape)}")
        dst = param.data if shard.expert is None else param.data[shard.expert]
        if shard.part == "down":
            copy_checked(dst, loaded, "down_proj_bias")
            return
        if loaded.shape[-1] % 2:
            raise ValueError(f"gate_up_proj_bias has an odd number of features ({loaded.shape[-1]})")
        if self.concatenated:
            gate, up = loaded.chunk(2, dim=-1)
        else:
            gate, up = loaded[..., 0::2], loaded[..., 1::2]
        size, rank = self.intermediate_size, self.tp.rank
        for offset, piece in ((0, gate), (size, up)):
            src = piece.narrow(-1, rank * size, size) if self.tp.size > 1 else piece
            copy_checked(dst.narrow(-1, offset, size), src, "gate_up_proj_bias")

    def process_weights_after_loading(self) -> None:
        """With a ``quant_method``: the experts quantized (``quantize_experts``). Else fp32 on a CPU
        with the native GEMM: each expert's matrices packed into panels (one tensor per projection
        still), for the batch-invariant native kernel."""
        if self.packed is not None:
            return
        if self.quant_method is not None:
            self.quantize_experts(self.quant_method)
            return
        w13 = self.w13.data
        if self.fused is not None or self.panels or w13.device.type != "cpu" or w13.dtype != torch.float32:
            return
        if native_gemm() is None:
            return
        from llmctl_kernels.fp32_linear import pack_panels

        self.w13 = nn.Parameter(torch.stack([pack_panels(w) for w in w13]), requires_grad=False)
        self.w2 = nn.Parameter(torch.stack([pack_panels(w) for w in self.w2.data]), requires_grad=False)
        self.panels = True

    def quantize_experts(self, method: OnTheFlyQuantMethod) -> None:
        """Each expert's gate, up and down quantized as ``method`` quantizes the dense layers
        (``_quantized_expert``), then installed (``install_packed``), which frees the float
        stacks: one expert's float temporaries at a time, so a layer's peak is its float experts
        plus their packed copies, and the model's stays near the float checkpoint's size."""
        size = self.intermediate_size
        gate, up, down = [], [], []
        with torch.no_grad():
            for e in range(self.num_experts):
                w13 = self.w13.data[e]
                gate.append(_quantized_expert(w13[:size], method))
                up.append(_quantized_expert(w13[size:], method))
                down.append(_quantized_expert(self.w2.data[e], method))
        self.install_packed(PackedExpertWeights(gate, up, down))

    def install_packed(self, weights: PackedExpertWeights) -> None:
        """Every expert's packed weights in place of the stacked float ones (freed): a
        ``PackedExpert`` per expert. Tensor parallel size 1: packed rows are not sharded across
        ranks (``--quantization none`` shards the dequantized experts). Expert biases stay float
        parameters, loaded by name as before. A weight may carry up to 127 zero input columns past
        its projection's inputs (``_packed_linear``)."""
        if self.tp.size != 1:
            raise ValueError(
                f"packed experts run with tensor parallel size 1 only (this is {self.tp.size}); "
                "use --quantization none to dequantize them and shard them across ranks"
            )
        counts = {len(weights.gate), len(weights.up), len(weights.down)}
        if counts != {self.num_experts}:
            raise ValueError(f"expected {self.num_experts} experts' gate, up and down weights, got {sorted(counts)}")
        experts = list(zip(weights.gate, weights.up, weights.down))
        shapes = ((self.intermediate_size, self.hidden_size),) * 2 + ((self.hidden_size, self.intermediate_size),)
        for e, parts in enumerate(experts):
            for what, packed, (rows, cols) in zip(("gate", "up", "down"), parts, shapes):
                n, k = packed.shape
                if n != rows or not cols <= k < cols + 128:
                    raise ValueError(f"expert {e} {what}_proj: expected shape {(rows, cols)}, got {(n, k)}")
        device = self.w13.device
        self.packed = nn.ModuleList(PackedExpert(*parts, device) for parts in experts)
        self.w13 = self.w2 = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``weights`` and expert ``ids`` ``[T, top_k]`` -> ``[T, H]`` (this
        rank's partial sum under tensor parallelism)."""
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.recent_counts.append(counts)
        if self.fused is not None and self.packed is None:
            w2_bias = self.w2_bias if self.tp.rank == 0 else None  # once in the ranks' sum
            return self.fused(x, self.w13, self.w2, weights, ids, self.act, self.w13_bias, w2_bias)
        if self.packed is not None and x.device.type == "cpu" and num_tokens:
            native = self.bind_native() if self.native is None else self.native
            if native and x.dtype == torch.float32 and weights.dtype == torch.float32:
                return native(x, weights, ids)
        if num_tokens == 1:  # one token (a single stream's decode step): its experts in slot order, no sort
            outs = [self._expert(expert, x) for expert in flat.tolist()]
            scaled = torch.cat(outs) * weights.reshape(-1, 1)  # the general path's rows, products and sum
            return scaled.view(1, top_k, self.hidden_size).sum(dim=1).to(x.dtype)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, in token order
        rows = x.index_select(0, order // top_k)
        out = torch.empty(rows.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)
        start = 0
        for expert, n in enumerate(counts.tolist()):
            if not n:  # no token chose it: its weights are not read
                continue
            end = start + n
            out[start:end] = self._expert(expert, rows[start:end])
            start = end
        scaled = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        unsorted = torch.empty_like(scaled).index_copy_(0, order, scaled)  # back to (token, slot) order
        return unsorted.view(num_tokens, top_k, self.hidden_size).sum(dim=1).to(x.dtype)

    def bind_native(self) -> Any:
        """The packed experts' native per-layer call (kernels/moe_native.py), decided once, on
        the first CPU forward (after the engine has bound every layer's kernel): False where
        ``LLMCTL_MOE_NATIVE=0``, the native kernels are missing, the activation is neither the
        native SiLU-and-mul nor the clamped SwiGLU (``_native_activation``), the biases are not
        float32, or any projection runs a kernel the call does not (``_native_projection``).
        Later calls return that decision (the native decode loop asks at its binding)."""
        if self.native is not None:
            return self.native
        self.native = False
        if self.packed is None or not envs.LLMCTL_MOE_NATIVE or quant_cpu_kernels() is None:
            return self.native
        from llmctl_kernels.moe_native import ExpertSpec, NativeExperts, load_moe_native

        activation = _native_activation(self.act) if load_moe_native() is not None else None
        biased = self.w13_bias is not None
        if activation is None or (biased and (self.w13_bias.dtype, self.w2_bias.dtype) != (torch.float32,) * 2):
            return self.native
        experts = []
        for e, expert in enumerate(self.packed):
            parts = [expert.gate_up] if expert.gate_up is not None else [expert.gate, expert.up]
            specs = [_native_projection(layer) for layer in (*parts, expert.down)]
            if any(spec is None for spec in specs):
                return self.native
            biases = (self.w13_bias[e], self.w2_bias[e]) if biased else (None, None)
            experts.append(ExpertSpec(specs[:-1], specs[-1], *biases))
        self.native = NativeExperts(self.hidden_size, self.intermediate_size, experts, activation)
        return self.native

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP over its rows ``[n, H] -> [n, H]``."""
        if self.packed is not None:  # the expert's packed layers (their bound kernels on a CPU)
            biases = (None, None) if self.w13_bias is None else (self.w13_bias[expert], self.w2_bias[expert])
            return self.packed[expert](rows, self.act, *biases)
        gate_up = linear(rows, self.w13[expert], None, 2 * self.intermediate_size)
        if self.w13_bias is not None:  # after the matmul, as transformers adds it
            gate_up = gate_up + self.w13_bias[expert]
        down = linear(self.act(gate_up), self.w2[expert], None, self.hidden_size)
        if self.w2_bias is not None and self.tp.rank == 0:  # once in the ranks' sum
            down = down + self.w2_bias[expert]
        return down

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights on this rank (packed: as ``weight_bytes`` counts them)."""
        if self.packed is not None:
            return weight_bytes(self.packed) // self.num_experts
        return (self.w13.numel() + self.w2.numel()) * self.w13.element_size() // self.num_experts


class SparseMoeBlock(nn.Module):
    """Router (``gate``), ``experts`` and, when given, a ``shared_expert`` every token runs
    (its output times ``sigmoid(shared_expert_gate(x))`` with ``shared_expert_gate``), with
    transformers' module names so checkpoints load by name."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        spec: RouterSpec,
        *,
        dtype: torch.dtype,
        tp: TensorParallel,
        act: Callable[[torch.Tensor], torch.Tensor],
        shared_expert: nn.Module | None = None,
        shared_expert_gate: bool = False,
        fused_experts: Callable[..., torch.Tensor] | None = None,
        expert_quant_method: OnTheFlyQuantMethod | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(hidden_size, spec, dtype=dtype, tp=tp)  # float whatever the quantization
        self.experts = StackedExperts(
            spec.num_experts,
            hidden_size,
            intermediate_size,
            dtype=dtype,
            tp=tp,
            act=act,
            fused=fused_experts,
            quant_method=expert_quant_method,
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = LinearBase(hidden_size, 1, False, dtype, tp, None) if shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.tp.all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def expert_stats(model: nn.Module) -> dict[str, Any] | None:
    """Per MoE layer, the tokens each expert took summed over the last forward passes (at most
    ``RECENT_STEPS``), and the share of the experts' weight bytes those passes read on average (an
    expert is read once per pass when any token chose it). None for a model without experts."""
    layers = []
    total_bytes = read_bytes = 0.0
    for name, module in model.named_modules():
        if not isinstance(module, StackedExperts):
            continue
        recent = list(module.recent_counts)
        counts = torch.stack(recent).sum(0).tolist() if recent else [0] * module.num_experts
        active = sum(int((c > 0).sum()) for c in recent) / len(recent) if recent else 0.0
        per_expert = module.expert_bytes()
        total_bytes += per_expert * module.num_experts
        read_bytes += per_expert * active
        layers.append({"layer": name.removesuffix(".mlp.experts"), "steps": len(recent), "tokens": counts})
    if not layers:
        return None
    return {
        "window": RECENT_STEPS,
        "layers": layers,
        "weight_bytes": int(total_bytes),
        "read_share_per_step": read_bytes / total_bytes if total_bytes else 0.0,
    }
