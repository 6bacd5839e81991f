"""The multi-LoRA kernels against the torch reference: the grouped CPU path and the Triton kernels
(under TRITON_INTERPRET=1 on a CPU), on batches mixing adapters, ranks and base-model tokens."""

from __future__ import annotations

import pytest
import torch

from llmctl_kernels.lora import NO_ADAPTER, lora_add_grouped, lora_delta_reference, plan_lora_batch


def _weights(slots: int, rank: int, k: int, n: int, dtype: torch.dtype, used_rank: list[int]):
    g = torch.Generator().manual_seed(rank * 7 + k)
    a = torch.randn(slots, rank, k, generator=g) * 0.2
    b = torch.randn(slots, n, rank, generator=g) * 0.2
    for s, r in enumerate(used_rank):  # an adapter of smaller rank: the padding is zero
        a[s, r:] = 0
        b[s, :, r:] = 0
    scale = torch.tensor([0.5 + s for s in range(slots)], dtype=torch.float32)
    return a.to(dtype), b.to(dtype), scale


# tokens of slots 2, 0, base, 1 interleaved: groups that are neither contiguous nor sorted
TOKEN_SLOTS = [2, 2, 0, NO_ADAPTER, 1, 0, 2, NO_ADAPTER] + [1] * 19 + [0, 2, NO_ADAPTER]


@pytest.mark.parametrize("rank", [8, 64])
def test_grouped_matches_reference(rank: int) -> None:
    k, n = 48, 40
    a, b, scale = _weights(3, rank, k, n, torch.float32, [rank, rank // 2, 3])
    x = torch.randn(len(TOKEN_SLOTS), k)
    base = torch.randn(len(TOKEN_SLOTS), n)
    plan = plan_lora_batch(TOKEN_SLOTS, x.device)
    out = base.clone()
    lora_add_grouped(out, x, a, b, scale, plan)
    expected = base + lora_delta_reference(x, a, b, scale, plan.slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    base_rows = [t for t, s in enumerate(TOKEN_SLOTS) if s == NO_ADAPTER]
    assert torch.equal(out[base_rows], base[base_rows])  # the base model's tokens are untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 64])
def test_triton_matches_reference(rank: int, dtype: torch.dtype) -> None:
    from llmctl_kernels.lora_triton import BLOCK_M, lora_add_triton

    k, n, wide = 48, 40, 100
    a, b, scale = _weights(3, rank, k, n, dtype, [rank, rank // 2, 3])
    x = torch.randn(len(TOKEN_SLOTS), k).to(dtype)
    full = torch.randn(len(TOKEN_SLOTS), wide).to(dtype)
    expected = full.clone()
    plan = plan_lora_batch(TOKEN_SLOTS, x.device, block_m=BLOCK_M)
    # the delta lands in a column slice of a wider output (one part of a fused projection)
    expected[:, 30 : 30 + n] = (full[:, 30 : 30 + n].float() + lora_delta_reference(x, a, b, scale, plan.slots)).to(
        dtype
    )
    lora_add_triton(full[:, 30 : 30 + n], x, a, b, scale, plan)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), expected.float(), rtol=tol, atol=tol)
