"""KV store: write one step's keys and values into the paged cache through the slot mapping."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def reshape_and_cache_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    key_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))


def reshape_and_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
) -> None:
    """Triton: one program per token writes all its KV heads ([BLOCK_H, BLOCK_D] tile) to
    ``slot = slot_mapping[t]``; a negative slot returns at once. Offsets are int64."""
    from llmctl_kernels import _triton_elementwise as te
    from llmctl_kernels._triton_utils import interpreting, last_dim_contiguous, next_pow2

    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need a unit stride on head_dim"
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    slot_mapping = slot_mapping.contiguous()
    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    te._reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        EMULATE_RNE=interpreting(),
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )


# fp8 code layouts for the store's bit-level encoder: (mantissa bits, exponent bias, largest finite code)
_FP8_CODES = {"fp8_e4m3": (3, 7, 0x7E), "fp8_e5m2": (2, 15, 0x7B)}


def quantize_and_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    cache: Mapping[str, torch.Tensor],  # one layer's per-token-format K/V (llmctl/engine/kv_cache.py)
    kind: str,  # fp8_e4m3 | fp8_e5m2 | int8
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
) -> None:
    """``reshape_and_cache_triton`` that quantizes: per (token, KV head) scale = amax / qmax and
    its codes, bit for bit ``kv_quant.quantize_per_token`` (one program per token)."""
    from llmctl_kernels import _triton_kv_quant as tq
    from llmctl_kernels import kv_quant as kq
    from llmctl_kernels._triton_utils import last_dim_contiguous, next_pow2

    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    kc, vc, ks, vs = cache["k"], cache["v"], cache["k_scale"], cache["v_scale"]
    _, block_size, num_kv_heads, head_dim = kc.shape
    assert kc.stride(-1) == 1 and vc.stride(-1) == 1, "caches need a unit stride on head_dim"
    assert ks.stride(-1) == 1 and vs.stride(-1) == 1, "scales need a unit stride over heads"
    if kind in kq.FP8_DTYPES:  # codes are written as their bits
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    mant, bias, max_code = _FP8_CODES.get(kind, (0, 0, 0))
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    tq._quant_store_kernel[(num_tokens,)](
        key,
        value,
        kc,
        ks,
        vc,
        vs,
        slot_mapping.contiguous(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        ks.stride(0),
        ks.stride(1),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        vs.stride(0),
        vs.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QMAX=float(kq._qmax(kind)),
        FP8_MANT=mant,
        FP8_BIAS=bias,
        FP8_MAX_CODE=max_code,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )


def kivi_quantize_blocks_triton(
    staging_key: torch.Tensor,  # [B, block_size, num_kv_heads, head_dim]: whole blocks in full precision
    staging_value: torch.Tensor,
    staging_index: torch.Tensor,  # [F] int: the staging rows to quantize
    blocks: torch.Tensor,  # [F] int: the pool blocks they become
    cache: Mapping[str, torch.Tensor],  # one layer's KIVI K/V (llmctl/engine/kv_cache.py)
    bits: int,  # 2 | 4
) -> None:
    """KIVI's store at block close: quantize completed blocks (keys per channel over the block's
    tokens, values per token over channel groups) into the pool, bit for bit
    ``kv_quant.quantize_kivi_keys`` / ``quantize_kivi_values``. One program per (block, KV head)."""
    from llmctl_kernels import _triton_kv_quant as tq
    from llmctl_kernels._triton_utils import next_pow2

    if blocks.numel() == 0:
        return
    _, block_size, num_kv_heads, head_dim = staging_key.shape
    assert staging_key.stride() == staging_value.stride() and staging_key.stride(-1) == 1
    kc, ks, kz, vc, vs, vz = (cache[n] for n in ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero"))
    assert ks.stride() == kz.stride() and vs.stride() == vz.stride() and ks.stride(-1) == 1 and vs.stride(-1) == 1
    per_byte = 8 // bits
    group = head_dim // vs.shape[-1]
    assert group % per_byte == 0, "a value group must fill whole bytes"
    tq._kivi_finalize_kernel[(blocks.shape[0], num_kv_heads)](
        staging_key,
        staging_value,
        staging_index.contiguous(),
        blocks.contiguous(),
        kc,
        ks,
        kz,
        vc,
        vs,
        vz,
        staging_key.stride(0),
        staging_key.stride(1),
        staging_key.stride(2),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        ks.stride(0),
        ks.stride(1),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        vs.stride(0),
        vs.stride(1),
        vs.stride(2),
        BITS=bits,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP_SIZE=group,
        BLOCK_T=next_pow2(block_size),
        NB_P=next_pow2(head_dim // per_byte),
        NG_P=next_pow2(head_dim // group),
        GB_P=next_pow2(group // per_byte),
        num_warps=4,
    )
