"""``--quantization int8|int4`` on float mixture-of-experts checkpoints (llmctl/layers/moe.py
``StackedExperts.quantize_experts``): the experts end up packed and smaller, the routers float;
greedy tokens on the exact activations equal transformers' on the checkpoint whose linear and
expert weights are replaced by their quantize -> dequantize round trip; 16 staggered requests
decode as each alone; what is refused (tensor parallelism, --calibration). gpt-oss's experts carry
biases (float beside the packed weights) and its clamped SwiGLU.

The tiny checkpoints' expert intermediate sizes (Qwen3-MoE 40, Mixtral and gpt-oss 48) are no
whole number of int8's 32 or int4's 64 inputs, so the down projections carry zero-padded input
columns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_factory import hf_greedy, make_config, make_hf_model, random_prompts, round_trip, staggered

from llmctl.distributed import TensorParallel
from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ConfigError, UnsupportedModelError
from llmctl.layers.moe import PackedExpert, StackedExperts
from llmctl.layers.ops import TorchOps
from llmctl.layers.quantization import linear_method_for, weight_bytes
from llmctl.models.config import ModelConfig
from llmctl.models.loader import build_model, load_model
from llmctl.sampling_params import SamplingParams

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
KINDS = ("int8", "int4")
VOCAB = 320
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_quantized")
    return {family: make_hf_model(family, root / family, seed=3) for family in FAMILIES}


def _engine(model_dir: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", kv_cache_memory=16 << 20, **kw)


def _load(model_dir: Path, quantization: str = "none"):
    return load_model(model_dir, dtype="float32", device=CPU, ops=TorchOps(), quantization=quantization)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_are_packed_and_smaller_and_the_routers_stay_float(family, kind, moe_dirs):
    plain, quantized = _load(moe_dirs[family]), _load(moe_dirs[family], kind)
    layers = [m for m in quantized.modules() if isinstance(m, StackedExperts)]
    assert layers and all(m.packed is not None and m.w13 is None and m.w2 is None for m in layers)
    for m in layers:
        assert len(m.packed) == m.num_experts and all(isinstance(e, PackedExpert) for e in m.packed)
        expert = m.packed[0]
        assert expert.gate_up.packed_format == expert.down.packed_format == kind
        assert expert.gate_up.input_padding == 0 and expert.down.input_padding > 0  # 40 / 48 inputs padded
    routers = [
        getattr(m.mlp, "router", None) or m.mlp.gate for m in quantized.model.layers if hasattr(m.mlp, "experts")
    ]
    assert routers and all("qweight" not in r._parameters and r.weight.dtype == torch.float32 for r in routers)
    float_experts = sum(m.expert_bytes() * m.num_experts for m in plain.modules() if isinstance(m, StackedExperts))
    packed_experts = sum(m.expert_bytes() * m.num_experts for m in layers)
    assert packed_experts < {"int8": 0.4, "int4": 0.25}[kind] * float_experts  # padded down columns included
    assert weight_bytes(quantized) < weight_bytes(plain) - 0.5 * float_experts


def _rounded_checkpoint(model_dir: Path, kind: str, out_dir: Path) -> Path:
    """The checkpoint with every linear layer's and expert's weight replaced by its round trip, and
    the LM head's by its per-channel int8 one (int8 and int4 take the logits from an int8 copy);
    the embedding, norms and routers as they are. Built with transformers' own model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    transposed = model.config.model_type == "gpt_oss"  # stacked [E, K, N], gate and up columns alternating
    replaced = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stacked [E, N, K]
                for e in range(param.shape[0]):
                    w = param[e].T if transposed else param[e]  # rows round independently: any row order
                    rounded = round_trip(w.clone(), kind)
                    param[e] = rounded.T if transposed else rounded
            elif name.endswith("_proj.weight"):
                param.copy_(round_trip(param.clone(), kind))
            elif name == "lm_head.weight":
                param.copy_(round_trip(param.clone(), "int8"))
            else:
                floats = ("norm.weight", "embed_tokens.weight", "mlp.gate.weight", "mlp.router.weight", "bias", "sinks")
                assert name.endswith(floats), name
                continue
            replaced += 1
    assert replaced > 10
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_on_exact_activations_equal_transformers_on_the_round_trip(family, kind, moe_dirs, tmp_path):
    prompts = random_prompts(3, VOCAB, 2, 40, seed=7)
    want = hf_greedy(_rounded_checkpoint(moe_dirs[family], kind, tmp_path / "rounded"), prompts, 10)
    engine = _engine(moe_dirs[family], quantization=kind, quant_exact_activations=True)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)] == want


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_sixteen_staggered_requests_decode_as_each_alone(family, kind, moe_dirs, gemm_from_one_row):
    engine = _engine(moe_dirs[family], quantization=kind)
    prompts = random_prompts(16, VOCAB, 2, 47, seed=5)
    together = [tokens for tokens, _ in staggered(engine, prompts, GREEDY)]
    assert together == [staggered(engine, [p], GREEDY)[0][0] for p in prompts]


def _cfg(family: str) -> ModelConfig:
    return ModelConfig.from_dict(make_config(family).to_dict())


def test_tensor_parallel_quantization_is_refused_before_any_weight_is_read():
    with pytest.raises(UnsupportedModelError, match="tensor parallel size 1 only.*--quantization none"):
        build_model(
            _cfg("qwen3_moe"),
            dtype=torch.float32,
            device=CPU,
            ops=TorchOps(),
            tp=TensorParallel(0, 2),
            linear_method=linear_method_for("int8"),
        )
    with pytest.raises(ValueError, match="tensor parallel size 1"):
        StackedExperts(
            4, 64, 32, dtype=torch.float32, tp=TensorParallel(0, 2), act=F.silu, quant_method=linear_method_for("int8")
        )


def test_calibration_is_refused_rather_than_leaving_the_experts_uncalibrated(tmp_path):
    """GPTQ rounds the linear layers only: the load stops with a one-line reason instead of
    rounding the experts on their own beside them."""
    from tokenizer_factory import byte_level_bpe

    model_dir = make_hf_model("qwen3_moe", tmp_path / "model", seed=3, vocab_size=512)
    byte_level_bpe().backend.save(str(model_dir / "tokenizer.json"))
    with pytest.raises(ConfigError, match="--calibration .* does not reach a mixture-of-experts model's experts"):
        load_model(model_dir, dtype="float32", device=CPU, ops=TorchOps(), quantization="int8", calibration="builtin")
