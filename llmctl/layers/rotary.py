"""Rotary position embedding with the scaling schemes of the supported families.

The cos/sin table is computed once for every position in fp32, exactly as ``transformers``
computes it per step, so positions produce bit-identical rotations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmctl.errors import UnsupportedModelError
from llmctl.layers.ops import TorchOps


def inverse_frequencies(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return llama3_inverse_frequencies(inv_freq, scaling)
    raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported (supported: default, linear, llama3)")


def llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by ``factor``, short ones
    kept, and the band between them interpolated smoothly."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, rotary_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None, *, ops: TorchOps
    ) -> None:
        super().__init__()
        self.ops = ops
        inv_freq = inverse_frequencies(rotary_dim, base, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache)
