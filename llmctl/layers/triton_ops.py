"""The Triton kernel set: same methods and semantics as ``TorchOps``, every fused op a Triton kernel.

On CUDA the kernels compile for the GPU; on a CPU they run under Triton's interpreter, which
needs ``TRITON_INTERPRET=1`` in the environment before this module is first imported (tests do
that in ``tests/conftest.py``). ``llmctl.layers.backends.build_ops`` imports this module lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from llmctl.layers.ops import AttentionMetadata, TorchOps, attend_quantized_with_sinks
from llmctl_kernels.activation import silu_and_mul_triton
from llmctl_kernels.decode_attention import (
    paged_decode_attention_quantized_triton,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)
from llmctl_kernels.kv_store import kivi_quantize_blocks_triton, quantize_and_cache_triton, reshape_and_cache_triton
from llmctl_kernels.moe_triton import fused_experts_triton
from llmctl_kernels.prefill_attention import (
    paged_prefill_attention_quantized_triton,
    paged_prefill_attention_triton,
    varlen_causal_attention_triton,
)
from llmctl_kernels.rms_norm import rms_norm_triton
from llmctl_kernels.rotary import rotary_embedding_triton

if TYPE_CHECKING:
    from llmctl.engine.kv_cache import QuantizedLayerKV, StepPlan
    from llmctl.platform import KernelSet


def _max_query_len(meta: AttentionMetadata) -> int:
    """Longest prefill chunk: exact when the start offsets live on the host, else the number of
    prefill tokens (a sync-free bound: the kernel's programs past a chunk's end return at once)."""
    loc = meta.prefill_query_start_loc
    if loc.device.type == "cpu" and loc.numel() > 1:
        return int((loc[1:] - loc[:-1]).max())
    return max(int(meta.num_prefill_tokens), 1)


class TritonOps(TorchOps):
    """Triton kernels for every fused op (the CUDA default)."""

    name = "triton"

    def __init__(self, kernels: KernelSet | None = None) -> None:
        super().__init__(kernels=kernels)
        self._staged: tuple[StepPlan, torch.Tensor] | None = None  # see _staging_table

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_triton(x, weight, eps, residual)

    def rotary_embedding(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding_triton(positions, query, key, cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_triton(x)

    def fused_experts(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        return fused_experts_triton(x, w13, w2, weights, ids, act, w13_bias, w2_bias)

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)

    def prefill_attention(
        self,
        query: torch.Tensor,  # [num_prefill_tokens, Hq, D]
        key: torch.Tensor,  # this step's keys [num_prefill_tokens, Hkv, D]
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:  # the Triton kernels take no sinks: the torch reference (exact, slower)
            return self.prefill_attention_reference(
                query, key, value, key_cache, value_cache, meta, scale, window, softcap, sinks
            )
        max_query_len = _max_query_len(meta)
        if meta.prefill_is_fresh:
            # The context is exactly this step's K/V: read them in place, no gather from the pool.
            return varlen_causal_attention_triton(
                query,
                key,
                value,
                meta.prefill_query_start_loc,
                scale,
                max_query_len=max_query_len,
                window=window,
                softcap=softcap,
            )
        return paged_prefill_attention_triton(
            query,
            key_cache,
            value_cache,
            meta.prefill_block_tables,
            meta.prefill_query_start_loc,
            meta.prefill_seq_lens,
            scale,
            max_query_len=max_query_len,
            window=window,
            softcap=softcap,
        )

    def decode_attention(
        self,
        query: torch.Tensor,  # [num_decodes, Hq, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:  # the torch reference, as prefill_attention
            return paged_decode_attention_torch(
                query,
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                window,
                softcap,
                sinks,
            )
        return paged_decode_attention_triton(
            query,
            key_cache,
            value_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            max_seq_len=meta.max_decode_seq_len or None,
            window=window,
            softcap=softcap,
        )

    def attend_quantized(
        self,
        kv: QuantizedLayerKV,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``QuantizedLayerKV.attend`` on the Triton kernels: quantize-on-store, then prefill chunks
        and decodes over the quantized blocks, dequantized inside the kernels. KIVI stages the
        step's blocks like the reference (``kv.stage``), quantizes the completed ones in a kernel,
        and hands the kernels its full-precision blocks: the residual pool to decodes, this step's
        staging (then the residual pool) to prefill chunks.

        A layer with a sliding window or a logit soft cap runs the torch reference instead
        (``kv.attend``, exact, slower): the quantized-KV Triton kernels take neither yet; a layer
        with attention sinks likewise (``attend_quantized_with_sinks``)."""
        if sinks is not None:
            return attend_quantized_with_sinks(kv, query, key, value, meta, scale, window, softcap, sinks)
        if window is not None or softcap is not None:
            return kv.attend(query, key, value, meta, scale, window, softcap)
        fmt, n = kv.fmt, meta.num_prefill_tokens
        decode_fp, prefill_kivi = None, {}
        if fmt.is_kivi:
            plan = kv.stage(key, value)
            kivi_quantize_blocks_triton(
                plan.staging["k"], plan.staging["v"], plan.finalize, plan.finalize_blocks, kv.t, fmt.bits
            )
            decode_fp = (kv.residual["k"], kv.residual["v"], plan.residual_table)
            if meta.num_prefills:  # a query's own window group: this step's staging, else the residual
                staging = (plan.staging["k"], plan.staging["v"], self._staging_table(plan, kv.cache.num_blocks))
                prefill_kivi = {
                    "full_precision": staging,
                    "residual": decode_fp,
                    "window": fmt.block_size * fmt.residual_blocks_per_seq(),
                }
        else:
            quantize_and_cache_triton(key, value, kv.t, fmt.kind, meta.slot_mapping)
        out = torch.empty_like(query)
        if meta.num_prefills:
            out[:n] = paged_prefill_attention_quantized_triton(
                query[:n],
                kv.t,
                fmt.kind,
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_seq_lens,
                scale,
                **prefill_kivi,
                max_query_len=_max_query_len(meta),
            )
        if meta.num_decodes:
            out[n:] = paged_decode_attention_quantized_triton(
                query[n:],
                kv.t,
                fmt.kind,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                full_precision=decode_fp,
                max_seq_len=meta.max_decode_seq_len or None,
            )
        return out

    def _staging_table(self, plan: StepPlan, num_blocks: int) -> torch.Tensor:
        """block id -> staging index of this step's KIVI plan (-1: not written), built once per step
        for all layers."""
        if self._staged is None or self._staged[0] is not plan:
            device = plan.residual_table.device
            staged = torch.tensor(list(plan.staging_of), dtype=torch.int64, device=device)
            table = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
            table[staged] = torch.arange(staged.numel(), dtype=torch.int32, device=device)
            self._staged = (plan, table)
        return self._staged[1]
