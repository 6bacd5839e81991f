"""One step's batch as one flat int64 tensor: what rank 0 broadcasts to every other rank.

The message is tensors only (no pickled Python objects): the batch tensors the model runner built
for each micro-batch plus the block bookkeeping of the step. ``AttentionMetadata`` is encoded
field by field from its dataclass definition, so a field added there travels without a change
here. Each item is ``[kind, ...]``: kind 0 an int, 1 a tensor (dtype code, ndim, shape, values),
2 ``None``, 3 a bool, 4 a list of metadata (a model with several KV-cache groups: each group's
block tables and slots; its count, then each one's fields).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmctl.layers.ops import AttentionMetadata

_DTYPES = [torch.int64, torch.int32, torch.bool]
_INT, _TENSOR, _NONE, _BOOL, _METAS = 0, 1, 2, 3, 4


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows of the final hidden states to compute logits for (sampling, then prompt)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class StepMessage:
    num_blocks_touched: int
    blocks_to_copy: list[tuple[int, int]]
    micro_batches: list[MicroBatch]


def _encode(value: object, out: list[torch.Tensor]) -> None:
    if value is None:
        out.append(torch.tensor([_NONE]))
    elif isinstance(value, bool):
        out.append(torch.tensor([_BOOL, int(value)]))
    elif isinstance(value, int):
        out.append(torch.tensor([_INT, value]))
    elif isinstance(value, list):
        out.append(torch.tensor([_METAS, len(value)]))
        for meta in value:
            _encode_meta(meta, out)
    elif isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES:
            raise TypeError(f"cannot send a {value.dtype} batch tensor (integer and bool only)")
        out.append(torch.tensor([_TENSOR, _DTYPES.index(value.dtype), value.dim(), *value.shape]))
        out.append(value.detach().reshape(-1).to("cpu", torch.int64))
    else:
        raise TypeError(f"cannot send a batch field of type {type(value).__name__}")


def _encode_meta(meta: AttentionMetadata, out: list[torch.Tensor]) -> None:
    for f in dataclasses.fields(AttentionMetadata):
        _encode(getattr(meta, f.name), out)


def encode_step(message: StepMessage) -> torch.Tensor:
    parts: list[torch.Tensor] = []
    copies = [i for pair in message.blocks_to_copy for i in pair]
    parts.append(
        torch.tensor(
            [message.num_blocks_touched, len(message.blocks_to_copy), *copies, len(message.micro_batches)],
            dtype=torch.int64,
        )
    )
    for mb in message.micro_batches:
        for value in (mb.input_ids, mb.positions, mb.logit_rows):
            _encode(value, parts)
        _encode_meta(mb.meta, parts)
    return torch.cat([p.to(torch.int64) for p in parts])


class _Reader:
    def __init__(self, flat: torch.Tensor, device: torch.device) -> None:
        self.values = flat.tolist()  # one conversion; slicing a Python list is cheap
        self.flat, self.pos, self.device = flat, 0, device

    def take(self, n: int = 1) -> list[int]:
        out = self.values[self.pos : self.pos + n]
        self.pos += n
        return out

    def item(self) -> object:
        kind = self.take()[0]
        if kind == _NONE:
            return None
        if kind in (_INT, _BOOL):
            value = self.take()[0]
            return bool(value) if kind == _BOOL else value
        if kind == _METAS:
            return [self.meta() for _ in range(self.take()[0])]
        dtype_code, ndim = self.take(2)
        shape = self.take(ndim)
        count = 1
        for dim in shape:
            count *= dim
        data = self.flat[self.pos : self.pos + count]
        self.pos += count
        return data.to(self.device, _DTYPES[dtype_code]).view(*shape)

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(**{f.name: self.item() for f in dataclasses.fields(AttentionMetadata)})


def decode_step(flat: torch.Tensor, device: torch.device) -> StepMessage:
    reader = _Reader(flat, device)
    num_blocks_touched, num_copies = reader.take(2)
    copies = reader.take(2 * num_copies)
    pairs = [(copies[2 * i], copies[2 * i + 1]) for i in range(num_copies)]
    micro_batches = []
    for _ in range(reader.take()[0]):
        input_ids, positions, rows = reader.item(), reader.item(), reader.item()
        micro_batches.append(MicroBatch(input_ids, positions, reader.meta(), rows))
    return StepMessage(num_blocks_touched, pairs, micro_batches)
