"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

Either holds a plain ``[vocab, hidden]`` weight or, after ``install_packed``, a packed one (a GGUF
file's Q8_0 token table): the embedding then dequantizes only the rows it looks up, and the LM head
multiplies with the packed table directly. A tied model installs the same packed weight in both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.distributed import TensorParallel
from llmctl.layers.linear import copy_checked, linear, prepack_for_cpu
from llmctl.layers.quantization.matmul import bound_cpu_kernel, quant_linear
from llmctl.layers.quantization.params import attach_packed, read_packed
from llmctl.layers.quantization.quantize import quantize_int8
from llmctl_kernels.packed_formats import PackedInt8, PackedWeight, dequantize, take_rows


class VocabParallelEmbedding(nn.Module):
    packed_format: str | None = None  # set by install_packed

    def __init__(
        self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, tp: TensorParallel = TensorParallel()
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.shard_size = -(-vocab_size // tp.size)  # ceil: the last shard may be padded
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"expected vocabulary {self.vocab_size}, got shape {tuple(loaded.shape)}")
        part = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()
        copy_checked(param.data[: part.shape[0]], part, "embedding")

    def install_packed(self, packed: PackedWeight) -> None:
        """Replaces the plain table by a packed ``[vocab, hidden]`` one (tensor parallel size 1)."""
        if self.tp.size != 1:
            raise ValueError("a packed embedding needs tensor parallel size 1")
        if tuple(packed.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"packed embedding has shape {tuple(packed.shape)}, expected {(self.vocab_size, self.hidden_size)}"
            )
        device = self.weight.device if "weight" in self._parameters else torch.device("cpu")
        attach_packed(self, packed, device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_format is not None:
            rows = take_rows(read_packed(self), token_ids.reshape(-1))
            return dequantize(rows).to(self.dtype).view(*token_ids.shape, self.hidden_size)
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Computes each rank's slice of the logits, then gathers the full vocabulary.

    ``logits_quantization = "int8"`` (the model sets it for ``--quantization int8`` and ``int4``):
    the logits come from a per-output-channel int8 copy of the float table, as the linear layers'
    int8 does (per-token int16 activations, exact integer sums). Why: at a 64-row decode step the
    LM head of a small model with a large vocabulary (SmolLM2: 28 M of its 135 M weights) is a fifth of
    the step in float32. The plain table stays for the embedding's lookups (tied or not)."""

    packed_weight: torch.Tensor | None = None
    logits_quantization: str | None = None
    logits_packed: PackedInt8 | None = None

    def process_weights_after_loading(self) -> None:
        # A separate copy: the weight may be tied to the embedding, which needs it plain.
        if self.packed_format is not None:
            return
        if self.logits_quantization == "int8" and self._takes_int8_logits():
            self.logits_packed = quantize_int8(self.weight.data)
            self.__dict__.pop("_logits_kernel", None)
        else:
            self.packed_weight = prepack_for_cpu(self.weight.data)

    def _takes_int8_logits(self) -> bool:
        return self.tp.size == 1 and self.weight.device.type == "cpu" and self.hidden_size % 32 == 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.packed_format is not None:
            kernel = bound_cpu_kernel(self) if hidden.device.type == "cpu" else None
            if kernel is None:
                return quant_linear(hidden, read_packed(self))
            logits = kernel(hidden.reshape(-1, hidden.shape[-1]))
            return logits.view(*hidden.shape[:-1], logits.shape[-1])
        if self.logits_packed is not None:
            if "_logits_kernel" not in self.__dict__:  # bound once: no per-call dispatch
                from llmctl_kernels.quant_native import bind_native

                self.__dict__["_logits_kernel"] = bind_native(self.logits_packed)
            kernel = self.__dict__["_logits_kernel"]
            flat = hidden.reshape(-1, hidden.shape[-1])
            logits = kernel(flat) if kernel is not None else quant_linear(flat, self.logits_packed)
            return logits.view(*hidden.shape[:-1], logits.shape[-1])  # not -1: a step may ask for no rows
        logits = linear(
            hidden, self.weight if self.packed_weight is None else self.packed_weight, None, self.shard_size
        )
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
