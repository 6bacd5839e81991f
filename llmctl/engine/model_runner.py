"""Turns a scheduler decision into batch tensors, runs the model, and returns the sampling logits.

It also owns the KV pool: one preallocated ``[num_blocks, block_size, num_kv_heads, head_dim]``
tensor per layer for K and one for V, bound to each attention layer once at start-up; or, with a
quantized ``--kv-cache-dtype``, a ``QuantizedKVCache`` (llmctl/engine/kv_cache.py) indexed by the
same block ids.

With sliding-window layers the layers form KV-cache groups (``kv_groups``): full attention and
each distinct window, cut into groups of equal layer count P. The pool then holds P layer slots
(``[2, P, num_blocks, ...]``) and the j-th layer of every group is bound to slot j: a block id
belongs to one group at a time (llmctl/engine/block_manager.py), so the groups share the pool's
blocks without sharing bytes, and a block costs P layers. Each group has its own block tables and
slot mapping; ``AttentionMetadata.groups`` carries them and each layer picks its group's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache
from llmctl.engine.pooler import PooledChunk, pool_chunk
from llmctl.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmctl.engine.sequence import Sequence
from llmctl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmctl.layers.ops import AttentionMetadata
from llmctl.layers.quantization.matmul import bound_cpu_kernel
from llmctl.layers.quantization.methods import PackedLinearMethod
from llmctl.lora.manager import LoRAManager
from llmctl.models.native_decode import build_native_decode
from llmctl.models.registry import CausalLM


def bind_cpu_kernels(model: torch.nn.Module, *, exact_activations: bool = False) -> None:
    """Bind every packed CPU layer's kernel at load instead of at its first call: the weight bytes
    a start-up line reports are then those a request runs with (the tile-interleaved copies made,
    the row layouts they replace released), and the first request does not pay for the binding.
    Here, above the layers, because it needs to tell linear layers from the LM head, and a tied
    LM head (whose rows the embedding looks tokens up in) from an untied one."""
    looked_up = {  # the packed rows an embedding reads
        m._parameters["qweight"].data_ptr()
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead) and "qweight" in m._parameters
    }
    for module in model.modules():
        qweight = module._parameters.get("qweight")
        if qweight is None or qweight.device.type != "cpu":
            continue
        if isinstance(getattr(module, "method", None), PackedLinearMethod):
            bound_cpu_kernel(module, release_rows=True, exact_activations=exact_activations)
        elif isinstance(module, ParallelLMHead):
            untied = qweight.data_ptr() not in looked_up
            bound_cpu_kernel(module, release_rows=untied, exact_activations=exact_activations)


def kv_format(
    model: CausalLM,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    group_size: int = 32,
    residual_tokens: int = 0,
) -> KVFormat:
    """The KV storage of this model: the one place KV size is computed (from the attention layers
    as built, so a tensor-parallel shard counts only its own heads)."""
    attn = model.attention_layers()[0]
    return KVFormat(
        kv_cache_dtype,
        len(model.attention_layers()),
        attn.num_kv_heads,
        attn.head_dim,
        block_size,
        dtype,
        group_size,
        residual_tokens,
    )


@dataclass(frozen=True)
class KVGroup:
    """Attention layers (indices into ``model.attention_layers()``) that share block tables: all of
    one kind, full attention (``window`` None) or one sliding window in tokens."""

    window: int | None
    layers: tuple[int, ...]


def kv_groups(model: CausalLM) -> list[KVGroup]:
    """The model's KV-cache groups: one group of every layer when all attend alike (every model
    without windows: the pool as it always was); otherwise each kind's layers cut into groups of
    one size (vLLM's rule: the smallest kind's layer count, or the largest's when within 25 %),
    full attention first, then windows from the smallest."""
    by_kind: dict[int | None, list[int]] = {}
    for i, layer in enumerate(model.attention_layers()):
        by_kind.setdefault(getattr(layer, "sliding_window", None), []).append(i)
    if len(by_kind) == 1:
        ((window, layers),) = by_kind.items()
        return [KVGroup(window, tuple(layers))]
    sizes = [len(layers) for layers in by_kind.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    groups = []
    for window in sorted(by_kind, key=lambda w: -1 if w is None else w):
        layers = by_kind[window]
        groups += [KVGroup(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    return groups


def paged_format(kv: KVFormat, groups: list[KVGroup]) -> KVFormat:
    """The pool's format: a block holds the layers of one KV-cache group (as many layer slots as
    the largest group has), not every layer."""
    page_layers = max(len(g.layers) for g in groups)
    return kv if kv.num_layers == page_layers else dataclasses.replace(kv, num_layers=page_layers)


def _pools(seq: Sequence) -> bool:
    """A pooling request's sequence (a draft model's view of a sequence has no ``pooling``: it never is)."""
    return getattr(seq, "pooling", None) is not None


@dataclass
class PromptLogits:
    """Logits of a prefill chunk's prompt positions, for ``SamplingParams.prompt_logprobs``: row
    ``i`` predicts prompt token ``first_index + i``."""

    seq: Sequence
    first_index: int
    logits: torch.Tensor  # [rows, vocab] float32


@dataclass
class ModelOutput:
    logits: torch.Tensor  # float32, one row per ``SchedulerOutput.sampling`` sequence, in its order
    prompt_logits: list[PromptLogits] = field(default_factory=list)
    # float32, ``SchedulerOutput.num_verify_rows`` rows: each verify's draft positions, then its bonus one
    verify_logits: torch.Tensor | None = None
    # pooling requests' prefill chunks (llmctl/engine/pooler.py): what each keeps of its hidden states
    pooled: list[PooledChunk] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        kv_format: KVFormat | None = None,
        num_residual_slots: int = 0,
        groups: list[KVGroup] | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        """``groups``: the KV-cache groups the block manager keeps tables for (``kv_groups``);
        None: one group of every layer (a draft model). ``lora``: the
        engine's LoRA slots (None: no adapters)."""
        self.model = model
        self.lora = lora
        self.block_size = block_size
        self.device = device
        layers = model.attention_layers()
        attn = layers[0]
        self.groups = groups or [KVGroup(None, tuple(range(len(layers))))]
        self.num_groups = len(self.groups)
        page_layers = max(len(g.layers) for g in self.groups)  # layer slots of the pool
        slot_of = {}  # attention layer -> (group, its slot in the pool)
        for g, group in enumerate(self.groups):
            for j, index in enumerate(group.layers):
                slot_of[index] = (g, j)
        if sorted(slot_of) != list(range(len(layers))):
            raise ValueError("the KV-cache groups must hold every attention layer exactly once")
        for i, layer in enumerate(layers):
            layer.kv_group = slot_of[i][0]
        self.quantized_kv: QuantizedKVCache | None = None
        if kv_format is not None and kv_format.kind != "auto":
            kv_format = paged_format(kv_format, self.groups)
            self.quantized_kv = QuantizedKVCache(kv_format, num_blocks, num_residual_slots, device)
            for i, layer in enumerate(layers):
                layer.quantized_kv = self.quantized_kv.layer(slot_of[i][1])
            num_blocks = 0  # no float pool
        # Allocated empty (a large pool commits no memory until used) and zeroed block by block as
        # the block manager first hands blocks out: masked lanes of a partially filled block are read
        # and weighted by 0, and 0 * NaN from uninitialised memory would poison the output.
        self.kv_cache = torch.empty(
            2, page_layers, num_blocks, block_size, attn.num_kv_heads, attn.head_dim, dtype=kv_dtype, device=device
        )
        self.num_blocks_zeroed = 0
        for i, layer in enumerate(layers):
            slot = slot_of[i][1]
            layer.key_cache, layer.value_cache = self.kv_cache[0, slot], self.kv_cache[1, slot]
        if device.type == "cpu":
            kernels = model.model.norm.ops.kernels  # the engine's (llmctl/platform.py); None without one
            bind_cpu_kernels(model, exact_activations=kernels is not None and kernels.quant_exact_activations)
        # Decode-only steps in one native call where the model allows (else None); decode_path says which.
        kv_slots = None if self.num_groups == 1 else [slot_of[i] for i in range(len(layers))]
        self.native_decode, self.decode_path = build_native_decode(
            model, self.kv_cache, self.quantized_kv, lora, kv_slots
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Runs one step; returns float32 logits for each ``sched.sampling`` sequence (``n > 1``
        siblings share their prompt's row), plus the prompt positions' logits where asked for."""
        self.ready_blocks(sched.num_blocks_touched, sched.blocks_to_copy)
        input_ids, positions, meta, logits_indices = self.prepare(sched)
        if self.quantized_kv is not None:
            self.quantized_kv.begin_batch(meta, positions)
        # every token's adapter, in batch order (read by the adapted projections, or the native decode loop)
        adapted = self.lora is not None and self.lora.begin_batch(
            (item.seq.lora, item.num_new_tokens) for item in sched.scheduled
        )
        try:
            if self.native_decode is not None and meta.num_prefill_tokens == 0:
                hidden = self.native_decode(input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions, meta)
        finally:
            if adapted:
                self.lora.end_batch()
        logits = self.model.compute_logits(hidden[logits_indices]).float()
        verify_logits = None
        if sched.verifies:  # prepare put the verify rows last
            logits, verify_logits = logits[: -sched.num_verify_rows], logits[-sched.num_verify_rows :]
        if len(sched.logits_rows) > logits.shape[0]:
            logits = logits[torch.tensor(sched.logits_rows, device=logits.device)]
        return ModelOutput(
            logits, self._prompt_logits(sched.prefills, hidden), verify_logits, self._pooled(sched, hidden)
        )

    def _pooled(self, sched: SchedulerOutput, hidden: torch.Tensor) -> list[PooledChunk]:
        """Pooling requests' chunks (prefills come first in the batch, then decodes of one row
        each, in order; a prompt with one token left runs it as a decode): their rows get no
        logits, the pooler keeps what it needs of their hidden states."""
        found: list[PooledChunk] = []
        offset = 0
        for item in sched.prefills + sched.decodes:
            if _pools(item.seq):
                rows = hidden[offset : offset + item.num_new_tokens]
                found.append(pool_chunk(item, rows, self.model.compute_logits))
            offset += item.num_new_tokens
        return found

    def ready_blocks(self, num_blocks_touched: int, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Zero the blocks handed out for the first time and do the step's copy-on-write copies
        (tensor-parallel workers call this with what rank 0's scheduler decided)."""
        if num_blocks_touched > self.num_blocks_zeroed:
            self.kv_cache[:, :, self.num_blocks_zeroed : num_blocks_touched].zero_()
            if self.quantized_kv is not None:
                self.quantized_kv.zero_blocks(self.num_blocks_zeroed, num_blocks_touched)
            self.num_blocks_zeroed = num_blocks_touched
        if blocks_to_copy:
            self.copy_blocks(blocks_to_copy)

    def _prompt_logits(self, prefills: list[ScheduledSeq], hidden: torch.Tensor) -> list[PromptLogits]:
        """Prefill chunks come first in the batch, in order; a chunk's row for position ``p``
        predicts prompt token ``p + 1`` (the prompt's last position predicts an output token: it is
        the sampling row, not a prompt logprob)."""
        found: list[PromptLogits] = []
        offset = 0
        for item in prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if seq.needs_prompt_logits and end > start:
                rows = hidden[offset : offset + end - start]
                found.append(PromptLogits(seq, start + 1, self.model.compute_logits(rows).float()))
            offset += item.num_new_tokens
        return found

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if self.quantized_kv is not None:
            self.quantized_kv.copy_blocks(pairs)
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        query_start = [0]
        prefill_lens: list[int] = []
        prefill_tables: list[list[int]] = []
        fresh = True
        for item in sched.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + item.num_new_tokens)
            prefill_lens.append(end)
            prefill_tables.append(table)
            fresh = fresh and start == 0
            if item.samples and not _pools(seq):  # a pooling row gets no logits (the pooler reads it)
                logits_indices.append(len(input_ids) - 1)
        num_prefill_tokens = len(input_ids)
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        for item in sched.decodes + sched.verifies:  # a verify: one decode row per token, its drafts after
            seq, first = item.seq, item.seq.num_computed_tokens
            input_ids += [seq.token_ids[first]] + seq.draft_token_ids[: item.num_spec_tokens]
            for pos in range(first, first + item.num_new_tokens):
                positions.append(pos)
                slots.append(seq.block_table[pos // bs] * bs + pos % bs)
                decode_lens.append(pos + 1)  # a row sees its own position and before: the causal mask
                decode_tables.append(seq.block_table)
        # a pooling sequence's last pending token may run as a decode row: no logits for it either
        logits_indices += [num_prefill_tokens + j for j, item in enumerate(sched.decodes) if not _pools(item.seq)]
        logits_indices += range(len(input_ids) - sched.num_verify_rows, len(input_ids))

        def tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            num_prefills=len(sched.prefills),
            num_prefill_tokens=num_prefill_tokens,
            num_decodes=len(decode_lens),
            prefill_query_start_loc=tensor(query_start, torch.int32),
            prefill_seq_lens=tensor(prefill_lens, torch.int32),
            prefill_block_tables=self.block_table_tensor(prefill_tables),
            prefill_is_fresh=fresh,
            decode_seq_lens=tensor(decode_lens, torch.int32),
            decode_block_tables=self.block_table_tensor(decode_tables),
            max_decode_seq_len=max(decode_lens, default=0),
        )
        if self.num_groups > 1:
            meta.groups = [dataclasses.replace(meta)] + [
                self._group_meta(sched, meta, g) for g in range(1, self.num_groups)
            ]
        return tensor(input_ids), tensor(positions), meta, tensor(logits_indices)

    def _group_meta(self, sched: SchedulerOutput, meta: AttentionMetadata, group: int) -> AttentionMetadata:
        """``meta`` (group 0's) with the slots and block tables of KV-cache group ``group``."""
        bs = self.block_size
        slots: list[int] = []
        prefill_tables: list[list[int]] = []
        for item in sched.prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            table = seq.block_tables[group]
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + item.num_new_tokens))
            prefill_tables.append(table)
        decode_tables: list[list[int]] = []
        for item in sched.decodes + sched.verifies:
            seq, first = item.seq, item.seq.num_computed_tokens
            table = seq.block_tables[group]
            for pos in range(first, first + item.num_new_tokens):
                slots.append(table[pos // bs] * bs + pos % bs)
                decode_tables.append(table)
        return dataclasses.replace(
            meta,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            prefill_block_tables=self.block_table_tensor(prefill_tables),
            decode_block_tables=self.block_table_tensor(decode_tables),
            groups=None,
        )

    def block_table_tensor(self, tables: list[list[int]]) -> torch.Tensor:
        """Rows padded with block 0; a sliding group's released entries (``NULL_BLOCK``, -1) read
        as block 0 too: outside every query's window, so never weighted (block 0 is the first block
        ever handed out, zeroed then, so its values are finite)."""
        width = max((len(t) for t in tables), default=0)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=self.device)
        return table.view(len(tables), width).clamp_(min=0)
