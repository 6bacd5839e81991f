"""Rotary position embedding with the scaling schemes of the supported families.

The cos/sin table is computed once for every position in fp32, exactly as ``transformers``
computes it per step (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``, then ``cos * attention_factor``),
so positions produce bit-identical rotations. Scalings: ``default``, ``linear``, ``llama3`` (Llama
3.1+), ``yarn`` (Qwen2.5/Qwen3 and Llama-style configs; its attention factor, from ``factor``,
``mscale`` and ``mscale_all_dim`` unless given, scales cos and sin) and ``longrope`` (Phi-3/3.5/4:
two tables, see ``RotaryEmbedding``). ``partial_rotary_factor`` in the scaling dict rotates only the
first ``int(head_dim * factor)`` dims of each head; the rest pass through (every rotary kernel
copies the dims past the table's width).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmctl.errors import UnsupportedModelError
from llmctl.layers.ops import TorchOps

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _base_inverse_frequencies(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _unsupported(rope_type: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"rope scaling {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def inverse_frequencies(
    rotary_dim: int,
    base: float,
    scaling: dict[str, Any] | None,
    max_position_embeddings: int | None = None,
    *,
    long: bool = False,
) -> torch.Tensor:
    """The ``rotary_dim // 2`` inverse frequencies of ``scaling``'s rope type. ``max_position_embeddings``
    (config.json's) is the default for ``original_max_position_embeddings`` and, with it, for a
    missing yarn/longrope ``factor``; ``long`` picks LongRoPE's long factors."""
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return _base_inverse_frequencies(rotary_dim, base)
    if rope_type == "linear":
        return _base_inverse_frequencies(rotary_dim, base) / float(scaling["factor"])
    if rope_type == "llama3":
        return llama3_inverse_frequencies(_base_inverse_frequencies(rotary_dim, base), scaling)
    if rope_type == "yarn":
        return yarn_inverse_frequencies(rotary_dim, base, scaling, max_position_embeddings)
    if rope_type == "longrope":
        return longrope_inverse_frequencies(rotary_dim, base, scaling, long=long)
    raise _unsupported(rope_type)


def attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int | None = None) -> float:
    """The factor transformers multiplies cos and sin by (1.0 except for yarn and longrope)."""
    rope_type = rope_type_of(scaling)
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    original = _original_max_positions(scaling, max_position_embeddings)
    factor = _factor(scaling, max_position_embeddings, original)
    if rope_type == "yarn":
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        return yarn_get_mscale(factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _original_max_positions(scaling: dict[str, Any], max_position_embeddings: int | None) -> int:
    original = scaling.get("original_max_position_embeddings", max_position_embeddings)
    if original is None:
        raise UnsupportedModelError(f"rope scaling {rope_type_of(scaling)!r} needs original_max_position_embeddings")
    return int(original)


def _factor(scaling: dict[str, Any], max_position_embeddings: int | None, original: int) -> float:
    factor = scaling.get("factor")
    if factor is None:  # transformers: the ratio of the two context lengths
        if max_position_embeddings is None:
            raise UnsupportedModelError(f"rope scaling {rope_type_of(scaling)!r} needs a factor")
        return max_position_embeddings / original
    return factor


def yarn_get_mscale(scale: float = 1, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by ``factor``, short ones
    kept, and the band between them interpolated smoothly. ``freq_factors`` instead (a GGUF file's
    ``rope_freqs`` whose parameters could not be recovered) divides each frequency by its own."""
    if "freq_factors" in scaling:
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
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


def yarn_inverse_frequencies(
    rotary_dim: int, base: float, scaling: dict[str, Any], max_position_embeddings: int | None
) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): frequencies that turn fewer than ``beta_slow`` times over the original
    context are interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept,
    a linear ramp between them (its ends rounded outwards unless ``truncate`` is false)."""
    original = _original_max_positions(scaling, max_position_embeddings)
    factor = _factor(scaling, max_position_embeddings, original)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    dim = rotary_dim

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def longrope_inverse_frequencies(rotary_dim: int, base: float, scaling: dict[str, Any], *, long: bool) -> torch.Tensor:
    """LongRoPE: each frequency divided by its own factor, from ``long_factor`` or ``short_factor``."""
    factors = scaling["long_factor" if long else "short_factor"]
    if len(factors) != rotary_dim // 2:
        name = "long_factor" if long else "short_factor"
        raise UnsupportedModelError(
            f"rope scaling longrope: {name} has {len(factors)} values, expected {rotary_dim // 2}"
        )
    ext_factors = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext_factors * base**shape)


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int, scale: float = 1.0) -> torch.Tensor:
    """``[max_positions, rotary_dim]``: cos in the first half of each row, sin in the second."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """The rotary embedding of every layer, with one fp32 cos/sin table for every position.

    ``head_dim`` is the width of a head; with ``partial_rotary_factor`` in ``scaling`` only its first
    ``rotary_dim = int(head_dim * factor)`` dims rotate.

    LongRoPE keeps two tables, the short factors' at rows ``[0, max_positions)`` and the long
    factors' at ``[max_positions, 2 * max_positions)`` of ``cos_sin_cache`` (as vLLM's
    ``Phi3LongRoPEScaledRotaryEmbedding``). Which one a token uses is transformers' rule, decided per
    sequence: the short table while the sequence (every token it has, including those processed in
    this step) is at most ``original_max_position_embeddings`` long, the long one for every token of a
    longer sequence. transformers picks by the highest position of a forward call
    (``dynamic_rope_update``), and Phi-3's ``generate`` recomputes the whole sequence when it first
    grows past that length, so the keys of a longer sequence were all rotated by the long table. The
    model applies the rule (``table_positions``, llmctl/models/phi3.py recomputes a sequence's cache
    at that step); the positions this module receives already point into the chosen table.
    """

    def __init__(
        self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None, *, ops: TorchOps
    ) -> None:
        super().__init__()
        self.ops = ops
        self.head_dim = head_dim
        self.rope_type = rope_type_of(scaling)
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise _unsupported(self.rope_type)
        partial = float((scaling or {}).get("partial_rotary_factor", 1.0) or 1.0)
        self.rotary_dim = int(head_dim * partial)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise UnsupportedModelError(f"partial_rotary_factor {partial} gives an odd or empty rotary width")
        self.max_positions = max_positions
        scale = attention_factor(scaling, max_positions)
        inv_freq = inverse_frequencies(self.rotary_dim, base, scaling, max_positions)
        table = cos_sin_table(inv_freq, max_positions, scale)
        self.original_max_positions: int | None = None
        self.positions_select_table = False  # set by a model that applies the LongRoPE rule
        if self.rope_type == "longrope":
            self.original_max_positions = _original_max_positions(scaling, max_positions)
            long_freq = inverse_frequencies(self.rotary_dim, base, scaling, max_positions, long=True)
            table = torch.cat((table, cos_sin_table(long_freq, max_positions, scale)))
        self.register_buffer("cos_sin_cache", table, persistent=False)

    @property
    def has_long_table(self) -> bool:
        return self.original_max_positions is not None

    def table_positions(self, positions: torch.Tensor, long: torch.Tensor) -> torch.Tensor:
        """Rows of ``cos_sin_cache`` for ``positions``: the long table's where ``long`` is true."""
        return positions + long.to(positions.dtype) * self.max_positions

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.has_long_table and not self.positions_select_table:
            raise UnsupportedModelError("longrope rope scaling is implemented for Phi3ForCausalLM only")
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache)
