"""The kernel set a model runs on: pure torch (any device, exact on CPU) or Triton (CUDA, or
Triton's interpreter on a CPU for tests).

A model receives one ops object (``TorchOps`` or a subclass) at construction and calls every fused op through it, so
switching backends never touches model code and there is no global switch. Which one an engine gets is
decided in llmctl/platform.py and built by ``llmctl.layers.backends.build_ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmctl.errors import UnsupportedModelError
from llmctl.platform import cpu_isa, fused_cpu_kernels
from llmctl_kernels.activation import silu_and_mul_torch
from llmctl_kernels.decode_attention import decode_attention_gathered, paged_decode_attention_torch
from llmctl_kernels.kv_store import reshape_and_cache_torch
from llmctl_kernels.prefill_attention import attend_causal, paged_prefill_attention_torch
from llmctl_kernels.rms_norm import rms_norm_torch
from llmctl_kernels.rotary import apply_rotary, rotary_cos_sin

if TYPE_CHECKING:
    from llmctl.engine.kv_cache import QuantizedLayerKV
    from llmctl.platform import KernelSet

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class AttentionMetadata:
    """Batch layout for attention, built once per step by the model runner.

    Sequences ``[0, num_prefills)`` are prefill/extend chunks (their tokens come first in the
    flattened batch); the remaining ``num_decodes`` sequences contribute exactly one token each.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_is_fresh: bool  # every chunk starts at position 0: this step's K/V are the whole context
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    max_decode_seq_len: int
    # KV-cache groups (sliding-window models, llmctl/engine/model_runner.py): each group's own
    # metadata (its slot_mapping and block tables; the rest as here), which each attention layer
    # picks by its ``kv_group``. None: one group, this metadata.
    groups: list[AttentionMetadata] | None = None

    @classmethod
    def single_prefill(cls, num_tokens: int, block_size: int, device: torch.device | None = None) -> AttentionMetadata:
        """One sequence prefilled from position 0 into blocks 0, 1, ... of a scratch cache of
        ``block_size``-token blocks (calibration and scoring tools, outside the engine)."""
        i32 = {"dtype": torch.int32, "device": device}
        num_blocks = -(-num_tokens // block_size)
        return cls(
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
            num_prefills=1,
            num_prefill_tokens=num_tokens,
            num_decodes=0,
            prefill_query_start_loc=torch.tensor([0, num_tokens], **i32),
            prefill_seq_lens=torch.tensor([num_tokens], **i32),
            prefill_block_tables=torch.arange(num_blocks, **i32)[None],
            prefill_is_fresh=True,
            decode_seq_lens=torch.zeros(0, **i32),
            decode_block_tables=torch.zeros(0, 1, **i32),
            max_decode_seq_len=0,
        )


class TorchOps:
    """The CPU path: plain-torch references (the oracle of the Triton kernels), with the fused
    native CPU kernels taking over where they apply (see ``__init__``)."""

    name = "torch"
    # a mixture-of-experts layer's experts in one kernel call (TritonOps); None: StackedExperts' loop
    fused_experts: Callable[..., torch.Tensor] | None = None

    def __init__(self, native_cpu: bool = False, kernels: KernelSet | None = None) -> None:
        self.kernels = kernels  # the engine's kernel set (llmctl/platform.py); None for a model built without one
        # The fused C++ kernels of kernels/cpu_native.py take over on a CPU for fp32 and bf16 (and
        # decode attention for fp16 too): measured 2-50x faster per call than the torch op chains
        # at decode sizes (docs/kernels.md), and within float rounding of the references, which
        # keeps greedy output token-identical to transformers in the exactness tests.
        # The compiled module is bound here, once per model: every per-step call below goes straight
        # to it, without the ~3-18 us per call of the llmctl_kernels.cpu_native wrappers (module lookup
        # under a lock, reshape/view of 2-D tensors), ~175 calls per SmolLM2 decode step.
        self._native = fused_cpu_kernels() if native_cpu else None
        self.native = self._native is not None
        # (positions, cache, dtype) -> cos, sin of the current step: every layer rotates the same
        # positions, so the gather runs once per step instead of once per layer.
        self._rope_key: tuple | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def _native_for(self, x: torch.Tensor) -> bool:
        return self.native and x.dtype in _NATIVE_DTYPES and x.device.type == "cpu"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._native_for(x):
            return rms_norm_torch(x, weight, eps, residual)
        if x.dim() == 2:  # every call of the models: no reshape/view round trip
            return self._native.rms_norm(x, weight, eps, residual)
        shape, width = x.shape, x.shape[-1]
        out, new_residual = self._native.rms_norm(
            x.reshape(-1, width), weight, eps, None if residual is None else residual.reshape(-1, width)
        )
        return out.view(shape), new_residual.view(shape)

    def rotary_embedding(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._native_for(query):
            rotate = self._native.rotate
            return rotate(query, positions, cos_sin_cache), rotate(key, positions, cos_sin_cache)
        key_ = (positions, cos_sin_cache, query.dtype)
        if self._rope_key is None or any(a is not b for a, b in zip(self._rope_key, key_)):
            self._rope_key, self._rope = key_, rotary_cos_sin(positions, cos_sin_cache, query.dtype)
        cos, sin = self._rope
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._native.silu_and_mul(x) if self._native_for(x) else silu_and_mul_torch(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma's GeGLU, torch on every backend (no native or Triton kernel for it yet)."""
        from llmctl_kernels.activation import gelu_tanh_and_mul_torch

        return gelu_tanh_and_mul_torch(x)

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.native and key.device.type == "cpu" and key.dtype == key_cache.dtype:
            self._native.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        else:
            reshape_and_cache_torch(key, value, key_cache, value_cache, slot_mapping)

    def prefill_attention(
        self,
        query: torch.Tensor,  # [num_prefill_tokens, Hq, D]
        key: torch.Tensor,  # this step's keys [num_prefill_tokens, Hkv, D]
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # sliding window / logit soft cap / sinks: llmctl/layers/attention.py
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            self.native and query.device.type == "cpu" and self._native.prefill_attention_supported(query, key_cache)
        ):  # fp32/bf16, AVX2: one call
            return self._native.paged_prefill_attention(
                query,
                key_cache,
                value_cache,
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_seq_lens,
                scale,
                window or 0,
                softcap or 0.0,
                sinks,
            )
        return self.prefill_attention_reference(
            query, key, value, key_cache, value_cache, meta, scale, window, softcap, sinks
        )

    @staticmethod
    def prefill_attention_reference(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``prefill_attention`` on the torch references, any device (every backend's path for a
        layer with attention sinks)."""
        if not meta.prefill_is_fresh:
            return paged_prefill_attention_torch(
                query,
                key_cache,
                value_cache,
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_seq_lens,
                scale,
                window,
                softcap,
                sinks,
            )
        # Fresh prompts: the context is exactly this step's K/V, so skip the gather from the pool.
        out = torch.empty_like(query)
        starts = meta.prefill_query_start_loc.tolist()
        for start, end in zip(starts[:-1], starts[1:]):
            out[start:end] = attend_causal(
                query[start:end], key[start:end], value[start:end], scale, window, softcap, sinks
            )
        return out

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
        if self.native and query.device.type == "cpu":
            return self._native.paged_decode_attention(
                query,
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                window or 0,
                softcap or 0.0,
                sinks,
            )
        return paged_decode_attention_torch(
            query, key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, window, softcap, sinks
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
        """Store and attend over a quantized KV layer (``--kv-cache-dtype``): the torch reference
        of llmctl/engine/kv_cache.py here; ``TritonOps`` runs its Triton kernels instead. A layer
        with attention sinks stores, then attends over the dequantized cache with the torch
        references (``attend_quantized_with_sinks``)."""
        if sinks is not None:
            return attend_quantized_with_sinks(kv, query, key, value, meta, scale, window, softcap, sinks)
        return kv.attend(query, key, value, meta, scale, window, softcap)

    @property
    def description(self) -> str:
        if self.kernels is not None:
            return self.kernels.description
        return f"{self.name} + native CPU kernels ({cpu_isa()})" if self.native else self.name


def attend_quantized_with_sinks(
    kv: QuantizedLayerKV,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """A quantized KV layer's store, then attention with ``sinks`` over what its blocks dequantize
    to, prefill chunks one sequence at a time and the decodes together: what ``kv.attend``'s torch
    reference computes, plus the sinks. 8-bit formats only: KIVI reads its open window groups in
    full precision, which this path does not (refused rather than approximated)."""
    if kv.fmt.is_kivi:
        raise UnsupportedModelError(
            f"--kv-cache-dtype {kv.fmt.kind} does not take attention sinks (gpt-oss); use auto, int8 or fp8"
        )
    kv.store(key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    n = meta.num_prefill_tokens
    starts, lens = meta.prefill_query_start_loc.tolist(), meta.prefill_seq_lens.tolist()
    for i, seq_len in enumerate(lens[: meta.num_prefills]):
        start, end = starts[i], starts[i + 1]
        if end > start:
            keys, values = kv.gather(meta.prefill_block_tables[i : i + 1], seq_len, query.dtype)
            out[start:end] = attend_causal(query[start:end], keys[0], values[0], scale, window, softcap, sinks)
    if meta.num_decodes:
        max_len = int(meta.decode_seq_lens.max())
        keys, values = kv.gather(meta.decode_block_tables, max_len, query.dtype)  # [S, L, Hkv, D]
        out[n:] = decode_attention_gathered(
            query[n:], keys.transpose(1, 2), values.transpose(1, 2), meta.decode_seq_lens, scale, window, softcap, sinks
        )
    return out
