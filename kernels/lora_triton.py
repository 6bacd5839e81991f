"""Triton multi-LoRA for CUDA: ``out[t] += (x[t] @ A[s]^T) @ B[s]^T * scale[s]`` for a batch whose
tokens belong to different adapters (``kernels/lora.py`` has the layouts and the torch reference).

The step's ``LoRABatchPlan`` sorts the adapter tokens by slot and cuts each slot's run into blocks
of ``BLOCK_M`` tokens, so every program multiplies one adapter's weights by up to 16 tokens with
``tl.dot`` (operands >= 16 in every dimension: the rank is padded to a power of two >= 16, masked).
Two kernels: *shrink* ``xa = x @ A^T`` (fp32 ``[tokens, rank]``), then *expand*
``out += xa @ B^T * scale`` over tiles of the output features; a token sits in one block, so no two
programs write the same element. bf16/fp16 operands are upcast to fp32 before ``tl.dot`` (the
interpreter multiplies bf16 wrongly, and at LoRA ranks the fp32 dots cost little).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmctl_kernels._triton_utils import cdiv, fp32_dot_precision, next_pow2
from llmctl_kernels.lora import LoRABatchPlan

BLOCK_M = 16  # tokens per program: plan_lora_batch(block_m=BLOCK_M)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    xa_ptr,
    order_ptr,
    block_slot_ptr,
    block_start_ptr,
    block_end_ptr,
    K,
    R,
    stride_xm,
    stride_as,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.load(block_slot_ptr + pid).to(tl.int64)
    start = tl.load(block_start_ptr + pid)
    end = tl.load(block_end_ptr + pid)
    pos = start + tl.arange(0, BLOCK_M)
    row_ok = pos < end
    token = tl.load(order_ptr + pos, mask=row_ok, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(
            x_ptr + token[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        a = tl.load(
            a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
            mask=(offs_r[None, :] < R) & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A^T
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision=DOT_PREC)
    tl.store(xa_ptr + pos[:, None] * BLOCK_R + offs_r[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _lora_expand_kernel(
    xa_ptr,
    b_ptr,
    scale_ptr,
    out_ptr,
    order_ptr,
    block_slot_ptr,
    block_start_ptr,
    block_end_ptr,
    N,
    R,
    stride_om,
    stride_bs,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid).to(tl.int64)
    start = tl.load(block_start_ptr + pid)
    end = tl.load(block_end_ptr + pid)
    pos = start + tl.arange(0, BLOCK_M)
    row_ok = pos < end
    token = tl.load(order_ptr + pos, mask=row_ok, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    xa = tl.load(xa_ptr + pos[:, None] * BLOCK_R + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    b = tl.load(
        b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
        mask=(offs_r[:, None] < R) & n_ok[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]: B^T
    delta = tl.dot(xa, b.to(tl.float32), input_precision=DOT_PREC) * tl.load(scale_ptr + slot)
    out_ptrs = out_ptr + token[:, None] * stride_om + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    current = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (current.to(tl.float32) + delta).to(current.dtype), mask=mask)


def lora_add_triton(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, plan: LoRABatchPlan
) -> None:
    """``out += delta`` in place (``out`` may be a column slice of a wider output: its rows' stride
    is kept). ``plan`` must have been built with ``block_m=BLOCK_M``."""
    num_blocks = plan.block_slot.numel()
    if num_blocks == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out.stride(-1) != 1:
        raise ValueError("lora_add_triton: the output's last dimension must be contiguous")
    _, rank, k = a.shape
    n = b.shape[1]
    block_r = max(16, next_pow2(rank))
    xa = torch.empty(plan.order.numel(), block_r, dtype=torch.float32, device=x.device)
    precision = fp32_dot_precision()
    a, b = a.contiguous(), b.contiguous()
    _lora_shrink_kernel[(num_blocks,)](
        x, a, xa, plan.order, plan.block_slot, plan.block_start, plan.block_end,
        k, rank, x.stride(0), a.stride(0), a.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=32, DOT_PREC=precision,
    )  # fmt: skip
    block_n = 64
    _lora_expand_kernel[(num_blocks, cdiv(n, block_n))](
        xa, b, scale, out, plan.order, plan.block_slot, plan.block_start, plan.block_end,
        n, rank, out.stride(0), b.stride(0), b.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=block_n, DOT_PREC=precision,
    )  # fmt: skip
