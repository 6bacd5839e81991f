"""Paged attention layer: stores this step's K/V into its layer's cache pool, then attends."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from llmctl.layers.ops import AttentionMetadata, TorchOps

if TYPE_CHECKING:
    from llmctl.engine.kv_cache import QuantizedLayerKV


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *, ops: TorchOps) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops
        # Bound by the model runner to this layer's slices of the KV pool:
        # [num_blocks, block_size, num_kv_heads, head_dim] each.
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        # Or, with a quantized --kv-cache-dtype, this layer's view of the quantized pool
        # (llmctl/engine/kv_cache.py), which stores and attends itself.
        self.quantized_kv: QuantizedLayerKV | None = None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` -> ``[T, Hq * D]``."""
        if self.quantized_kv is not None:
            return self.ops.attend_quantized(self.quantized_kv, query, key, value, meta, self.scale).flatten(1)
        if self.key_cache is None or self.value_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the model runner binds it")
        self.ops.store_kv(key, value, self.key_cache, self.value_cache, meta.slot_mapping)
        num_prefill = meta.num_prefill_tokens
        if meta.num_decodes == 0:
            out = self.ops.prefill_attention(query, key, value, self.key_cache, self.value_cache, meta, self.scale)
        elif num_prefill == 0:
            out = self.ops.decode_attention(query, self.key_cache, self.value_cache, meta, self.scale)
        else:
            out = torch.empty_like(query)
            out[:num_prefill] = self.ops.prefill_attention(
                query[:num_prefill],
                key[:num_prefill],
                value[:num_prefill],
                self.key_cache,
                self.value_cache,
                meta,
                self.scale,
            )
            out[num_prefill:] = self.ops.decode_attention(
                query[num_prefill:], self.key_cache, self.value_cache, meta, self.scale
            )
        return out.flatten(1)
