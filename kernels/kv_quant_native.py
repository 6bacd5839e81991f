"""Native CPU decode attention over a quantized KV pool (C++ in kernels/cpu/kv_quant_attention.cpp),
compiled at install time into ``llmctl_kernels._C.kv_quant``.

Optional: where it was not built, the quantized pool keeps its torch reference
(``llmctl/engine/kv_cache.py``: gather, dequantize, attend); whether to use it at all is llmctl's
choice. It holds a generic and an AVX2+FMA+F16C variant, picked at run time from the CPU's level
(``cpu_features.isa_level``, capped by ``set_isa_cap``).
"""

from __future__ import annotations

import torch

from llmctl_kernels import kv_quant as kq
from llmctl_kernels.cpu_features import isa_level, on_isa_cap_change
from llmctl_kernels.native_module import NativeKernels

KIND_CODES = {"fp8_e4m3": 0, "fp8_e5m2": 0, "int8": 1, "kivi2": 2, "kivi4": 2}
_luts: dict[str, torch.Tensor] = {}


def kernel_isa() -> str:
    """``avx2`` where the CPU runs AVX2+FMA+F16C (any AVX-512 CPU does too) and the level is not
    capped at ``generic`` (``set_isa_cap``: tests, A/B runs), else ``generic``."""
    return "generic" if isa_level() == "generic" else "avx2"


def _select_variant(module) -> None:
    module.set_isa(kernel_isa())
    on_isa_cap_change(lambda: module.set_isa(kernel_isa()))


EXTENSION = NativeKernels("kv_quant", on_load=_select_variant)
native_unavailable_reason = EXTENSION.unavailable_reason
load_kv_quant_native = EXTENSION.load  # the module with its ISA variant selected, or None


def fp8_table(kind: str) -> torch.Tensor:
    """The float value of each of the 256 codes of an fp8 format (the kernel reads codes through it)."""
    if kind not in _luts:
        _luts[kind] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kq.FP8_DTYPES[kind]).float()
    return _luts[kind]


def quantized_decode_attention_native(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    kind: str,
    tensors: dict[str, torch.Tensor],  # one layer's storage (kv_cache.KVFormat.tensor_shapes), [num_blocks, ...]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    value_group: int = 0,  # KIVI: value channels per scale/zero group
    residual: dict[str, torch.Tensor] | None = None,  # KIVI: "k"/"v" [slots, block_size, Hkv, D], model dtype
    residual_table: torch.Tensor | None = None,  # KIVI: [num_blocks] int64 slot per block, -1 = quantized
    window: int | None = None,  # sliding window (kernels/prefill_attention.py's docstring)
    softcap: float | None = None,  # attention-logit soft cap
) -> torch.Tensor:
    """Same result as gathering, dequantizing (``kernels/kv_quant.py``) and attending, up to fp32
    summation order; the pool is read in place."""
    module = EXTENSION.require()
    k, v = tensors["k"], tensors["v"]
    if kind in kq.FP8_DTYPES:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    is_kivi = kind in kq.KIVI_BITS
    return module.quantized_decode_attention(
        query,
        KIND_CODES[kind],
        kq.KIVI_BITS.get(kind, 8),
        k,
        v,
        tensors["k_scale"],
        tensors["v_scale"],
        tensors.get("k_zero"),
        tensors.get("v_zero"),
        residual["k"] if is_kivi else None,
        residual["v"] if is_kivi else None,
        residual_table if is_kivi else None,
        fp8_table(kind) if kind in kq.FP8_DTYPES else None,
        block_tables.to(torch.int32),
        seq_lens.to(torch.int32),
        value_group,
        float(scale),
        window or 0,
        softcap or 0.0,
    )


def kivi_store_native(
    key: torch.Tensor,  # [N, Hkv, D] float32 (a row stride of its own allowed)
    value: torch.Tensor,
    bits: int,
    value_group: int,
    tensors: dict[str, torch.Tensor],  # one layer's KIVI storage: k, v codes, k/v_scale, k/v_zero
    residual: dict[str, torch.Tensor],  # "k"/"v": this layer's residual slots [slots, BS, Hkv, D] float32
    plan: object,  # kv_cache.StepPlan of this step
) -> dict[str, torch.Tensor]:
    """One layer's KIVI store in one native call, bit for bit as the torch reference
    (``kv_cache.QuantizedLayerKV.stage`` + ``kv_quant.quantize_kivi_*``); returns the staging rows
    of the blocks it quantized (``{"k", "v"}: [F, BS, Hkv, D]``), which prefill reads exactly."""
    module = EXTENSION.require()
    shape = (plan.finalize_blocks.numel(), *residual["k"].shape[1:])
    staging = {name: torch.empty(shape, dtype=torch.float32) for name in ("k", "v")}
    module.kivi_store(
        key,
        value,
        bits,
        value_group,
        residual["k"],
        residual["v"],
        plan.residual_tokens,
        plan.residual_rows,
        plan.staging_tokens,
        plan.staging_rows,
        plan.staged_from,
        plan.finalize_blocks,
        staging["k"],
        staging["v"],
        tensors["k"],
        tensors["k_scale"],
        tensors["k_zero"],
        tensors["v"],
        tensors["v_scale"],
        tensors["v_zero"],
    )
    return staging
