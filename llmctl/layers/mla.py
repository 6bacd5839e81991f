"""Multi-head latent attention (DeepSeek-V2's MLA) over a paged cache of latents.

A token's keys and values for every head are one up-projection (``kv_b_proj``) of a compressed
latent ``c`` (``kv_lora_rank`` numbers, already RMS-normed) plus one rotated key part ``k_pe``
(``qk_rope_head_dim`` numbers) shared by all heads. The cache stores only ``[c, k_pe]``: per token
and layer ``kv_lora_rank + qk_rope_head_dim`` numbers, instead of ``2 * heads * head_dim``.

The float pool stays the engine's ``[2, layers, blocks, block_size, kv_heads, head_dim]``: this
layer presents itself as one KV head of ``latent_dim / 2`` dims, its "key" block holding the
latent's first half and its "value" block the second, so the pool's sizing, block manager,
prefix cache and copy-on-write work unchanged and a token costs exactly ``latent_dim`` numbers.

- Prefill up-projects the context's latents to per-head keys ``[k_nope, k_pe]`` and values, as
  transformers' ``DeepseekV2Attention`` does, and attends causally.
- Decode uses the absorbed form: ``W_UK`` (the key rows of ``kv_b_proj``) folded into the query,
  ``q_nope @ W_UK`` scoring directly against the cached latents, and ``W_UV`` applied to the
  attention-weighted latent afterwards, so the context is never up-projected.

Torch references only (any device): the native CPU kernels, the native decode loop, the Triton
kernels, quantized KV pools and tensor parallelism do not take latents (each refused where it is
chosen, with the reason).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmctl.errors import UnsupportedModelError
from llmctl.layers.ops import AttentionMetadata
from llmctl_kernels.decode_attention import decode_attention_gathered, gather_kv
from llmctl_kernels.kv_store import reshape_and_cache_torch
from llmctl_kernels.prefill_attention import attend_causal


class LatentAttention(nn.Module):
    """Paged attention of ``num_heads`` heads over cached latents ``[c (kv_lora_rank), k_pe
    (rope_dim)]``; keys are ``[k_nope (nope_dim), k_pe]`` per head, values ``v_dim`` per head."""

    sliding_window = None  # MLA layers attend to the whole context

    def __init__(
        self, num_heads: int, kv_lora_rank: int, nope_dim: int, rope_dim: int, v_dim: int, scale: float
    ) -> None:
        super().__init__()
        self.latent_dim = kv_lora_rank + rope_dim
        if self.latent_dim % 2:
            raise UnsupportedModelError(
                f"kv_lora_rank + qk_rope_head_dim = {self.latent_dim} is odd: the latent cache stores it in two halves"
            )
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        self.scale = scale
        # The pool's view of this layer (module docstring): one KV head of half the latent each.
        self.num_kv_heads, self.head_dim = 1, self.latent_dim // 2
        self.key_cache: torch.Tensor | None = None  # bound by the model runner
        self.value_cache: torch.Tensor | None = None
        self.kv_group = 0

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, latent={self.kv_lora_rank}+{self.rope_dim}, v_dim={self.v_dim}"

    @property
    def quantized_kv(self) -> None:
        return None

    @quantized_kv.setter
    def quantized_kv(self, value: Any) -> None:
        if value is not None:
            raise UnsupportedModelError(
                "multi-head latent attention caches its latent in the model's dtype: the quantized KV "
                "formats have no latent layout; run with --kv-cache-dtype auto"
            )

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, nope_dim]
        q_pe: torch.Tensor,  # [T, H, rope_dim], rotated
        latent: torch.Tensor,  # [T, kv_lora_rank], normed
        k_pe: torch.Tensor,  # [T, rope_dim], rotated
        kv_b_weight: torch.Tensor,  # [H * (nope_dim + v_dim), kv_lora_rank]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H * v_dim]
        if self.key_cache is None or self.value_cache is None:
            raise RuntimeError("latent attention layer has no KV cache bound; the model runner binds it")
        if meta.groups is not None:
            meta = meta.groups[self.kv_group]
        rows = torch.cat((latent, k_pe), dim=-1)  # [T, latent_dim]: what the cache holds
        half = self.head_dim
        reshape_and_cache_torch(
            rows[:, None, :half], rows[:, None, half:], self.key_cache, self.value_cache, meta.slot_mapping
        )
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        n = meta.num_prefill_tokens
        if n:
            out[:n] = self._prefill(q_nope[:n], q_pe[:n], rows[:n], kv_b_weight, meta)
        if meta.num_decodes:
            out[n:] = self._decode(q_nope[n:], q_pe[n:], kv_b_weight, meta)
        return out.flatten(1)

    def _context(self, block_tables: torch.Tensor, length: int) -> torch.Tensor:
        """``[S, length, latent_dim]`` latents read back from the pool (rows past a sequence's
        length belong to other positions and must be masked)."""
        first = gather_kv(self.key_cache, block_tables, length)
        second = gather_kv(self.value_cache, block_tables, length)
        return torch.cat((first, second), dim=-1)[:, :, 0]

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        rows: torch.Tensor,
        kv_b_weight: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Each chunk against its whole context, up-projected to per-head keys and values."""
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        query = torch.cat((q_nope, q_pe), dim=-1)
        starts, lens = meta.prefill_query_start_loc.tolist(), meta.prefill_seq_lens.tolist()
        for i, seq_len in enumerate(lens[: meta.num_prefills]):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            if meta.prefill_is_fresh:  # the context is exactly this step's rows
                context = rows[start:end]
            else:
                context = self._context(meta.prefill_block_tables[i : i + 1], seq_len)[0].to(rows.dtype)
            latent, k_pe = context.split((self.kv_lora_rank, self.rope_dim), dim=-1)
            kv = torch.nn.functional.linear(latent, kv_b_weight).view(seq_len, self.num_heads, -1)
            k_nope, values = kv.split((self.nope_dim, self.v_dim), dim=-1)
            keys = torch.cat((k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
            out[start:end] = attend_causal(query[start:end], keys, values, self.scale)
        return out

    def _decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per row over its cached latents, in the absorbed form (module docstring)."""
        w = kv_b_weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        query = torch.cat((q_latent, q_pe), dim=-1)  # [S, H, latent_dim]: scores against [c, k_pe]
        max_len = int(meta.decode_seq_lens.max())
        context = self._context(meta.decode_block_tables, max_len).to(query.dtype)[:, None]  # [S, 1, L, latent]
        weighted = decode_attention_gathered(
            query, context, context[..., : self.kv_lora_rank], meta.decode_seq_lens, self.scale
        )  # [S, H, kv_lora_rank]
        return torch.einsum("thr,hvr->thv", weighted, w_uv)
