"""KV store: write one step's keys and values into the paged cache through the slot mapping."""

from __future__ import annotations

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
    value_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(
        0, slots, value.to(value_cache.dtype)
    )


def reshape_and_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
) -> None:
    """Triton: one program per token writes all its KV heads ([BLOCK_H, BLOCK_D] tile) to
    ``slot = slot_mapping[t]``; a negative slot returns at once. Offsets are int64."""
    from kernels import _triton_elementwise as te
    from kernels._triton_utils import interpreting, last_dim_contiguous, next_pow2

    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need a unit stride on head_dim"
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    slot_mapping = slot_mapping.contiguous()
    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    te._reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        EMULATE_RNE=interpreting(),
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
