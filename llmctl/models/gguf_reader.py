"""Opening a GGUF file with the format authors' ``gguf.GGUFReader``, quickly and with errors that
name the file and the field; and what ``llmctl ls`` shows of one, read from its header alone.

Kept free of torch and of the model code, so that ``llmctl ls`` stays cheap.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from llmctl.errors import ModelLoadError


class _TensorInfoError(ValueError):
    """A tensor-info record the plain reader would fail on without naming the tensor."""


class CheckedReader(GGUFReader):
    """``GGUFReader`` that names the tensor whose type id is unknown or whose data runs past the
    end of the file (the plain reader fails on those with a bare numpy or enum error).

    It also slices a plain ``ndarray`` view of the memory map instead of the ``np.memmap`` itself:
    the reader takes one slice per metadata element (about 250,000 for a 49k-token vocabulary),
    and each ``np.memmap`` slice runs Python-level subclass hooks, which made opening SmolLM2's
    file take seconds. The view maps the same pages; nothing is copied. Arrays (the vocabulary,
    its scores and types, the merges) are cut in one pass (``_string_array_parts``, one view for
    numbers) into the very parts the generic per-element recursion would make (tested)."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self._plain_data = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        if raw_type == GGUFValueType.ARRAY and self.byte_order == "I":
            item_type = self._get(orig_offs, np.uint32)
            if item_type[0] == GGUFValueType.STRING:
                return self._string_array_parts(orig_offs, item_type)
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(int(item_type[0])))
            if scalar is not None:  # one view of the whole array, split into the per-item parts
                length = self._get(orig_offs + 4, np.uint64)
                items = self._get(orig_offs + 12, scalar, int(length[0]))
                if len(items) != int(length[0]):
                    raise ValueError(f"an array at offset {orig_offs} runs past the end of the file")
                parts = [item_type, length, *items.reshape(-1, 1)]
                return (
                    12 + int(items.nbytes),
                    parts,
                    list(range(2, len(parts))),
                    [GGUFValueType.ARRAY, GGUFValueType(int(item_type[0]))],
                )
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array_parts(
        self, orig_offs: int, item_type: np.ndarray
    ) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """[item type, length, (string length, string bytes) per item], as ``GGUFReader`` lays them."""
        plain = self._plain_data
        length = self._get(orig_offs + 4, np.uint64)
        parts: list[np.ndarray] = [item_type, length]
        raw = memoryview(plain)
        offs = orig_offs + 12
        for _ in range(int(length[0])):
            if offs + 8 > len(plain):
                raise ValueError(f"a string array at offset {orig_offs} runs past the end of the file")
            (size,) = struct.unpack_from("<Q", raw, offs)
            parts.append(plain[offs : offs + 8].view(np.uint64))
            parts.append(plain[offs + 8 : offs + 8 + size])
            offs += 8 + size
        if offs > len(plain):
            raise ValueError(f"a string array at offset {orig_offs} runs past the end of the file")
        data_idxs = list(range(3, len(parts), 2))
        return offs - orig_offs, parts, data_idxs, [GGUFValueType.ARRAY, GGUFValueType.STRING]

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise _TensorInfoError(f"tensor {name!r} has unknown tensor type id {int(raw_dtype[0])}") from None
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block_size
            if end > len(self.data):
                raise _TensorInfoError(f"tensor {name!r} runs past the end of the file; it is truncated")
        super()._build_tensors(start_offs, fields)


def read_gguf(path: Path) -> GGUFReader:
    """The file's reader (tensors memory-mapped); ``ModelLoadError`` naming the file otherwise."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return CheckedReader(path)
    except _TensorInfoError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    except (ValueError, IndexError, KeyError, TypeError, OSError, OverflowError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file, it may be corrupt or truncated ({exc})") from exc


@dataclass(frozen=True)
class GGUFSummary:
    architecture: str | None
    num_parameters: int
    weight_bytes: int  # the tensors' bytes as stored (quantized blocks included)
    dtype: str  # the (at most three) tensor types holding most parameters: "Q4_1+Q8_0+F32"


def gguf_summary(path: Path) -> GGUFSummary:
    """Facts of a GGUF file from its header and tensor infos (no weight is read)."""
    reader = read_gguf(path)
    field = reader.fields.get("general.architecture")
    try:
        architecture = str(field.contents()) if field is not None else None
    except (ValueError, IndexError, UnicodeDecodeError):
        architecture = None
    counts: Counter[str] = Counter()
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] += int(tensor.n_elements)
    return GGUFSummary(
        architecture,
        sum(counts.values()),
        sum(int(t.n_bytes) for t in reader.tensors),
        "+".join(name for name, _ in counts.most_common(3)) + ("+…" if len(counts) > 3 else ""),
    )
