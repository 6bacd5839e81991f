"""Rotary position embedding (Hugging Face "rotate half" / NeoX layout)."""

from __future__ import annotations

import torch


def rotary_embedding_torch(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32: cos in the first half, sin in the second
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary_cos_sin(positions, cos_sin_cache, query.dtype)
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)


def rotary_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[T, 1, rotary_dim]`` cos and sin rows of each position, cast to the activations' dtype
    (the same for every layer of a step, so callers may compute them once per step)."""
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, rotary_dim/2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(dtype)
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def rotary_embedding_triton(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32: cos in the first half, sin in the second
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: one program per token rotates all its query and key heads with one cos/sin row
    (llama3 or any other scaling is already baked into the cache); dims past ``rotary_dim`` are
    copied through."""
    from llmctl_kernels import _triton_elementwise as te
    from llmctl_kernels._triton_utils import interpreting, last_dim_contiguous, next_pow2

    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, "rotary_dim must be even and <= head_dim"
    query, key = last_dim_contiguous(query), last_dim_contiguous(key)
    cos_sin_cache = last_dim_contiguous(cos_sin_cache)
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    assert key.dtype == query.dtype, "query and key must share a dtype"
    half = rotary_dim // 2
    pass_dims = head_dim - rotary_dim
    te._rotary_kernel[(num_tokens,)](
        positions.contiguous(),
        query,
        key,
        q_out,
        k_out,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HQ=next_pow2(num_q_heads),
        BLOCK_HK=next_pow2(num_kv_heads),
        BLOCK_HALF=next_pow2(half),
        PASS=pass_dims,
        BLOCK_PASS=next_pow2(pass_dims) if pass_dims else 1,
        EMULATE_RNE=interpreting(),
        num_warps=4,
    )
    return q_out, k_out
