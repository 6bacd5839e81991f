"""Native CPU kernels (C++; kernels/cpu/cpu_kernels.cpp), compiled at install time into
``llmctl_kernels._C.cpu`` (setup.py; ``llmctl_kernels.native_module`` loads it), with the
multi-LoRA kernel (``lora_add``, kernels/cpu/lora_kernels.cpp) under the same ISA selection.

Optional: where they were not built (no C++ compiler at install), the engine keeps the pure-torch
references; whether to use them at all is llmctl's choice. One build holds a variant per
instruction set (generic, AVX2+FMA, AVX-512, AVX512-BF16); ``load_native`` selects the best one
this CPU runs (``cpu_features.isa_level``, capped by ``set_isa_cap``), at run time.
"""

from __future__ import annotations

import torch

from llmctl_kernels.cpu_features import isa_level, on_isa_cap_change
from llmctl_kernels.native_module import NativeKernels


def _select_variant(module) -> None:
    module.set_isa(isa_level())
    on_isa_cap_change(lambda: module.set_isa(isa_level()))


EXTENSION = NativeKernels("cpu", on_load=_select_variant)
native_unavailable_reason = EXTENSION.unavailable_reason
load_native = EXTENSION.load  # the module with the best ISA variant selected, or None
_module_or_raise = EXTENSION.require


def native_isa() -> str | None:
    """The ISA variant in use, e.g. ``avx2`` (None without the module)."""
    return isa_level() if load_native() is not None else None


def paged_decode_attention_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same signature and result as ``paged_decode_attention_torch`` (up to rounding)."""
    return _module_or_raise().paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, window or 0, softcap or 0.0, sinks
    )


def decode_codes_native_supported(head_dim: int) -> bool:
    """Whether ``paged_decode_attention_codes_native`` runs here (head_dim 64/128, AVX2 or better)."""
    module = load_native()
    return module is not None and module.decode_codes_supported(head_dim)


def paged_decode_attention_codes_native(
    query: torch.Tensor,
    kind: str,
    tensors: dict[str, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention over one layer of an 8-bit KV pool (``kind``: int8, fp8_e4m3, fp8_e5m2;
    ``tensors``: its k, v, k_scale, v_scale as llmctl/engine/kv_cache.py lays them out). Same result
    as dequantizing and attending (kernels/kv_quant.py) up to fp32 summation order."""
    return _module_or_raise().paged_decode_attention_codes(
        query,
        kind,
        tensors["k"].view(torch.uint8),
        tensors["v"].view(torch.uint8),
        tensors["k_scale"],
        tensors["v_scale"],
        block_tables.to(torch.int32),
        seq_lens.to(torch.int32),
        float(scale),
        window or 0,
        softcap or 0.0,
    )


def paged_prefill_attention_codes_native(
    query: torch.Tensor,
    kind: str,
    tensors: dict[str, torch.Tensor],
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal prefill over one layer of an 8-bit KV pool, as ``paged_prefill_attention_native`` on the
    dequantized K/V (``llmctl_kernels.kv_quant.dequantize_per_token``); the pool is read in place."""
    return _module_or_raise().paged_prefill_attention_codes(
        query,
        kind,
        tensors["k"].view(torch.uint8),
        tensors["v"].view(torch.uint8),
        tensors["k_scale"],
        tensors["v_scale"],
        block_tables.to(torch.int32),
        query_start_loc.to(torch.int32),
        seq_lens.to(torch.int32),
        float(scale),
        window or 0,
        softcap or 0.0,
    )


def store_kv_codes_native(
    key: torch.Tensor, value: torch.Tensor, kind: str, tensors: dict[str, torch.Tensor], slot_mapping: torch.Tensor
) -> None:
    """Quantize float32 K/V ``[T, Hkv, D]`` per (token, KV head) into one layer of an 8-bit pool
    through the slot mapping: bit for bit ``llmctl_kernels.kv_quant.quantize_per_token``."""

    def heads_contiguous(x: torch.Tensor) -> torch.Tensor:
        return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()

    _module_or_raise().store_kv_codes(
        heads_contiguous(key),
        heads_contiguous(value),
        kind,
        tensors["k"].view(torch.uint8),
        tensors["v"].view(torch.uint8),
        tensors["k_scale"],
        tensors["v_scale"],
        slot_mapping,
    )


def prefill_attention_native_supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether ``paged_prefill_attention_native`` takes these (fp32 or bf16, head_dim 64/128, AVX2 or better)."""
    module = load_native()
    return module is not None and module.prefill_attention_supported(query, key_cache)


def paged_prefill_attention_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same signature and result as ``paged_prefill_attention_torch`` (up to rounding)."""
    return _module_or_raise().paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        window or 0,
        softcap or 0.0,
        sinks,
    )


def rms_norm_native(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as ``rms_norm_torch``; ``x`` may have any leading shape."""
    shape = x.shape
    out, new_residual = _module_or_raise().rms_norm(
        x.reshape(-1, shape[-1]), weight, eps, None if residual is None else residual.reshape(-1, shape[-1])
    )
    return out.view(shape), new_residual.view(shape)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """Same signature and result as ``silu_and_mul_torch`` (2-D input)."""
    return _module_or_raise().silu_and_mul(x)


def rotary_embedding_native(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as ``rotary_embedding_torch``."""
    module = _module_or_raise()
    return module.rotate(query, positions, cos_sin_cache), module.rotate(key, positions, cos_sin_cache)


def reshape_and_cache_native(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same signature and effect as ``reshape_and_cache_torch`` (one memcpy per token, -1 skipped)."""
    _module_or_raise().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


if __name__ == "__main__":  # `python -m llmctl_kernels.cpu_native`: which native kernels this install has
    from llmctl_kernels import decode_loop, gemm_native, kv_quant_native, moe_native, quant_native

    def describe(module, variant: str | None, reason: str | None) -> str:
        return f"{module.__name__}{f' ({variant})' if variant else ''}" if module is not None else str(reason)

    module = load_native()
    print("native CPU kernels:", describe(module, module and isa_level(), native_unavailable_reason()))
    quant = quant_native.load_quant_native()
    print("quantized CPU kernels:", describe(quant, quant and quant.isa(), quant_native.native_unavailable_reason()))
    kv = kv_quant_native.load_kv_quant_native()
    print("quantized-KV CPU kernels:", describe(kv, kv and kv.isa(), kv_quant_native.native_unavailable_reason()))
    loop = decode_loop.load_decode_loop()
    print("native decode loop:", describe(loop, None, decode_loop.unavailable_reason()))
    gemm = gemm_native.load_gemm_native()
    print("fp32 GEMM kernels:", describe(gemm, gemm and isa_level(), gemm_native.native_unavailable_reason()))
    moe = moe_native.load_moe_native()
    print("MoE experts call:", describe(moe, None, moe_native.EXTENSION.unavailable_reason()))
