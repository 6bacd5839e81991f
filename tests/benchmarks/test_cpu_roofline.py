"""benchmarks/peers/cpu_roofline.py bounds the peer workload from a model's config: its parameter count
must be the model's (``transformers`` counts them), its arithmetic must follow the roofline's two
limits, and its probe must measure this CPU."""

from __future__ import annotations

import importlib
import shutil

import pytest

CONFIG = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=500,
)


@pytest.fixture(scope="module")
def roofline():
    return importlib.import_module("benchmarks.peers.cpu_roofline")


def test_parameters_are_the_models(roofline):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=False))
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    floor = roofline.workload_floor(CONFIG, 4, flops_per_s=1e12, bytes_per_s=1e12)
    assert floor["params"] == model.num_parameters() - norms


def test_each_step_takes_the_slower_of_its_two_limits(roofline):
    compute_bound = roofline.workload_floor(CONFIG, 4, flops_per_s=1e9, bytes_per_s=1e15)
    memory_bound = roofline.workload_floor(CONFIG, 4, flops_per_s=1e15, bytes_per_s=1e9)
    tokens = roofline.N_REQ * (roofline.PROMPT_LEN + roofline.OUT_LEN - 1)
    linear_flops = 2 * compute_bound["params"] * tokens  # within the attention and LM-head terms
    assert linear_flops / 1e9 < compute_bound["floor_s"] < 1.5 * linear_flops / 1e9
    # memory-bound decode: every step reads all weights once, plus the KV the sequences hold
    weights_gb = (compute_bound["params"] - CONFIG["vocab_size"] * CONFIG["hidden_size"]) * 4 / 1e9
    expected = (roofline.OUT_LEN - 1) * weights_gb + memory_bound["kv_gb_read"]
    assert memory_bound["decode_s"] == pytest.approx(expected, rel=1e-9)
    half_bandwidth = roofline.workload_floor(CONFIG, 4, flops_per_s=1e15, bytes_per_s=5e8)
    assert half_bandwidth["decode_s"] == pytest.approx(2 * memory_bound["decode_s"], rel=1e-9)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the probe is compiled with gcc")
def test_the_probe_measures_ceilings(roofline, monkeypatch):
    monkeypatch.setattr(
        roofline, "PROBE", roofline.PROBE.replace("20000000L", "200000L").replace("1L << 28", "1L << 22")
    )  # a short run: the figures, not their accuracy
    ceilings = roofline.measure_ceilings(1, "avx2")
    assert set(ceilings) == {"fma_ymm", "read"}
    assert ceilings["fma_ymm"] > 1e9 and ceilings["read"] > 1e8
