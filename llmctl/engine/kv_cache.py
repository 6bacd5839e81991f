"""The quantized KV pool (``--kv-cache-dtype fp8_e4m3|fp8_e5m2|int8|kivi2|kivi4``).

Every storage tensor is ``[layers, num_blocks, ...]``, indexed by the block manager's physical
block id, so allocation, copy-on-write, prefix caching and preemption work on block ids exactly
as for the float pool; a block copy copies codes *and* scales/zeros.

KIVI keeps the **open block** (the partially filled last block of a sequence, the paper's residual
window of recent tokens) in full precision, in a separate residual pool of ``max_num_seqs`` block
slots (one open block per sequence seat at most). The step that writes a block's last slot
quantizes it (keys per channel over the block's tokens, values per token over channel groups)
and returns its residual slot; from then on the block is immutable and only then can the prefix
cache register and share it (it registers only full blocks). A block freed while open gives its
residual slot back at once (``release``).

Attention always reads what the cache holds, in prefill too: position ``p`` sees every token as
it was stored when ``p`` was the last one, that is quantized, except (KIVI) the tokens of its own
block while that block is still open at ``p``, in full precision. So a request's output does not
depend on how its prompt was chunked, batched or hit in the prefix cache; prompt
log-probabilities measure the quantization, and no position sees a scale or zero that a later
token helped set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import kv_quant as kq
from kernels.prefill_attention import attend_causal

if TYPE_CHECKING:
    from llmctl.layers.ops import AttentionMetadata, TorchOps


@dataclass(frozen=True)
class KVFormat:
    """The shape of one KV dtype's storage: what a block costs, and what one token costs."""

    kind: str  # one of kernels.kv_quant.KV_CACHE_DTYPES
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    model_dtype: torch.dtype
    group_size: int = 32  # KIVI: value channels per scale/zero group

    def __post_init__(self) -> None:
        if self.kind not in kq.KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.kind!r}; choose one of {', '.join(kq.KV_CACHE_DTYPES)}")

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
            return {"k": ((bs, h, d), codes), "v": ((bs, h, d), codes),
                    "k_scale": ((bs, h), torch.float32), "v_scale": ((bs, h), torch.float32)}
        packed = d * self.bits // 8
        groups = d // self.value_group
        return {"k": ((bs, h, packed), torch.uint8), "k_scale": ((h, d), torch.float16),
                "k_zero": ((h, d), torch.float16), "v": ((bs, h, packed), torch.uint8),
                "v_scale": ((bs, h, groups), torch.float16), "v_zero": ((bs, h, groups), torch.float16)}

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
        """(pool blocks, residual slots) that fit ``pool_bytes``. Open blocks are at most one per
        sequence seat and at most one per block, so KIVI pays for min(max_num_seqs, blocks)
        residual slots out of the same budget."""
        block, residual = self.block_bytes(), self.residual_block_bytes()
        if not residual:
            return pool_bytes // block, 0
        if max_num_seqs * (block + residual) <= pool_bytes:
            return (pool_bytes - max_num_seqs * residual) // block, max_num_seqs
        num_blocks = pool_bytes // (block + residual)
        return num_blocks, num_blocks


@dataclass
class StepPlan:
    """Host-side decisions of one KIVI step, shared by every layer. Each block the step writes gets
    a staging row (its earlier tokens from the residual, then this step's): blocks it completes
    are quantized from there, the others go back to a residual slot."""

    staging_rows: torch.Tensor  # [num_tokens] int64: staging row (index * block_size + offset), -1 skip
    staged_from: torch.Tensor  # [B] int64: residual slot holding the block's earlier tokens, -1 none
    finalize: torch.Tensor  # [F] int64: staging indices of the blocks this step completes
    finalize_blocks: torch.Tensor  # [F] int64: those blocks
    open_staged: torch.Tensor  # [O] int64: staging indices of the blocks still open after the step
    open_slots: torch.Tensor  # [O] int64: their residual slots
    staging_of: dict[int, int]  # block id -> staging index
    residual_table: torch.Tensor  # [num_blocks] int64: each block's residual slot after the step, -1 none
    staging: dict[str, torch.Tensor] | None = None  # "k", "v": [B, block_size, Hkv, D] of the current layer


class QuantizedKVCache:
    """The pool of one KV format (not ``auto``): storage, the residual slots, per-layer views."""

    def __init__(self, fmt: KVFormat, num_blocks: int, num_residual: int, device: torch.device) -> None:
        self.fmt, self.num_blocks, self.device = fmt, num_blocks, device
        self.tensors = {name: torch.empty(fmt.num_layers, num_blocks, *shape, dtype=dtype, device=device)
                        for name, (shape, dtype) in fmt.tensor_shapes().items()}
        shape = (fmt.num_layers, num_residual, fmt.block_size, fmt.num_kv_heads, fmt.head_dim)
        self.residual = {name: torch.zeros(shape, dtype=fmt.model_dtype, device=device) for name in ("k", "v")}
        self.residual_of = [-1] * num_blocks
        self.residual_table = torch.full((num_blocks,), -1, dtype=torch.int64)  # mirror of residual_of
        self.free_residual = list(range(num_residual - 1, -1, -1))
        self.plan: StepPlan | None = None

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
                raise RuntimeError("KIVI residual slots exhausted: more open KV blocks than max_num_seqs")
            slot = self.residual_of[block_id] = self.free_residual.pop()
            self.residual_table[block_id] = slot
        return slot

    # ---- one step ----------------------------------------------------------------------------
    def begin_step(self, slots: list[int]) -> None:
        """Plan this step's staging, which blocks it completes and where open blocks go (KIVI)."""
        if not self.fmt.is_kivi:
            return
        bs = self.fmt.block_size
        staging_of: dict[int, int] = {}
        rows, finalize = [], []
        for slot in slots:
            if slot < 0:
                rows.append(-1)
                continue
            block, offset = divmod(slot, bs)
            index = staging_of.setdefault(block, len(staging_of))
            rows.append(index * bs + offset)
            if offset == bs - 1:
                finalize.append(index)
        blocks = list(staging_of)
        staged_from = [self.residual_of[b] for b in blocks]
        for index in finalize:  # completed: its slot is free again (the store reads it before any write)
            self.release(blocks[index])
        done = set(finalize)
        open_staged = [i for i in range(len(blocks)) if i not in done]
        open_slots = [self._residual_for(blocks[i]) for i in open_staged]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        self.plan = StepPlan(tensor(rows), tensor(staged_from), tensor(finalize),
                             tensor([blocks[i] for i in finalize]), tensor(open_staged), tensor(open_slots),
                             staging_of, self.residual_table.to(self.device))


class QuantizedLayerKV:
    """One layer's view of the pool: quantize-on-store and dequantizing gathers (torch reference)."""

    def __init__(self, cache: QuantizedKVCache, index: int) -> None:
        self.cache, self.fmt = cache, cache.fmt
        self.t = {name: t[index] for name, t in cache.tensors.items()}
        self.residual = {name: r[index] for name, r in cache.residual.items()}

    def store(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        fmt = self.fmt
        if not fmt.is_kivi:
            valid = slot_mapping >= 0
            slots = slot_mapping[valid]
            for name, x in (("k", key[valid]), ("v", value[valid])):
                codes, scale = kq.quantize_per_token(x, fmt.kind)
                # through a byte view: index_copy_ has no float8 kernel on CPU
                self.t[name].flatten(0, 1).view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
                self.t[name + "_scale"].flatten(0, 1).index_copy_(0, slots, scale)
            return
        plan = self.stage(key, value)
        if plan.finalize.numel():
            blocks, t = plan.finalize_blocks, self.t
            codes, scale, zero = kq.quantize_kivi_keys(plan.staging["k"][plan.finalize], fmt.bits)
            t["k"][blocks], t["k_scale"][blocks], t["k_zero"][blocks] = codes, scale, zero
            codes, scale, zero = kq.quantize_kivi_values(plan.staging["v"][plan.finalize], fmt.bits, fmt.value_group)
            t["v"][blocks], t["v_scale"][blocks], t["v_zero"][blocks] = codes, scale, zero

    def stage(self, key: torch.Tensor, value: torch.Tensor) -> StepPlan:
        """KIVI's store up to quantization: every block the step writes gets its full-precision
        staging (``plan.staging``), and the blocks still open go back to their residual slots.
        Completed blocks (``plan.finalize``) are left for the caller to quantize."""
        plan = self.cache.plan
        valid = plan.staging_rows >= 0
        rows = plan.staging_rows[valid]
        plan.staging = {}
        for name, x in (("k", key), ("v", value)):
            residual = self.residual[name]
            staging = residual[plan.staged_from.clamp(min=0)]  # [B, bs, H, D]; rows of new blocks unused
            staging.flatten(0, 1).index_copy_(0, rows, x[valid].to(staging.dtype))
            residual[plan.open_slots] = staging[plan.open_staged]
            plan.staging[name] = staging
        return plan

    def gather(self, block_tables: torch.Tensor, max_len: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
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
            values = kq.dequantize_kivi_values(t["v"][blocks], t["v_scale"][blocks], t["v_zero"][blocks],
                                               fmt.bits, fmt.value_group, dtype)
            slot = self.cache.plan.residual_table[blocks]  # [S, nb]: open blocks read the residual
            is_open = (slot >= 0)[..., None, None, None]
            keys = torch.where(is_open, self.residual["k"][slot.clamp(min=0)].to(dtype), keys)
            values = torch.where(is_open, self.residual["v"][slot.clamp(min=0)].to(dtype), values)
        shape = (num_seqs, nb * fmt.block_size, fmt.num_kv_heads, fmt.head_dim)
        return keys.reshape(shape)[:, :max_len], values.reshape(shape)[:, :max_len]

    def gather_exact(self, block_table: list[int], max_len: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """KIVI: this step's full-precision keys and values ``[max_len, Hkv, D]`` of one sequence's
        blocks that the step writes (rows of other blocks are garbage for the caller to ignore)."""
        fmt, plan = self.fmt, self.cache.plan
        nb = -(-max_len // fmt.block_size)
        index = torch.tensor([plan.staging_of.get(b, 0) for b in block_table[:nb]], device=self.cache.device)
        shape = (nb * fmt.block_size, fmt.num_kv_heads, fmt.head_dim)
        return (plan.staging["k"][index].reshape(shape)[:max_len].to(dtype),
                plan.staging["v"][index].reshape(shape)[:max_len].to(dtype))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata,
               scale: float, ops: TorchOps) -> torch.Tensor:
        """Store this step's K/V, then attend over what the cache holds: prefill chunks causally
        over their sequence's blocks, decodes over theirs."""
        self.store(key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        starts, lens = meta.prefill_query_start_loc.tolist(), meta.prefill_seq_lens.tolist()
        for i, seq_len in enumerate(lens):
            start, end = starts[i], starts[i + 1]
            if end <= start:
                continue
            table = meta.prefill_block_tables[i : i + 1]
            keys, values = self.gather(table, seq_len, query.dtype)
            if self.fmt.is_kivi:
                exact_keys, exact_values = self.gather_exact(table[0].tolist(), seq_len, query.dtype)
                out[start:end] = kq.attend_causal_kivi(query[start:end], keys[0], values[0], exact_keys,
                                                       exact_values, self.fmt.block_size, scale)
            else:
                out[start:end] = attend_causal(query[start:end], keys[0], values[0], scale)
        if meta.num_decodes:
            n = meta.num_prefill_tokens
            keys, values = self.gather(meta.decode_block_tables, meta.max_decode_seq_len, query.dtype)
            out[n:] = kq.decode_attention_dense(query[n:], keys, values, meta.decode_seq_lens, scale)
        return out
