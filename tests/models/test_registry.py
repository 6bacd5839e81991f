"""The model registry is the one list of families: config parsing, the GGUF reader, ``build_model``
and ``llmctl ls`` answer from it, and README.md's Models bullet names every family in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from llmctl.errors import UnsupportedModelError
from llmctl.hub.listing import CachedModel
from llmctl.layers.ops import TorchOps
from llmctl.models import registry
from llmctl.models.config import ModelConfig
from llmctl.models.gguf import gguf_config_dict
from llmctl.models.loader import build_model

README = Path(__file__).resolve().parents[2] / "README.md"


def test_an_unknown_architecture_is_refused_with_the_registry_list():
    with pytest.raises(UnsupportedModelError) as refused:
        ModelConfig.from_dict({"architectures": ["MambaForCausalLM"]})
    assert str(refused.value).endswith("llmctl runs " + ", ".join(registry.architectures()))
    assert "GraniteForCausalLM" in str(refused.value)


def test_an_unknown_gguf_architecture_is_refused_with_the_registry_list():
    archs = (
        "llama, mistral, qwen2, qwen3, granite, smollm3, olmo2, phi3, gemma, gemma2, gemma3, "
        "qwen2moe, qwen3moe, olmoe, gpt-oss, deepseek2"
    )
    with pytest.raises(UnsupportedModelError, match=f"reads GGUF architectures {archs}$"):
        gguf_config_dict({"general.architecture": "mamba"}, set(), Path("x.gguf"))


@pytest.mark.parametrize("family", registry.FAMILIES, ids=lambda f: f.model_type)
def test_build_model_makes_the_registry_class(family):
    fields = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    fields["num_attention_heads"] = 2
    if family.text_architecture is not None:  # a multimodal checkpoint: its text model's config nested
        fields = {"text_config": fields}
    cfg = ModelConfig.from_dict({"model_type": family.model_type, **fields})  # no architectures: by model_type
    assert cfg.architecture == (family.text_architecture or family.architecture)
    assert cfg.qk_norm == family.qk_norm and cfg.attention_bias == family.attention_bias
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"), ops=TorchOps())
    assert type(model) is family.model_class()


@pytest.mark.parametrize(
    ("architecture", "gguf_file", "runs"),
    [
        ("GraniteForCausalLM", None, True),
        ("MambaForCausalLM", None, False),
        ("qwen3", None, True),  # a config.json with only a model_type
        ("qwen3", "m-Q4_K_M.gguf", True),
        ("mamba", "m-Q4_K_M.gguf", False),
        (None, None, None),
    ],
)
def test_ls_says_whether_a_cached_model_runs_here(architecture, gguf_file, runs):
    row = CachedModel("o/m", "c" * 40, (), 0, Path("."), architecture, None, None, True, gguf_file=gguf_file)
    assert row.runs_here is runs


def test_readme_models_bullet_names_every_family():
    bullet = re.search(r"^- \*\*Models\*\*: ([^;]*);", README.read_text(), re.M)
    assert bullet is not None
    assert [name.strip() for name in bullet.group(1).split(",")] == [family.name for family in registry.FAMILIES]
