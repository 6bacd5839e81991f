"""Quantized KV cache: the torch references for quantize-on-store and dequantize-in-attention.

Formats (one per ``--kv-cache-dtype``; layouts in ``llmctl/engine/kv_cache.py``):

- ``fp8_e4m3`` / ``fp8_e5m2`` / ``int8``: one float32 scale per (token, KV head) = amax / qmax,
  set when the token is stored. A per-block scale would have to be known before the block's later
  tokens arrive (or rewrite earlier codes); per token it never has to be revised, and costs 4 bytes
  per 64-256 code bytes.
- ``kivi2`` / ``kivi4`` (KIVI, arXiv 2402.02750): asymmetric min-max codes of 2 or 4 bits. Keys are
  quantized per channel over a group of tokens (the block), values per token over groups of
  ``group_size`` channels; scale and zero are float16. Codes are packed little-end first along
  head_dim (code ``d`` sits in byte ``d // (8 // bits)`` at bit ``(d % (8 // bits)) * bits``).

Every function here is the oracle the native and Triton kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
PER_TOKEN_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
KIVI_BITS = {"kivi2": 2, "kivi4": 4}
KV_CACHE_DTYPES = ("auto", *PER_TOKEN_DTYPES, *KIVI_BITS)  # = llmctl.config.KV_CACHE_DTYPES


def code_dtype(kind: str) -> torch.dtype:
    """The storage dtype of a per-token format's codes."""
    return FP8_DTYPES.get(kind, torch.int8)


def _qmax(kind: str) -> float:
    return torch.finfo(FP8_DTYPES[kind]).max if kind in FP8_DTYPES else 127.0


# ---- per token (fp8, int8) ----------------------------------------------------------------------
def quantize_per_token(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (codes ``[..., D]``, float32 scale ``[...]``), scale = amax / qmax."""
    xf = x.float()
    scale = xf.abs().amax(-1) / _qmax(kind)
    scaled = xf / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    if kind in FP8_DTYPES:
        return scaled.to(FP8_DTYPES[kind]), scale
    return scaled.round().clamp(-127, 127).to(torch.int8), scale


def dequantize_per_token(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)


# ---- KIVI --------------------------------------------------------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (each < 2**bits) -> ``[..., D * bits // 8]`` bytes."""
    per_byte = 8 // bits
    grouped = codes.to(torch.int32).unflatten(-1, (-1, per_byte))
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``pack_codes``: ``[..., D * bits // 8]`` bytes -> int32 codes ``[..., D]``."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _minmax_codes(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes of ``x`` given its group minimum/maximum (broadcastable). Scale and zero
    are rounded to float16 *before* the codes are taken, so dequantization uses what was stored;
    they saturate at float16's range (|x| > 65504 loses precision there but never becomes inf)."""
    levels = (1 << bits) - 1
    fmax = torch.finfo(torch.float16).max
    scale = ((hi - lo) / levels).clamp(max=fmax).to(torch.float16)
    zero = lo.clamp(-fmax, fmax).to(torch.float16)
    s = scale.float()
    q = ((x - zero.float()) / torch.where(s > 0, s, 1.0)).round().clamp(0, levels).to(torch.uint8)
    return q, scale, zero


def quantize_kivi_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of whole blocks ``[..., T, H, D]``, one group per channel over the T tokens ->
    (packed ``[..., T, H, D*bits/8]``, scale ``[..., H, D]`` f16, zero ``[..., H, D]`` f16)."""
    kf = k.float()
    lo, hi = kf.amin(-3), kf.amax(-3)
    q, scale, zero = _minmax_codes(kf, lo.unsqueeze(-3), hi.unsqueeze(-3), bits)
    return pack_codes(q, bits), scale.squeeze(-3), zero.squeeze(-3)


def dequantize_kivi_keys(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    q = unpack_codes(packed, bits).float()
    return (q * scale.float().unsqueeze(-3) + zero.float().unsqueeze(-3)).to(dtype)


def quantize_kivi_values(
    v: torch.Tensor, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``[..., D]``, one group per token over ``group_size`` channels -> (packed
    ``[..., D*bits/8]``, scale ``[..., D/group]`` f16, zero ``[..., D/group]`` f16)."""
    vg = v.float().unflatten(-1, (-1, group_size))
    q, scale, zero = _minmax_codes(vg, vg.amin(-1, keepdim=True), vg.amax(-1, keepdim=True), bits)
    return pack_codes(q.flatten(-2), bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_kivi_values(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    q = unpack_codes(packed, bits).float().unflatten(-1, (-1, group_size))
    return (q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2).to(dtype)


# ---- attention over a quantized paged cache ----------------------------------------------------
def decode_attention_dense(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query ``[S, Hq, D]`` against gathered, dequantized ``keys/values [S, L, Hkv, D]``, within a
    sliding ``window`` and with a logit ``softcap`` when given (kernels/prefill_attention.py)."""
    if window is not None or softcap is not None:
        from llmctl_kernels.decode_attention import decode_attention_gathered

        return decode_attention_gathered(
            query, keys.transpose(1, 2), values.transpose(1, 2), seq_lens, scale, window, softcap
        )
    max_len = keys.shape[1]
    positions = torch.arange(max_len, device=query.device)
    mask = (positions[None, :] < seq_lens[:, None].to(positions.dtype))[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=query.shape[1] != keys.shape[2],
    )
    return out.squeeze(2)


def attend_causal_kivi(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    exact_keys: torch.Tensor,
    exact_values: torch.Tensor,
    window_tokens: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``len(query)`` positions as KIVI decoding would have seen them.
    The sequence's blocks form window groups of ``window_tokens`` (N blocks); a group is quantized
    by the token that completes it. So query ``p`` reads the tokens of its own group in full
    precision (``exact_*``) unless ``p`` completes the group, and every earlier group dequantized
    (``keys``/``values``, all ``[L, Hkv, D]``). ``sliding_window`` and ``softcap``: the model's
    attention window and logit cap (kernels/prefill_attention.py), not KIVI's residual window."""
    q_len, kv_len = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
    kv_pos = torch.arange(kv_len, device=query.device)[None, :]
    exact = kv_pos // window_tokens >= (q_pos + 1) // window_tokens
    k, v, ek, ev = (t.float().repeat_interleave(group, dim=1) for t in (keys, values, exact_keys, exact_values))
    q = query.float()
    scores = torch.where(exact, torch.einsum("qhd,khd->hqk", q, ek), torch.einsum("qhd,khd->hqk", q, k)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    hidden = kv_pos > q_pos
    if sliding_window is not None:
        hidden = hidden | (kv_pos <= q_pos - sliding_window)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs * ~exact, v) + torch.einsum("hqk,khd->qhd", probs * exact, ev)
    return out.to(query.dtype)
