"""GGUF loading end to end on tiny synthetic files (every supported tensor type, mixed types in
one merged projection, llama's interleaved Q/K rows, SentencePiece-kind tokenizer), and the
one-line errors for files llmctl cannot load."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf_factory import LAYER_TYPES, T, write_tiny_gguf
from model_factory import hf_greedy, random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ModelLoadError, UnsupportedModelError
from llmctl.layers.ops import TorchOps
from llmctl.models.gguf import gguf_tokenizer, load_gguf
from llmctl.sampling_params import SamplingParams

TEXTS = ["the quick brown fox", "  jumps over\nthe lazy dog ", "ünïcode 日本語 🤖 pages", "memory in pages."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(gguf file, transformers oracle dir) for llama (interleaved Q/K, untied) and qwen2 (biases, tied)."""
    root = tmp_path_factory.mktemp("gguf")
    return {
        "llama": (write_tiny_gguf(root / "llama.gguf", root / "llama-hf", arch="llama"), root / "llama-hf"),
        "qwen2": (
            write_tiny_gguf(
                root / "qwen2.gguf", root / "qwen2-hf", arch="qwen2", tie=True, seed=1, layer_types=LAYER_TYPES[:1]
            ),
            root / "qwen2-hf",
        ),
    }


def test_every_type_is_in_the_synthetic_file(tiny):
    types = {t.tensor_type for t in GGUFReader(tiny["llama"][0]).tensors}
    assert {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K} <= types


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers_on_the_same_weights(tiny, arch):
    gguf_file, hf_dir = tiny[arch]
    # token ids, no tokenizer: random ids include byte-fallback pieces that form no valid UTF-8
    engine = LLMEngine(
        model=str(gguf_file), dtype="float32", kv_cache_memory=8 << 20, skip_tokenizer=True, quantization="none"
    )
    prompts = random_prompts(4, engine.model.config.vocab_size, 2, 12, seed=3)
    expected = hf_greedy(hf_dir, prompts, 12)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.model.config.tie_word_embeddings == (arch == "qwen2")


def test_sentencepiece_tokenizer_matches_transformers(tiny):
    from transformers import AutoTokenizer

    gguf_file, _ = tiny["llama"]
    ours = gguf_tokenizer(gguf_file)
    theirs = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1  # add_bos_token
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        # SentencePiece drops the space it prepended, so only a leading space is lost
        assert ours.decode(ids) == (text[1:] if text.startswith(" ") else text)
    assert any(0x3 <= i < 3 + 256 for i in ours.encode("日本語"))  # byte fallback
    assert ours.eos_token_ids == {2}
    prompt = ours.apply_chat_template([{"role": "user", "content": "the dog"}])
    assert prompt == "<s>user: the dog</s><s>assistant:"
    assert ours.encode(prompt, add_special_tokens=False).count(1) == 2  # <s> stays whole


# ---- errors --------------------------------------------------------------------------------------


def load(path: Path):
    return load_gguf(path, dtype="float32", device=torch.device("cpu"), ops=TorchOps())


def one_line(exc: pytest.ExceptionInfo, *words: str) -> None:
    message = str(exc.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_truncated_file_names_the_file_and_tensor(tiny, tmp_path):
    src = tiny["llama"][0]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size - 5000])
    with pytest.raises(ModelLoadError) as exc:
        load(cut)
    one_line(exc, str(cut), "truncated", "'output.weight'")


@pytest.mark.parametrize("keep", [3, 100, 2000])
def test_file_cut_inside_the_header_is_one_line(tiny, tmp_path, keep):
    cut = tmp_path / "head.gguf"
    cut.write_bytes(tiny["llama"][0].read_bytes()[:keep])
    with pytest.raises(ModelLoadError) as exc:
        load(cut)
    one_line(exc, str(cut))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelLoadError) as exc:
        load(bad)
    one_line(exc, str(bad), "GGUF")


def test_unknown_tensor_type_id(tiny, tmp_path):
    data = bytearray(tiny["llama"][0].read_bytes())
    name = b"output_norm.weight"
    at = data.find(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = (999).to_bytes(4, "little")
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as exc:
        load(bad)
    one_line(exc, str(bad), "999")


def _minimal_writer(path: Path, arch: str) -> GGUFWriter:
    writer = GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    return writer


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "bloom.gguf"
    writer = _minimal_writer(path, "bloom")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    _finish(writer)
    with pytest.raises(UnsupportedModelError) as exc:
        load(path)
    one_line(exc, str(path), "general.architecture", "bloom")


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "q2k.gguf"
    writer = _minimal_writer(path, "llama")
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 84), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q2_K)
    _finish(writer)
    with pytest.raises(ModelLoadError) as exc:
        load(path)
    one_line(exc, str(path), "'blk.0.ffn_up.weight'", "Q2_K")


def test_missing_metadata_field(tmp_path):
    path = tmp_path / "nohidden.gguf"
    writer = _minimal_writer(path, "llama")
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ModelLoadError) as exc:
        load(path)
    one_line(exc, str(path), "llama.embedding_length")


def test_snapshot_directory_with_one_gguf(tiny, tmp_path):
    from llmctl.cli_options import resolve_model

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    shutil.copy(tiny["qwen2"][0], snapshot / "model-Q4_0.gguf")
    assert resolve_model(str(snapshot)) == str(snapshot / "model-Q4_0.gguf")
    engine = LLMEngine(model=str(snapshot), dtype="float32", kv_cache_memory=4 << 20)
    assert engine.model.config.family == "qwen2"
    shutil.copy(tiny["qwen2"][0], snapshot / "other.gguf")
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(snapshot))
    one_line(exc, "several GGUF files", "other.gguf")
