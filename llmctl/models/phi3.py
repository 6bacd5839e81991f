"""Microsoft Phi-3, Phi-3.5 and Phi-4 (transformers' ``Phi3ForCausalLM``): Llama's blocks with fused
``qkv_proj`` and ``gate_up_proj`` checkpoint tensors (llmctl's merged modules under the same names),
``partial_rotary_factor`` (Phi-4-mini rotates 3/4 of each head) and LongRoPE scaling.

LongRoPE follows transformers exactly (``RotaryEmbedding``'s docstring has the rule): a sequence
uses the short factors while it is at most ``original_max_position_embeddings`` tokens long and the
long ones for all its tokens once longer. A sequence that grows past that length after some of its
tokens are cached (a generation crossing it, or a prompt's later chunk) is recomputed whole in that
step with the long table, overwriting its cached keys and values, as Phi-3's ``generate`` drops its
cache and recomputes then. The tokens to recompute are the ones the model wrote to those KV slots
(kept per slot). KV blocks are shared between sequences only through the prefix cache, whose keys
do not include the table, and the recompute writes the sequence's blocks in place: so a LongRoPE
model runs without prefix caching (``prefix_caching_why_not``), and refuses a sliding window shorter
than the original length (the recompute needs every block, and a window gives old ones back).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from llmctl.distributed import PipelineStage, TensorParallel
from llmctl.errors import UnsupportedModelError
from llmctl.layers.linear import LinearMethod
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.rotary import RotaryEmbedding
from llmctl.models.config import ModelConfig
from llmctl.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, StageOutput

_PHI3_ORIGINAL_MAX_POSITIONS = 4096  # Phi3Config's default


def phi3_rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """config.json's rope parameters as transformers' Phi3Config reads them: ``su``/``yarn`` mean
    longrope, the top-level ``original_max_position_embeddings`` wins over the rope dict's, and
    ``partial_rotary_factor`` comes from the rope dict or else the top level."""
    raw = cfg.raw
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("su", "yarn"):
        rope_type = "longrope"
    rope["rope_type"] = rope_type
    rope.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if rope_type == "longrope":
        rope["original_max_position_embeddings"] = int(
            raw.get("original_max_position_embeddings", _PHI3_ORIGINAL_MAX_POSITIONS)
        )
    if rope_type == "default" and float(rope["partial_rotary_factor"] or 1.0) == 1.0:
        return None
    return rope


def phi3_gguf_config(cfg: dict[str, Any], field: Any, tensors: dict[str, list[float]]) -> None:
    """A GGUF file's Phi-3 settings as config.json has them: the rotated width of a head
    (``rope.dimension_count``) as ``partial_rotary_factor``, and LongRoPE's factors, which llama.cpp's
    converter stores as the tensors ``rope_factors_long/short.weight`` (its attention factor is the
    one transformers computes from the two context lengths, so it is computed again)."""
    head_dim = cfg["head_dim"]
    rotary = int(field("rope.dimension_count", head_dim))
    if rotary != head_dim:
        cfg["partial_rotary_factor"] = rotary / head_dim
        if int(head_dim * cfg["partial_rotary_factor"]) != rotary:
            raise ValueError(f"rope.dimension_count {rotary} is not a width llmctl can rotate in {head_dim}")
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise ValueError("a LongRoPE file needs both rope_factors_long.weight and rope_factors_short.weight")
    if long is not None:
        cfg["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}


class Phi3Model(LlamaModel):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TensorParallel,
        ops: TorchOps,
        method: LinearMethod | None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__(dataclasses.replace(cfg, rope_scaling=phi3_rope_scaling(cfg)), dtype, tp, ops, method, stage)
        layers = [layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer)]
        self.rotary: RotaryEmbedding | None = layers[0].self_attn.rotary_emb if layers else None
        self.longrope = self.rotary is not None and self.rotary.has_long_table
        if self.longrope:
            if not (self.stage.start == 0 and self.stage.is_last):
                raise UnsupportedModelError("LongRoPE (Phi-3) does not run pipeline-parallel yet")
            self.rotary.positions_select_table = True
            self.original_max_positions = int(self.rotary.original_max_positions)
            windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
            if any(window is not None and window <= self.original_max_positions for window in windows):
                raise UnsupportedModelError(
                    "LongRoPE (Phi-3) with a sliding window no longer than original_max_position_embeddings "
                    f"({self.original_max_positions}) is not supported"
                )
            self.slot_tokens = torch.zeros(0, dtype=torch.int64)  # token id last written to each KV slot

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        if not self.longrope:
            return super().forward(input_ids, positions, meta, intermediate)
        self._remember_tokens(input_ids, meta.slot_mapping)
        lengths, starts, counts = _sequence_lengths(meta, positions.device)
        long = lengths > self.original_max_positions
        long_per_token = torch.zeros_like(positions, dtype=torch.bool)  # padding tokens (if any) last
        long_per_token[: int(counts.sum())] = torch.repeat_interleave(long, counts)
        hidden = super().forward(input_ids, self.rotary.table_positions(positions, long_per_token), meta, intermediate)
        stale = long & (starts >= 1) & (starts <= self.original_max_positions)
        if bool(stale.any()):
            self._recompute(hidden, meta, stale.nonzero().flatten().tolist(), lengths, counts)
        return hidden

    def _remember_tokens(self, input_ids: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.any()):
            return
        slots = slot_mapping[valid].to(self.slot_tokens.device)
        needed = int(slots.max()) + 1
        if needed > self.slot_tokens.numel():
            grown = torch.zeros(max(needed, 2 * self.slot_tokens.numel()), dtype=torch.int64)
            grown[: self.slot_tokens.numel()] = self.slot_tokens
            self.slot_tokens = grown
        self.slot_tokens[slots] = input_ids[valid].to(self.slot_tokens.device, torch.int64)

    def _block_size(self) -> int:
        attn = self.layers[0].self_attn.attn
        if attn.quantized_kv is not None:
            return int(attn.quantized_kv.fmt.block_size)
        return int(attn.key_cache.shape[1])

    def _recompute(
        self,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        seqs: list[int],
        lengths: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """Prefill sequences ``seqs`` (batch indices) again from position 0 with the long table,
        overwriting their KV slots, and put the rows of this step's tokens into ``hidden``."""
        if getattr(meta, "groups", None) is not None:  # several KV-cache groups: one block table does not say it
            raise UnsupportedModelError("LongRoPE (Phi-3) with several KV-cache groups is not supported")
        device = hidden.device
        block_size = self._block_size()
        tables = [
            meta.prefill_block_tables[i] if i < meta.num_prefills else meta.decode_block_tables[i - meta.num_prefills]
            for i in seqs
        ]
        n = [int(lengths[i]) for i in seqs]
        width = max(t.numel() for t in tables)
        block_tables = torch.zeros(len(seqs), width, dtype=torch.int32, device=device)
        pos_list, slot_list = [], []
        for row, (table, length) in enumerate(zip(tables, n)):
            block_tables[row, : table.numel()] = table.to(device, torch.int32)
            pos = torch.arange(length, device=device)
            pos_list.append(pos)
            slot_list.append(table.to(device, torch.int64)[pos // block_size] * block_size + pos % block_size)
        positions = torch.cat(pos_list)
        slots = torch.cat(slot_list)
        input_ids = self.slot_tokens[slots.to(self.slot_tokens.device)].to(device)
        i32 = {"dtype": torch.int32, "device": device}
        sub = dataclasses.replace(
            meta,
            slot_mapping=slots,
            num_prefills=len(seqs),
            num_prefill_tokens=int(positions.numel()),
            num_decodes=0,
            prefill_query_start_loc=torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], **i32),
            prefill_seq_lens=torch.tensor(n, **i32),
            prefill_block_tables=block_tables,
            prefill_is_fresh=True,
            decode_seq_lens=torch.zeros(0, **i32),
            decode_block_tables=torch.zeros(0, 1, **i32),
            max_decode_seq_len=0,
        )
        attn = self.layers[0].self_attn.attn
        if attn.quantized_kv is not None:
            attn.quantized_kv.cache.begin_batch(sub, positions)
        table_positions = self.rotary.table_positions(positions, torch.ones_like(positions, dtype=torch.bool))
        again = super().forward(input_ids, table_positions, sub)
        ends = torch.cumsum(counts, 0).tolist()
        offset = 0
        for i, length in zip(seqs, n):
            offset += length
            rows = int(counts[i])
            hidden[ends[i] - rows : ends[i]] = again[offset - rows : offset]


def _sequence_lengths(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence of the batch (prefill chunks, then decodes): its length after this step, the
    position of its first token in this step, and its number of tokens in this step."""
    chunk = (meta.prefill_query_start_loc[1:] - meta.prefill_query_start_loc[:-1]).to(device, torch.int64)
    prefill_lens = meta.prefill_seq_lens[: meta.num_prefills].to(device, torch.int64)
    decode_lens = meta.decode_seq_lens[: meta.num_decodes].to(device, torch.int64)
    lengths = torch.cat((prefill_lens, decode_lens))
    counts = torch.cat((chunk[: meta.num_prefills], torch.ones_like(decode_lens)))
    return lengths, lengths - counts, counts


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model

    @property
    def prefix_caching_why_not(self) -> str | None:
        """Why the engine must not share cached blocks between sequences (None: it may)."""
        return (
            "LongRoPE recomputes a sequence in place when it outgrows the short table" if self.model.longrope else None
        )
