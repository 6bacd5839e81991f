"""Turns a scheduler decision into batch tensors, runs the model, and returns the sampling logits.

It also owns the KV pool: one preallocated ``[num_blocks, block_size, num_kv_heads, head_dim]``
tensor per layer for K and one for V, bound to each attention layer once at start-up; or, with a
quantized ``--kv-cache-dtype``, a ``QuantizedKVCache`` (llmctl/engine/kv_cache.py) indexed by the
same block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache
from llmctl.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmctl.engine.sequence import Sequence
from llmctl.layers.embedding import ParallelLMHead
from llmctl.layers.ops import AttentionMetadata
from llmctl.layers.quantization.matmul import bound_cpu_kernel
from llmctl.layers.quantization.methods import PackedLinearMethod
from llmctl.models.native_decode import build_native_decode
from llmctl.models.registry import CausalLM


def bind_cpu_kernels(model: torch.nn.Module, *, exact_activations: bool = False) -> None:
    """Bind every packed CPU layer's kernel at load instead of at its first call: the weight bytes
    a start-up line reports are then those a request runs with (the tile-interleaved copies made,
    the row layouts they replace released), and the first request does not pay for the binding.
    Here, above the layers, because it needs to tell linear layers from the LM head."""
    for module in model.modules():
        qweight = module._parameters.get("qweight")
        if qweight is None or qweight.device.type != "cpu":
            continue
        if isinstance(getattr(module, "method", None), PackedLinearMethod):
            bound_cpu_kernel(module, release_rows=True, exact_activations=exact_activations)
        elif isinstance(module, ParallelLMHead):  # keeps its rows: a tied embedding reads them
            bound_cpu_kernel(module, exact_activations=exact_activations)


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


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one float block holds over all layers."""
    return kv_format(model, block_size, dtype).block_bytes()


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
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        layers = model.attention_layers()
        attn = layers[0]
        self.quantized_kv: QuantizedKVCache | None = None
        if kv_format is not None and kv_format.kind != "auto":
            self.quantized_kv = QuantizedKVCache(kv_format, num_blocks, num_residual_slots, device)
            for i, layer in enumerate(layers):
                layer.quantized_kv = self.quantized_kv.layer(i)
            num_blocks = 0  # no float pool
        # Allocated empty (a large pool commits no memory until used) and zeroed block by block as
        # the block manager first hands blocks out: masked lanes of a partially filled block are read
        # and weighted by 0, and 0 * NaN from uninitialised memory would poison the output.
        self.kv_cache = torch.empty(
            2, len(layers), num_blocks, block_size, attn.num_kv_heads, attn.head_dim, dtype=kv_dtype, device=device
        )
        self.num_blocks_zeroed = 0
        for i, layer in enumerate(layers):
            layer.key_cache, layer.value_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        if device.type == "cpu":
            kernels = model.model.norm.ops.kernels  # the engine's (llmctl/platform.py); None without one
            bind_cpu_kernels(model, exact_activations=kernels is not None and kernels.quant_exact_activations)
        # Decode-only steps in one native call where the model allows (else None); decode_path says which.
        self.native_decode, self.decode_path = build_native_decode(model, self.kv_cache, self.quantized_kv)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Runs one step; returns float32 logits for each ``sched.sampling`` sequence (``n > 1``
        siblings share their prompt's row), plus the prompt positions' logits where asked for."""
        self.ready_blocks(sched.num_blocks_touched, sched.blocks_to_copy)
        input_ids, positions, meta, logits_indices = self.prepare(sched)
        if self.quantized_kv is not None:
            self.quantized_kv.begin_batch(meta, positions)
        if self.native_decode is not None and meta.num_prefill_tokens == 0:
            hidden = self.native_decode(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[logits_indices]).float()
        verify_logits = None
        if sched.verifies:  # prepare put the verify rows last
            logits, verify_logits = logits[: -sched.num_verify_rows], logits[-sched.num_verify_rows :]
        if len(sched.logits_rows) > logits.shape[0]:
            logits = logits[torch.tensor(sched.logits_rows, device=logits.device)]
        return ModelOutput(logits, self._prompt_logits(sched.prefills, hidden), verify_logits)

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
            if item.samples:
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
        logits_indices += range(num_prefill_tokens, num_prefill_tokens + len(sched.decodes))
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
        return tensor(input_ids), tensor(positions), meta, tensor(logits_indices)

    def block_table_tensor(self, tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=self.device).view(
            len(tables), width
        )
