"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(normed, new_residual)``; ``new_residual = x + residual`` (or ``x``).

    Follows Hugging Face's op order exactly (add in the input dtype, normalise in fp32, cast back,
    then scale) so that fp32 and bf16 results are bit-identical to ``transformers``.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(dtype)
    return weight * normed, x


def rms_norm_triton(
    x: torch.Tensor,  # [num_tokens, hidden] (any leading shape)
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: one program per row holds the whole row (``BLOCK = next_pow2(hidden)``), adds the
    residual in the input dtype, reduces in fp32, casts back, then scales — the reference's order."""
    from llmctl_kernels import _triton_elementwise as te
    from llmctl_kernels._triton_utils import interpreting, next_pow2

    if residual is not None and residual.dtype != x.dtype:  # mixed dtypes promote: add in torch first
        x = x + residual
        return rms_norm_triton(x, weight, eps)[0], x
    shape = x.shape
    hidden = shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = torch.result_type(weight, x)
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    if residual is not None:
        assert residual.shape == shape, "residual must have x's shape"
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_residual = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    else:
        r2, new_residual = x2, x2
    if rows:
        block = next_pow2(hidden)
        te._rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight.contiguous(),
            out,
            new_residual,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_residual.stride(0),
            float(eps),
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            EMULATE_RNE=interpreting(),
            num_warps=min(16, max(1, block // 512)),
        )
    out = out.view(shape)
    return out, (new_residual.view(shape) if residual is not None else x)
