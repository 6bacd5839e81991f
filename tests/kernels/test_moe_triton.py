"""The Triton fused experts against the torch reference (``StackedExperts.forward``).

Tolerance: fp32 gives the reference's products in another summation order (the interpreter
multiplies in numpy); bf16 compares at bf16 precision (each matmul rounds its output to bf16).
"""

from __future__ import annotations

import functools

import pytest
import torch
from kernel_testing import DEVICE

from llmctl.distributed import TensorParallel
from llmctl.layers.moe import RouterSpec, StackedExperts, clamped_swiglu, route
from llmctl_kernels.activation import silu_and_mul_torch
from llmctl_kernels.moe_triton import align_by_expert, fused_experts_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, *, bias: bool, act) -> StackedExperts:
    torch.manual_seed(num_experts * 100 + hidden)
    experts = StackedExperts(num_experts, hidden, inter, dtype=dtype, tp=TensorParallel(), act=act, bias=bias)
    experts.w13.data.copy_(torch.randn_like(experts.w13, dtype=torch.float32) * 0.2)
    experts.w2.data.copy_(torch.randn_like(experts.w2, dtype=torch.float32) * 0.2)
    if bias:
        experts.w13_bias.data.copy_(torch.randn_like(experts.w13_bias, dtype=torch.float32) * 0.1)
        experts.w2_bias.data.copy_(torch.randn_like(experts.w2_bias, dtype=torch.float32) * 0.1)
    return experts.to(DEVICE)


def test_alignment_groups_pairs_by_expert_in_token_order_and_pads_each_run() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 chosen by nobody
    pairs, block_experts = align_by_expert(ids, num_experts=4, block_m=4)
    assert block_experts.tolist() == [0, 2, 3]  # one block each; expert 1 owns none
    assert pairs.tolist() == [1, 4, -1, -1, 0, 2, 5, -1, 3, -1, -1, -1]


def test_alignment_spans_several_blocks_for_a_busy_expert() -> None:
    ids = torch.zeros(5, 1, dtype=torch.int64)
    pairs, block_experts = align_by_expert(ids, num_experts=2, block_m=2)
    assert block_experts.tolist() == [0, 0, 0]
    assert pairs.tolist() == [0, 1, 2, 3, 4, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 4, 2), (7, 8, 2), (40, 8, 3)])
def test_matches_the_torch_reference(dtype: torch.dtype, tokens: int, num_experts: int, top_k: int) -> None:
    experts = _experts(num_experts, 32, 48, dtype, bias=False, act=silu_and_mul_torch)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens)).to(dtype).to(DEVICE)
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    weights, ids = route(logits, RouterSpec(num_experts, top_k))
    expected = experts(x, weights, ids)
    got = fused_experts_triton(x, experts.w13, experts.w2, weights, ids, experts.act)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_biases_and_the_gpt_oss_activation() -> None:
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=7.0)
    experts = _experts(4, 32, 32, torch.float32, bias=True, act=act)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 3
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    weights, ids = route(logits, RouterSpec(4, 2, norm_topk_prob=False, scoring="topk_softmax"))
    expected = experts(x, weights, ids)
    got = fused_experts_triton(x, experts.w13, experts.w2, weights, ids, act, experts.w13_bias, experts.w2_bias)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_an_unchosen_experts_weights_are_never_read() -> None:
    experts = _experts(4, 32, 32, torch.float32, bias=False, act=silu_and_mul_torch)
    ids = torch.tensor([[0, 2], [2, 0], [0, 2]], device=DEVICE)
    weights = torch.full((3, 2), 0.5, device=DEVICE)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    expected = experts(x, weights, ids)
    experts.w13.data[1].fill_(float("nan"))  # read, these would turn the output into NaN
    experts.w2.data[3].fill_(float("nan"))
    got = fused_experts_triton(x, experts.w13, experts.w2, weights, ids, experts.act)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
