"""SiLU-and-mul: the gated activation of Llama-family MLPs on a merged [gate | up] projection; and
GeLU(tanh)-and-mul (GeGLU), Gemma's."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    """Gemma's GeGLU: transformers' ``gelu_pytorch_tanh`` (``F.gelu(approximate="tanh")``) on the
    gate, times the up projection, in the input dtype as there."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    """Triton: a 2-D grid of (row, BLOCK-column chunk); SiLU in fp32, rounded to the input dtype
    before the multiply, as ``F.silu(gate) * up`` does."""
    from llmctl_kernels import _triton_elementwise as te
    from llmctl_kernels._triton_utils import cdiv, interpreting, next_pow2

    shape = x.shape
    d = shape[-1] // 2
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows and d:
        block = min(1024, next_pow2(d))
        te._silu_and_mul_kernel[(rows, cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), D=d, BLOCK=block, EMULATE_RNE=interpreting(), num_warps=4
        )
    return out.view(*shape[:-1], d)
