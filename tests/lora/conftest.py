"""Tiny base models and PEFT adapters shared by the LoRA tests (made once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_factory import ALL_LINEAR, ATTENTION, make_adapter


@pytest.fixture(scope="session")
def lora_bases(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama and a tiny Qwen3 (q/k norm, head_dim != hidden / heads)."""
    from model_factory import make_hf_model

    root = tmp_path_factory.mktemp("lora_bases")
    return {family: make_hf_model(family, root / family, seed=20 + i) for i, family in enumerate(("llama", "qwen3"))}


@pytest.fixture(scope="session")
def lora_adapters(lora_bases, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per base: rank 8 on attention (alpha 16), rank 64 on every linear (rsLoRA), rank 16 on the MLP."""
    root = tmp_path_factory.mktemp("lora_adapters")
    adapters: dict[str, dict[str, Path]] = {}
    for i, (family, base) in enumerate(lora_bases.items()):
        adapters[family] = {
            "r8": make_adapter(base, root / family / "r8", rank=8, targets=ATTENTION, seed=100 + i),
            "r64": make_adapter(
                base,
                root / family / "r64",
                rank=64,
                targets=ALL_LINEAR,
                seed=200 + i,
                alpha=32,
                use_rslora=True,
                std=0.08,
            ),
            "mlp16": make_adapter(
                base, root / family / "mlp16", rank=16, targets=["gate_proj", "up_proj", "down_proj"], seed=300 + i
            ),
        }
    return adapters
