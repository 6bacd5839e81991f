"""The quantized KV pool (``--kv-cache-dtype fp8_e4m3|fp8_e5m2|int8|kivi2|kivi4``).

Every storage tensor is ``[layers, num_blocks, ...]``, indexed by the block manager's physical
block id, so allocation, copy-on-write, prefix caching and preemption work on block ids exactly
as for the float pool; a block copy copies codes *and* scales/zeros.

KIVI keeps the **residual window** (the paper's R most recent tokens) in full precision: a
sequence's blocks form window groups of N = R / block_size blocks, and every block of the group
being written lives in a slot of a separate residual pool (N slots per sequence seat). The step
that writes the last slot of a group's last block quantizes the whole group (keys per channel over
each block's tokens, values per token over channel groups) and frees its residual slots; from then
on those blocks are immutable, and only then can the prefix cache register and share them (the
block manager caches whole groups). A block freed while in the window gives its residual slot
back at once (``release``). docs/architecture.md has the full account.

Attention always reads what the cache holds, in prefill too: position ``p`` sees every token as
it was stored when ``p`` was the last one, that is quantized, except (KIVI) the tokens of its own
window group while that group is still open at ``p``, in full precision. So a request's output
does not depend on how its prompt was chunked, batched or hit in the prefix cache; prompt
log-probabilities measure the quantization, and no position sees a scale or zero that a later
token helped set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmctl.platform import kv_codes_native, kv_quant_cpu_kernels
from llmctl_kernels import kv_quant as kq
from llmctl_kernels.cpu_native import (
    paged_decode_attention_codes_native,
    paged_prefill_attention_codes_native,
    store_kv_codes_native,
)
from llmctl_kernels.kv_quant_native import kivi_store_native, quantized_decode_attention_native
from llmctl_kernels.prefill_attention import attend_causal

if TYPE_CHECKING:
    from llmctl.layers.ops import AttentionMetadata


@dataclass(frozen=True)
class KVFormat:
    """The shape of one KV dtype's storage: what a block costs, and what one token costs."""

    kind: str  # one of llmctl_kernels.kv_quant.KV_CACHE_DTYPES
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    model_dtype: torch.dtype
    group_size: int = 32  # KIVI: value channels per scale/zero group
    residual_tokens: int = 0  # KIVI: the full-precision window R (0: the open block only)

    def __post_init__(self) -> None:
        if self.kind not in kq.KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.kind!r}; choose one of {', '.join(kq.KV_CACHE_DTYPES)}")
        if self.residual_tokens % self.block_size:
            raise ValueError(
                f"the KIVI residual length ({self.residual_tokens}) must be a multiple of the block "
                f"size ({self.block_size})"
            )

    def residual_blocks_per_seq(self) -> int:
        """KIVI: blocks of one window group (N = R / block_size, at least 1), the most a sequence
        holds in full precision at once; 0 for other dtypes."""
        return max(1, self.residual_tokens // self.block_size) if self.is_kivi else 0

    @property
    def is_kivi(self) -> bool:
        return self.kind in kq.KIVI_BITS

    @property
    def bits(self) -> int:
        return kq.KIVI_BITS.get(self.kind, 8)

    @property
    def value_group(self) -> int:
        """Value channel group, at most head_dim."""
        return min(self.group_size, self.head_dim)

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-layer, per-block storage (name -> (shape after [layers, blocks], dtype))."""
        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if self.kind == "auto":
            return {"k": ((bs, h, d), self.model_dtype), "v": ((bs, h, d), self.model_dtype)}
        if not self.is_kivi:
            codes = kq.code_dtype(self.kind)
            return {
                "k": ((bs, h, d), codes),
                "v": ((bs, h, d), codes),
                "k_scale": ((bs, h), torch.float32),
                "v_scale": ((bs, h), torch.float32),
            }
        packed = d * self.bits // 8
        groups = d // self.value_group
        return {
            "k": ((bs, h, packed), torch.uint8),
            "k_scale": ((h, d), torch.float16),
            "k_zero": ((h, d), torch.float16),
            "v": ((bs, h, packed), torch.uint8),
            "v_scale": ((bs, h, groups), torch.float16),
            "v_zero": ((bs, h, groups), torch.float16),
        }

    def block_bytes(self) -> int:
        """Bytes one pool block takes over all layers, scales and zeros included."""
        total = 0
        for shape, dtype in self.tensor_shapes().values():
            total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return total * self.num_layers

    def residual_block_bytes(self) -> int:
        """Bytes of one full-precision residual block slot (KIVI only)."""
        if not self.is_kivi:
            return 0
        elem = torch.empty((), dtype=self.model_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def bytes_per_token(self) -> float:
        return self.block_bytes() / self.block_size

    def size_pool(self, pool_bytes: int, max_num_seqs: int) -> tuple[int, int]:
        """(pool blocks, residual slots) that fit ``pool_bytes``. Blocks in full precision are at
        most one window group (N blocks) per sequence seat and at most one per block, so KIVI pays
        for min(N * max_num_seqs, blocks) residual slots out of the same budget."""
        block, residual = self.block_bytes(), self.residual_block_bytes()
        if not residual:
            return pool_bytes // block, 0
        seats = max_num_seqs * self.residual_blocks_per_seq()
        if seats * (block + residual) <= pool_bytes:
            return (pool_bytes - seats * residual) // block, seats
        num_blocks = pool_bytes // (block + residual)
        return num_blocks, num_blocks


@dataclass
class StepPlan:
    """Host-side decisions of one KIVI step, shared by every layer. A token of a block that stays
    in the window goes straight to the block's residual slot; the blocks of each window group the
    step completes get a staging row (earlier tokens from their residual, then this step's) and
    are quantized from there."""

    residual_tokens: torch.Tensor  # [R] int64: tokens written to a residual slot
    residual_rows: torch.Tensor  # [R] int64: their rows (slot * block_size + offset)
    staging_tokens: torch.Tensor  # [S] int64: tokens of blocks quantized this step
    staging_rows: torch.Tensor  # [S] int64: their staging rows (index * block_size + offset)
    staged_from: torch.Tensor  # [F] int64: residual slot holding each quantized block's earlier tokens, -1 none
    finalize: torch.Tensor  # [F] int64: staging index of each block to quantize (all of the staging, in order)
    finalize_blocks: torch.Tensor  # [F] int64: the blocks this step quantizes
    staging_of: dict[int, int]  # block id -> staging index, for the blocks this step quantizes
    residual_table: torch.Tensor  # [num_blocks] int64: each block's residual slot after the step, -1 none
    staging: dict[str, torch.Tensor] | None = None  # "k", "v": [F, block_size, Hkv, D] of the current layer


class QuantizedKVCache:
    """The pool of one KV format (not ``auto``): storage, the residual slots, per-layer views."""

    def __init__(self, fmt: KVFormat, num_blocks: int, num_residual: int, device: torch.device) -> None:
        self.fmt, self.num_blocks, self.device = fmt, num_blocks, device
        self.tensors = {
            name: torch.empty(fmt.num_layers, num_blocks, *shape, dtype=dtype, device=device)
            for name, (shape, dtype) in fmt.tensor_shapes().items()
        }
        shape = (fmt.num_layers, num_residual, fmt.block_size, fmt.num_kv_heads, fmt.head_dim)
        self.residual = {name: torch.zeros(shape, dtype=fmt.model_dtype, device=device) for name in ("k", "v")}
        self.residual_of = [-1] * num_blocks
        self.residual_table = torch.full((num_blocks,), -1, dtype=torch.int64)  # mirror of residual_of
        self.free_residual = list(range(num_residual - 1, -1, -1))
        self.plan: StepPlan | None = None
        # decode attention: the native CPU kernel reads the pool in place where it is built, else
        # the torch reference (gather, dequantize, attend); llmctl/platform.py says where they run
        self.native_decode = device.type == "cpu" and kv_quant_cpu_kernels() is not None
        # 8-bit formats where the float kernels module takes them (AVX2 or better, head_dim 64/128):
        # its tiled decode kernel and quantize-on-store, which the native decode loop also runs
        self.native_codes = device.type == "cpu" and fmt.kind in kq.PER_TOKEN_DTYPES and kv_codes_native(fmt.head_dim)
        # KIVI in a float32 model: the store in one native call (the decode loop calls it too)
        self.native_kivi_store = self.native_decode and fmt.is_kivi and fmt.model_dtype == torch.float32

    def layer(self, index: int) -> QuantizedLayerKV:
        return QuantizedLayerKV(self, index)

    # ---- block life ------------------------------------------------------------------------
    def zero_blocks(self, start: int, end: int) -> None:
        for t in self.tensors.values():
            t[:, start:end].zero_()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: codes, scales and zeros, and an open block's residual into a new slot."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for t in self.tensors.values():
            t[:, dst] = t[:, src]
        for s, d in pairs:
            if self.residual_of[s] >= 0:
                slot = self._residual_for(d)
                for r in self.residual.values():
                    r[:, slot] = r[:, self.residual_of[s]]

    def release(self, block_id: int) -> None:
        """The block went back to the free pool: its residual slot (if still open) is free again."""
        slot = self.residual_of[block_id]
        if slot >= 0:
            self.residual_of[block_id] = -1
            self.residual_table[block_id] = -1
            self.free_residual.append(slot)

    def _residual_for(self, block_id: int) -> int:
        slot = self.residual_of[block_id]
        if slot < 0:
            if not self.free_residual:
                raise RuntimeError(
                    "KIVI residual slots exhausted: more blocks in residual windows than N x max_num_seqs"
                )
            slot = self.residual_of[block_id] = self.free_residual.pop()
            self.residual_table[block_id] = slot
        return slot

    # ---- one step ----------------------------------------------------------------------------
    def begin_batch(self, meta: AttentionMetadata, positions: torch.Tensor) -> None:
        """``begin_step`` for a model step: each token's block table comes from the metadata (rows
        of prefill chunks repeated over their tokens, one row per decode token)."""
        if not self.fmt.is_kivi:
            return
        tables = None
        if self.fmt.residual_blocks_per_seq() > 1:
            starts = meta.prefill_query_start_loc.tolist()
            prefill = meta.prefill_block_tables.tolist()
            tables = [prefill[i] for i in range(meta.num_prefills) for _ in range(starts[i + 1] - starts[i])]
            tables += meta.decode_block_tables.tolist()
        self.begin_step(meta.slot_mapping.tolist(), positions.tolist(), tables)

    def begin_step(
        self, slots: list[int], positions: list[int] | None = None, tables: list[list[int]] | None = None
    ) -> None:
        """Plan this step's staging, which blocks it quantizes and where the others go (KIVI).
        ``positions`` and ``tables`` (each token's sequence block table) are needed when the
        residual window spans several blocks: the token that completes a window group's last
        block quantizes the whole group."""
        if not self.fmt.is_kivi:
            return
        bs, window = self.fmt.block_size, self.fmt.residual_blocks_per_seq()
        written: list[tuple[int, int, int]] = []  # (token, block, offset)
        completed: list[int] = []
        for i, slot in enumerate(slots):
            if slot < 0:
                continue
            block, offset = divmod(slot, bs)
            written.append((i, block, offset))
            if offset == bs - 1:
                if window == 1:
                    completed.append(block)
                elif positions[i] // bs % window == window - 1:
                    last = positions[i] // bs
                    completed += tables[i][last - window + 1 : last + 1]
        # A group block that this step does not write and that holds no residual was already
        # quantized (an n > 1 sibling sharing it completed the same group first).
        written_blocks = {block for _, block, _ in written}
        finalize = list(dict.fromkeys(b for b in completed if b in written_blocks or self.residual_of[b] >= 0))
        staging_of = {block: index for index, block in enumerate(finalize)}
        staged_from = [self.residual_of[b] for b in finalize]
        for block in finalize:  # its slot is free again (the store copies it out before any write)
            self.release(block)
        residual, staging = [], []
        for i, block, offset in written:
            if block in staging_of:
                staging.append((i, staging_of[block] * bs + offset))
            else:
                residual.append((i, self._residual_for(block) * bs + offset))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        self.plan = StepPlan(
            tensor([i for i, _ in residual]),
            tensor([r for _, r in residual]),
            tensor([i for i, _ in staging]),
            tensor([r for _, r in staging]),
            tensor(staged_from),
            tensor(list(range(len(finalize)))),
            tensor(finalize),
            staging_of,
            self.residual_table.to(self.device),
        )


class QuantizedLayerKV:
    """One layer's view of the pool: quantize-on-store and dequantizing gathers (torch reference)."""

    def __init__(self, cache: QuantizedKVCache, index: int) -> None:
        self.cache, self.fmt = cache, cache.fmt
        self.t = {name: t[index] for name, t in cache.tensors.items()}
        self.residual = {name: r[index] for name, r in cache.residual.items()}

    def store(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        fmt = self.fmt
        if self.cache.native_codes and key.dtype == torch.float32:
            store_kv_codes_native(key, value, fmt.kind, self.t, slot_mapping)
            return
        if not fmt.is_kivi:
            valid = slot_mapping >= 0
            slots = slot_mapping[valid]
            for name, x in (("k", key[valid]), ("v", value[valid])):
                codes, scale = kq.quantize_per_token(x, fmt.kind)
                # through a byte view: index_copy_ has no float8 kernel on CPU
                self.t[name].flatten(0, 1).view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
                self.t[name + "_scale"].flatten(0, 1).index_copy_(0, slots, scale)
            return
        if self.cache.native_kivi_store and key.dtype == torch.float32 and value.dtype == torch.float32:
            plan = self.cache.plan
            plan.staging = kivi_store_native(key, value, fmt.bits, fmt.value_group, self.t, self.residual, plan)
            return
        plan = self.stage(key, value)
        if plan.finalize.numel():
            blocks, t = plan.finalize_blocks, self.t
            codes, scale, zero = kq.quantize_kivi_keys(plan.staging["k"][plan.finalize], fmt.bits)
            t["k"][blocks], t["k_scale"][blocks], t["k_zero"][blocks] = codes, scale, zero
            codes, scale, zero = kq.quantize_kivi_values(plan.staging["v"][plan.finalize], fmt.bits, fmt.value_group)
            t["v"][blocks], t["v_scale"][blocks], t["v_zero"][blocks] = codes, scale, zero

    def stage(self, key: torch.Tensor, value: torch.Tensor) -> StepPlan:
        """KIVI's store up to quantization: tokens of blocks that stay in the window go to their
        residual slots, the blocks of the window groups this step completes get their
        full-precision staging (``plan.staging``), left for the caller to quantize
        (``plan.finalize`` indexes it, ``plan.finalize_blocks`` are the pool blocks)."""
        plan = self.cache.plan
        plan.staging = {}
        for name, x in (("k", key), ("v", value)):
            residual = self.residual[name]
            staging = residual[plan.staged_from.clamp(min=0)]  # a copy, taken before a freed slot is reused
            staging.flatten(0, 1).index_copy_(0, plan.staging_rows, x[plan.staging_tokens].to(staging.dtype))
            residual.flatten(0, 1).index_copy_(0, plan.residual_rows, x[plan.residual_tokens].to(residual.dtype))
            plan.staging[name] = staging
        return plan

    def gather(self, block_tables: torch.Tensor, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values ``[num_seqs, max_len, Hkv, D]`` of the sequences' blocks
        (rows past a sequence's length are garbage for the caller to mask)."""
        fmt, t = self.fmt, self.t
        num_seqs = block_tables.shape[0]
        nb = -(-max_len // fmt.block_size)
        blocks = block_tables[:, :nb].long()
        if not fmt.is_kivi:
            keys = kq.dequantize_per_token(t["k"][blocks], t["k_scale"][blocks], dtype)
            values = kq.dequantize_per_token(t["v"][blocks], t["v_scale"][blocks], dtype)
        else:
            keys = kq.dequantize_kivi_keys(t["k"][blocks], t["k_scale"][blocks], t["k_zero"][blocks], fmt.bits, dtype)
            values = kq.dequantize_kivi_values(
                t["v"][blocks], t["v_scale"][blocks], t["v_zero"][blocks], fmt.bits, fmt.value_group, dtype
            )
            slot = self.cache.plan.residual_table[blocks]  # [S, nb]: open blocks read the residual
            is_open = (slot >= 0)[..., None, None, None]
            keys = torch.where(is_open, self.residual["k"][slot.clamp(min=0)].to(dtype), keys)
            values = torch.where(is_open, self.residual["v"][slot.clamp(min=0)].to(dtype), values)
        shape = (num_seqs, nb * fmt.block_size, fmt.num_kv_heads, fmt.head_dim)
        return keys.reshape(shape)[:, :max_len], values.reshape(shape)[:, :max_len]

    def gather_exact(
        self,
        block_table: list[int],
        max_len: int,
        dtype: torch.dtype,
        gathered: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KIVI: one sequence's keys and values ``[max_len, Hkv, D]`` in full precision wherever
        the cache has them this step: the blocks this step quantizes from staging, the others as
        ``gather`` reads them (``gathered``, when the caller has them already): from the residual
        while in the window; the rows of quantized blocks are never read as exact."""
        fmt, plan = self.fmt, self.cache.plan
        bs = fmt.block_size
        if gathered is None:
            table = torch.tensor([block_table], dtype=torch.int32, device=self.cache.device)
            gathered = tuple(t[0] for t in self.gather(table, max_len, dtype))
        keys, values = gathered[0].clone(), gathered[1].clone()
        for i, block in enumerate(block_table[: -(-max_len // bs)]):
            index = plan.staging_of.get(block)
            if index is not None:
                n = min(bs, max_len - i * bs)
                keys[i * bs : i * bs + n] = plan.staging["k"][index, :n]
                values[i * bs : i * bs + n] = plan.staging["v"][index, :n]
        return keys, values

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend over what the cache holds: prefill chunks causally
        over their sequence's blocks, decodes over theirs; within the layer's sliding ``window`` and
        with its logit ``softcap`` when given (llmctl/layers/attention.py)."""
        self.store(key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        n = meta.num_prefill_tokens
        if self.cache.native_codes:
            if n:
                out[:n] = paged_prefill_attention_codes_native(
                    query[:n],
                    self.fmt.kind,
                    self.t,
                    meta.prefill_block_tables,
                    meta.prefill_query_start_loc,
                    meta.prefill_seq_lens,
                    scale,
                    window,
                    softcap,
                )
        else:
            self.prefill_reference(query, out, meta, scale, window, softcap)
        if meta.num_decodes:
            out[n:] = self.decode(
                query[n:],
                meta.decode_block_tables,
                meta.decode_seq_lens,
                meta.max_decode_seq_len,
                scale,
                window,
                softcap,
            )
        return out

    def prefill_reference(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """The prefill chunks' rows of ``out``, one sequence at a time: gather, dequantize, attend."""
        starts, lens = meta.prefill_query_start_loc.tolist(), meta.prefill_seq_lens.tolist()
        for i, seq_len in enumerate(lens):
            start, end = starts[i], starts[i + 1]
            if end <= start:
                continue
            table = meta.prefill_block_tables[i : i + 1]
            keys, values = self.gather(table, seq_len, query.dtype)
            if self.fmt.is_kivi:
                exact_keys, exact_values = self.gather_exact(
                    table[0].tolist(), seq_len, query.dtype, (keys[0], values[0])
                )
                group_tokens = self.fmt.block_size * self.fmt.residual_blocks_per_seq()
                out[start:end] = kq.attend_causal_kivi(
                    query[start:end],
                    keys[0],
                    values[0],
                    exact_keys,
                    exact_values,
                    group_tokens,
                    scale,
                    window,
                    softcap,
                )
            else:
                out[start:end] = attend_causal(query[start:end], keys[0], values[0], scale, window, softcap)

    def decode(
        self,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One query token per sequence over its blocks as the cache holds them."""
        if self.cache.native_codes:
            return paged_decode_attention_codes_native(
                query, self.fmt.kind, self.t, block_tables, seq_lens, scale, window, softcap
            )
        if self.cache.native_decode:
            plan = self.cache.plan
            return quantized_decode_attention_native(
                query,
                self.fmt.kind,
                self.t,
                block_tables,
                seq_lens,
                scale,
                value_group=self.fmt.value_group,
                residual=self.residual,
                residual_table=plan.residual_table if plan is not None else None,
                window=window,
                softcap=softcap,
            )
        keys, values = self.gather(block_tables, max_len, query.dtype)
        return kq.decode_attention_dense(query, keys, values, seq_lens, scale, window, softcap)
