"""Paged attention layer: stores this step's K/V into its layer's cache pool, then attends."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from llmctl.layers.ops import AttentionMetadata, TorchOps

if TYPE_CHECKING:
    from llmctl.engine.kv_cache import QuantizedLayerKV


class Attention(nn.Module):
    """Causal attention of ``num_heads`` query heads over ``num_kv_heads`` KV heads (GQA/MQA).

    ``sliding_window`` (tokens): the query at position ``q`` sees the keys at positions ``k`` with
    ``q - sliding_window < k <= q`` -- the last ``sliding_window`` tokens, itself included -- as
    Hugging Face transformers' ``sliding_window_overlay`` (masking_utils.py: ``kv_idx > q_idx -
    sliding_window``) on top of the causal mask. ``None``: the whole context.

    ``logit_softcap``: each score ``s = (q . k) * scale`` becomes ``logit_softcap * tanh(s /
    logit_softcap)`` before the mask and the softmax, as transformers' Gemma 2 eager attention
    (``attn_logit_softcapping``). ``None``: none.

    ``sinks`` (``[num_heads]``, this rank's heads): a learned logit per query head that joins the
    softmax denominator, taking probability mass without contributing a value, as transformers'
    gpt-oss attention (``GptOssAttention.sinks``). ``None``: none, and the calls are exactly as
    without the argument. On a CPU the native kernels take them (float caches; kernels/cpu/
    attention_window.h); the Triton kernels and the 8-bit KV caches run the torch references
    (exact, slower).

    Every backend takes the window and the cap (llmctl/layers/ops.py, triton_ops.py,
    engine/kv_cache.py); with both ``None`` the calls are the plain causal kernels. A sliding
    layer's KV-cache group gives back the blocks no query can see any more
    (llmctl/engine/block_manager.py); its tables keep their positions, so the kernels index them as
    any other.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        ops: TorchOps,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.logit_softcap = None if logit_softcap is None else float(logit_softcap)
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must hold one logit per query head ({num_heads}), got shape {tuple(sinks.shape)}")
        # A parameter of the model's attention module (its checkpoint name), shared here, not copied.
        self.sinks = sinks
        # Bound by the model runner to this layer's slices of the KV pool:
        # [num_blocks, block_size, num_kv_heads, head_dim] each.
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        # Or, with a quantized --kv-cache-dtype, this layer's view of the quantized pool
        # (llmctl/engine/kv_cache.py), which stores and attends itself.
        self.quantized_kv: QuantizedLayerKV | None = None
        # The KV-cache group whose block tables this layer reads (``AttentionMetadata.groups``; set
        # by the model runner: a sliding layer's group keeps only the blocks in its window).
        self.kv_group = 0

    def extra_repr(self) -> str:
        extra = f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        if self.sliding_window is not None:
            extra += f", sliding_window={self.sliding_window}"
        if self.logit_softcap is not None:
            extra += f", logit_softcap={self.logit_softcap}"
        if self.sinks is not None:
            extra += ", sinks"
        return extra

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` -> ``[T, Hq * D]``."""
        if meta.groups is not None:
            meta = meta.groups[self.kv_group]
        window, softcap = self.sliding_window, self.logit_softcap
        if self.sinks is not None:
            return self._forward_with_sinks(query, key, value, meta, window, softcap)
        if self.quantized_kv is not None:
            return self.ops.attend_quantized(
                self.quantized_kv, query, key, value, meta, self.scale, window, softcap
            ).flatten(1)
        if self.key_cache is None or self.value_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the model runner binds it")
        self.ops.store_kv(key, value, self.key_cache, self.value_cache, meta.slot_mapping)
        num_prefill = meta.num_prefill_tokens
        if meta.num_decodes == 0:
            out = self.ops.prefill_attention(
                query, key, value, self.key_cache, self.value_cache, meta, self.scale, window, softcap
            )
        elif num_prefill == 0:
            out = self.ops.decode_attention(query, self.key_cache, self.value_cache, meta, self.scale, window, softcap)
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
                window,
                softcap,
            )
            out[num_prefill:] = self.ops.decode_attention(
                query[num_prefill:], self.key_cache, self.value_cache, meta, self.scale, window, softcap
            )
        return out.flatten(1)

    def _forward_with_sinks(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """``forward`` for a layer with attention sinks (kept apart so the plain path's calls stay
        as they were)."""
        sinks = self.sinks
        if self.quantized_kv is not None:
            return self.ops.attend_quantized(
                self.quantized_kv, query, key, value, meta, self.scale, window, softcap, sinks=sinks
            ).flatten(1)
        if self.key_cache is None or self.value_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the model runner binds it")
        self.ops.store_kv(key, value, self.key_cache, self.value_cache, meta.slot_mapping)
        n = meta.num_prefill_tokens
        caches = (self.key_cache, self.value_cache)
        if meta.num_decodes == 0:
            out = self.ops.prefill_attention(query, key, value, *caches, meta, self.scale, window, softcap, sinks=sinks)
        elif n == 0:
            out = self.ops.decode_attention(query, *caches, meta, self.scale, window, softcap, sinks=sinks)
        else:
            out = torch.empty_like(query)
            out[:n] = self.ops.prefill_attention(
                query[:n], key[:n], value[:n], *caches, meta, self.scale, window, softcap, sinks=sinks
            )
            out[n:] = self.ops.decode_attention(query[n:], *caches, meta, self.scale, window, softcap, sinks=sinks)
        return out.flatten(1)
