"""Each GGML block type repacks EXACTLY into llmctl's shared packed formats: the packed weight's
reference dequantization equals ``gguf.quants.dequantize`` bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from llmctl.models.gguf_quants import QUANTIZED_TYPES, concat_parts, repack, to_float
from llmctl_kernels.packed_formats import PackedInt4, PackedInt8

T = GGMLQuantizationType
ROWS, COLS = 6, 512
EXPECTED = {
    T.Q4_0: (PackedInt4, 32),
    T.Q4_1: (PackedInt4, 32),
    T.Q4_K: (PackedInt4, 32),
    T.Q5_0: (PackedInt8, 32),
    T.Q5_1: (PackedInt8, 32),
    T.Q5_K: (PackedInt8, 32),
    T.Q6_K: (PackedInt8, 16),
    T.Q8_0: (PackedInt8, 32),
    T.MXFP4: (PackedInt8, 32),
}
# where each block keeps its fp16 scale(s): random bytes there could be inf/NaN
_SCALE_BYTES = {
    T.Q4_0: slice(0, 2),
    T.Q4_1: slice(0, 4),
    T.Q5_0: slice(0, 2),
    T.Q5_1: slice(0, 4),
    T.Q8_0: slice(0, 2),
    T.Q4_K: slice(0, 4),
    T.Q5_K: slice(0, 4),
    T.Q6_K: slice(208, 210),
}


def random_blocks(qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Random block bytes (every bit pattern of the quants and sub-scales) with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(ROWS * COLS // block, size), dtype=np.uint8)
    if qtype == T.MXFP4:  # every e8m0 exponent but 255 (2^127 times 6 overflows float32)
        raw[:, 0] = rng.integers(0, 255, size=raw.shape[0], dtype=np.uint8)
        return raw.reshape(ROWS, -1)
    span = _SCALE_BYTES[qtype]
    raw[:, span] = (
        rng.normal(0, 0.02, size=(raw.shape[0], (span.stop - span.start) // 2)).astype(np.float16).view(np.uint8)
    )
    return raw.reshape(ROWS, -1)


def test_every_required_type_is_covered():
    assert set(QUANTIZED_TYPES) == set(EXPECTED)


@pytest.mark.parametrize("qtype", list(EXPECTED), ids=lambda t: t.name)
def test_repack_is_exact(qtype):
    raw = random_blocks(qtype)
    packed = repack(raw, qtype, (ROWS, COLS))
    kind, group = EXPECTED[qtype]
    assert isinstance(packed, kind) and packed.group_size == group and packed.shape == (ROWS, COLS)
    ours = to_float(packed).numpy()
    reference = gguf_dequantize(raw, qtype).reshape(ROWS, COLS)
    assert np.array_equal(ours, reference)  # bit for bit, not approximately


def test_mixed_merged_projection_is_exact():
    """q Q4_K, k Q6_K, v Q8_0 (as in llama.cpp's mixed files): one PackedInt8 group 16 with mins."""
    parts = [repack(random_blocks(t, seed=i), t, (ROWS, COLS)) for i, t in enumerate((T.Q4_K, T.Q6_K, T.Q8_0))]
    merged = concat_parts(parts)
    assert isinstance(merged, PackedInt8) and merged.group_size == 16 and merged.mins is not None
    assert torch.equal(to_float(merged), torch.cat([to_float(p) for p in parts]))


def test_same_format_parts_stay_in_their_format():
    parts = [repack(random_blocks(T.Q4_1, seed=i), T.Q4_1, (ROWS, COLS)) for i in range(2)]
    merged = concat_parts(parts)
    assert isinstance(merged, PackedInt4) and merged.qweight.shape == (2 * ROWS, COLS // 2)
    assert torch.equal(to_float(merged), torch.cat([to_float(p) for p in parts]))
    assert concat_parts([parts[0], torch.zeros(ROWS, COLS)]) is None  # a dense part: the caller dequantizes


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q6_K], ids=lambda t: t.name)
def test_row_permutation_is_exact(qtype):
    """The loader reorders Q/K rows while they are raw blocks (gguf.read_tensor): exact."""
    raw = random_blocks(qtype).reshape(ROWS, -1)
    order = np.array([3, 1, 5, 0, 2, 4])
    permuted = repack(raw[order], qtype, (ROWS, COLS))
    assert torch.equal(to_float(permuted), to_float(repack(raw, qtype, (ROWS, COLS)))[torch.from_numpy(order)])
