"""Triton fused experts for mixture-of-experts layers: every active expert's gate-up and down
matmuls in two launches, whatever the number of experts.

The (token, slot) pairs of a batch are sorted by expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (``align_by_expert``, vLLM's ``moe_align_block_size`` in torch), so every
row block of a launch belongs to one expert: a program reads that expert's weight tiles and
gathers its rows through the sorted index, and an expert no token chose owns no block and is
never read. The gate-up launch gathers rows of ``x`` (one per pair); the down launch reads the
activations in the padded order and scales each row by its pair's routing weight. The rows go
back to (token, slot) order and each token sums its ``top_k`` rows in slot order, as the torch
reference (``StackedExperts.forward``) does. Tested against that reference under
``TRITON_INTERPRET=1``; compiled for sm_90 by tests/kernels/sm90_compile.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from llmctl_kernels._triton_utils import cdiv, dots_in_fp32, fp32_dot_precision, last_dim_contiguous


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    rows_ptr,  # int32 [P]: the row of ``a`` each padded row reads (-1: padding)
    experts_ptr,  # int32 [P // BLOCK_M]: the expert of each row block
    w_ptr,  # [E, N, K]
    bias_ptr,  # [E, N] (HAS_BIAS)
    scale_ptr,  # fp32 [P]: per padded row (HAS_SCALE)
    out_ptr,  # [P, N]
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    rows = tl.load(rows_ptr + offs_m)
    m_ok = rows >= 0
    n_ok = offs_n < N
    a_rows = a_ptr + tl.where(m_ok, rows, 0).to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=DOT_PREC)
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    out_dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:  # rounded to the output dtype first, as ``linear(...) + bias`` in that dtype is
        bias = tl.load(bias_ptr + expert * N + offs_n, mask=n_ok, other=0.0)
        acc = (acc.to(out_dtype) + bias[None, :].to(out_dtype)).to(tl.float32)
    if HAS_SCALE:
        acc = acc.to(out_dtype).to(tl.float32) * tl.load(scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_dtype), mask=n_ok[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [T, top_k]`` -> ``pairs`` int32 ``[P]`` (the flat (token, slot) index each padded row
    holds, grouped by expert in token order, each expert's run padded with -1 to a multiple of
    ``block_m``) and ``block_experts`` int32 ``[P // block_m]``."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    sorted_experts = flat.index_select(0, order)
    rank = torch.arange(flat.numel(), device=flat.device) - starts.index_select(0, sorted_experts)
    dest = padded_starts.index_select(0, sorted_experts) + rank
    total = int(padded.sum())
    pairs = torch.full((total,), -1, dtype=torch.int32, device=flat.device)
    pairs[dest] = order.to(torch.int32)
    block_experts = torch.repeat_interleave(
        torch.arange(num_experts, dtype=torch.int32, device=flat.device), padded // block_m
    )
    return pairs, block_experts


def _grouped_gemm(
    a: torch.Tensor,
    rows: torch.Tensor,
    block_experts: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    block_m: int,
) -> torch.Tensor:
    a, w = last_dim_contiguous(a), w.contiguous()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(rows.numel(), n, dtype=a.dtype, device=a.device)
    if rows.numel() == 0:
        return out
    fp32 = dots_in_fp32(a.dtype)
    block_n, block_k = (32, 32) if fp32 else (64, 64)
    grid = (rows.numel() // block_m, cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        rows,
        block_experts,
        w,
        bias if bias is not None else w,
        scale if scale is not None else w,
        out,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_FP32=fp32,
        DOT_PREC=fp32_dot_precision(),
    )
    return out


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [T, H]``, stacked ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (optional biases ``[E, 2I]``,
    ``[E, H]``), routing ``weights`` and expert ``ids`` ``[T, top_k]`` -> ``[T, H]``: the routed
    sum ``StackedExperts.forward`` computes, up to summation order inside each matmul."""
    num_tokens, top_k = ids.shape
    hidden = w2.shape[1]
    block_m = 16 if num_tokens * top_k <= 256 else 32
    pairs, block_experts = align_by_expert(ids, w13.shape[0], block_m)
    valid = pairs >= 0
    token_rows = torch.where(valid, pairs // top_k, -1).to(torch.int32)
    gate_up = _grouped_gemm(x, token_rows, block_experts, w13, w13_bias, None, block_m)
    activated = act(gate_up)
    padded_rows = torch.where(valid, torch.arange(pairs.numel(), device=x.device, dtype=torch.int32), -1)
    pair_weights = weights.reshape(-1).to(torch.float32).index_select(0, pairs.clamp(min=0).long())
    down = _grouped_gemm(activated, padded_rows, block_experts, w2, w2_bias, pair_weights, block_m)
    unsorted = torch.empty(num_tokens * top_k, hidden, dtype=down.dtype, device=x.device)
    unsorted.index_copy_(0, pairs[valid].long(), down[valid])
    return unsorted.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
