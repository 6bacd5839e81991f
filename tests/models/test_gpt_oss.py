"""gpt-oss against transformers (fp32, CPU) beyond tests/models/test_models_exact.py: MXFP4
checkpoints (written here, the exact inverse of transformers' dequantization) loaded bit for bit,
dequantized or with their experts kept packed; prompts longer than the sliding window with
prefix-cache hits, the router and expert activation against transformers' modules, and the decode
loop's refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_cases import mxfp4_experts
from model_factory import hf_greedy, make_hf_model, random_prompts, round_trip, staggered
from safetensors.torch import load_file, save_file

from llmctl.engine.llm_engine import LLMEngine
from llmctl.layers.moe import RouterSpec, StackedExperts, clamped_swiglu, route
from llmctl.layers.ops import TorchOps
from llmctl.layers.quantization import PackedInt8, dequantize, weight_bytes
from llmctl.layers.quantization.params import kernel_packed
from llmctl.models import mxfp4
from llmctl.models.loader import load_model
from llmctl.sampling_params import SamplingParams

VOCAB = 320


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def generate_each(engine, prompts, n):
    outs = []
    for prompt in prompts:
        (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        outs.append(out.outputs[0].token_ids)
    return outs


# ---- MXFP4 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory):
    """The same tiny gpt-oss twice: ``dense`` saved by transformers with expert weights that MXFP4
    holds exactly, and ``mxfp4`` with those experts as ``*_blocks`` / ``*_scales`` and the
    checkpoint's ``quantization_config``, as OpenAI's checkpoints store them."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    # 64 hidden and 64 expert features: both multiples of the 32-value MXFP4 groups
    source = make_hf_model("gpt_oss", root / "source", seed=5, intermediate_size=64)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    packed = mxfp4_experts(model, torch.Generator().manual_seed(7))
    dense = root / "dense"
    model.save_pretrained(dense)
    quantized = root / "mxfp4"
    quantized.mkdir()
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (quantized / "config.json").write_text(json.dumps(config))
    tensors = load_file(dense / "model.safetensors")
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    return dense, quantized, packed


def test_dequantize_is_transformers(mxfp4_dirs):
    """The writer above inverts transformers' ``convert_moe_packed_tensors`` exactly, and llmctl's
    dequantization gives its values bit for bit (fp32 and bf16)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dense, _, packed = mxfp4_dirs
    weights = load_file(dense / "model.safetensors")
    for name, (blocks, scales) in packed.items():
        for dtype in (torch.float32, torch.bfloat16):
            theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            assert torch.equal(mxfp4.dequantize(blocks, scales, dtype), theirs), name
        assert torch.equal(theirs.float(), weights[name]), name  # bf16 holds them exactly too


LOAD = dict(dtype="float32", device=torch.device("cpu"), ops=TorchOps())


def test_mxfp4_checkpoint_loads_the_dequantized_weights(mxfp4_dirs):
    dense, quantized, _ = mxfp4_dirs
    from_dense, from_mxfp4 = load_model(dense, **LOAD).state_dict(), load_model(quantized, **LOAD).state_dict()
    assert from_dense.keys() == from_mxfp4.keys()
    for name, tensor in from_dense.items():
        assert torch.equal(tensor, from_mxfp4[name]), name


def test_mxfp4_experts_stay_packed_with_the_same_values(mxfp4_dirs):
    """``--quantization auto`` (the default) keeps the experts packed: int8 in groups of 32 (the
    doubled e2m1 values, the scale halved) standing for exactly the checkpoint's values, at about a
    quarter of their float32 bytes; the expert biases and every other weight as the dequantized load."""
    dense, quantized, _ = mxfp4_dirs
    model = load_model(quantized, quantization="auto", **LOAD)
    weights = load_file(dense / "model.safetensors")
    layers = [m for m in model.modules() if isinstance(m, StackedExperts)]
    assert layers and all(m.packed is not None and m.w13 is None and m.w2 is None for m in layers)
    for i, layer in enumerate(layers):
        gate_up, down = (weights[f"model.layers.{i}.mlp.experts.{p}"] for p in ("gate_up_proj", "down_proj"))
        for e, expert in enumerate(layer.packed):
            merged, down_packed = kernel_packed(expert.gate_up), kernel_packed(expert.down)
            assert isinstance(merged, PackedInt8) and merged.group_size == 32 and merged.mins is None
            # transformers' gate_up_proj [H, 2I]: gate and up in alternate columns
            assert torch.equal(dequantize(merged), torch.cat([gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T]))
            assert torch.equal(dequantize(down_packed), down[e].T)
        float_bytes = (gate_up.numel() + down.numel()) * 4
        assert layer.expert_bytes() * layer.num_experts < 0.3 * float_bytes
        bias = weights[f"model.layers.{i}.mlp.experts.gate_up_proj_bias"]  # alternating too
        assert torch.equal(layer.w13_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
    dequantized = load_model(quantized, quantization="none", **LOAD)
    assert weight_bytes(model) < weight_bytes(dequantized)
    rest = {n: t for n, t in dequantized.state_dict().items() if ".experts.w13" not in n and ".experts.w2" not in n}
    ours = model.state_dict()
    for name, tensor in rest.items():
        assert torch.equal(ours[name], tensor), name


def test_mxfp4_experts_are_dequantized_and_sharded_under_tensor_parallelism(mxfp4_dirs):
    """Packed experts run on one rank: with tensor parallelism ``auto`` dequantizes them, and each
    rank holds its half of every expert's features."""
    from llmctl.distributed import TensorParallel

    _, quantized, _ = mxfp4_dirs
    whole = load_model(quantized, quantization="none", **LOAD)
    for rank in (0, 1):
        model = load_model(quantized, quantization="auto", tp=TensorParallel(rank, 2), **LOAD)
        layers = [m for m in model.modules() if isinstance(m, StackedExperts)]
        assert layers and all(m.packed is None and m.intermediate_size == 32 for m in layers)
        reference = next(m for m in whole.modules() if isinstance(m, StackedExperts))
        assert torch.equal(layers[0].w13_bias, reference.w13_bias.view(-1, 2, 2, 32)[:, :, rank].flatten(1))


def test_mxfp4_checkpoint_matches_transformers(mxfp4_dirs):
    """Greedy tokens and chosen-token log-probabilities of the MXFP4 checkpoint equal transformers'
    on its dequantized weights: dequantized, packed on the exact activations, and packed as it runs
    by default (activations rounded to int16's precision per block of 32)."""
    from transformers import AutoModelForCausalLM

    dense, quantized, _ = mxfp4_dirs
    prompts = [[5], list(range(3, 36)), random_prompts(1, VOCAB, 50, 51, seed=3)[0]]
    expected = hf_greedy(dense, prompts, 16)
    assert generate_each(make_engine(quantized, quantization="none"), prompts, 16) == expected
    assert generate_each(make_engine(quantized, quant_exact_activations=True), prompts, 16) == expected
    engine = make_engine(quantized)
    assert all(m.packed is not None for m in engine.model.modules() if isinstance(m, StackedExperts))
    assert generate_each(engine, prompts, 16) == expected
    prompt = prompts[1]
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))
    tokens = out.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantizing_the_other_layers_keeps_the_mxfp4_experts(mxfp4_dirs, kind, tmp_path):
    """``--quantization int8|int4`` on an MXFP4 checkpoint quantizes the attention projections and
    takes the logits from an int8 copy of the LM head, and keeps the experts as the checkpoint packs
    them (not rounded again): greedy tokens equal transformers' on the dense twin with just those
    layers rounded."""
    from transformers import AutoModelForCausalLM

    dense, quantized, _ = mxfp4_dirs
    model = load_model(quantized, quantization=kind, **LOAD)
    layers = [m for m in model.modules() if isinstance(m, StackedExperts)]
    weights = load_file(dense / "model.safetensors")
    for i, layer in enumerate(layers):
        down = weights[f"model.layers.{i}.mlp.experts.down_proj"]
        assert all(torch.equal(dequantize(kernel_packed(e.down)), down[j].T) for j, e in enumerate(layer.packed))
    assert layers and model.model.layers[0].self_attn.qkv_proj.packed_format == kind
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
                param.copy_(round_trip(param.clone(), kind))
            elif name == "lm_head.weight":
                param.copy_(round_trip(param.clone(), "int8"))
    hf.save_pretrained(tmp_path / "rounded")
    prompts = [[5], list(range(3, 36)), random_prompts(1, VOCAB, 50, 51, seed=3)[0]]
    want = hf_greedy(tmp_path / "rounded", prompts, 12)
    assert generate_each(make_engine(quantized, quantization=kind, quant_exact_activations=True), prompts, 12) == want


def test_transformers_dequantizing_the_mxfp4_checkpoint_agrees(mxfp4_dirs):
    """transformers itself loading the MXFP4 files (``Mxfp4Config(dequantize=True)``) holds the
    same weights as the dense checkpoint, so the oracle above is transformers' reading of the file."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    dense, quantized, _ = mxfp4_dirs
    try:
        theirs = AutoModelForCausalLM.from_pretrained(
            quantized, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
        ).state_dict()
    except (ImportError, RuntimeError, ValueError) as exc:  # an environment without its requirements
        pytest.skip(f"transformers cannot dequantize MXFP4 here: {exc}")
    weights = load_file(dense / "model.safetensors")
    for name, tensor in weights.items():
        assert torch.equal(theirs[name].float(), tensor), name


def test_sixteen_staggered_requests_on_packed_experts_decode_as_each_alone(mxfp4_dirs, gemm_from_one_row):
    """Requests joining one per step (so each runs beside others at every stage) get the tokens
    and log-probabilities they get alone, and every KV block comes back."""
    _, quantized, _ = mxfp4_dirs
    engine = make_engine(quantized, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    prompts = random_prompts(16, VOCAB, 3, 40, seed=8)

    together = staggered(engine, prompts, params)
    alone = [staggered(engine, [p], params)[0] for p in prompts]
    assert [t for t, _ in together] == [t for t, _ in alone]
    for (_, batched), (_, single) in zip(together, alone):
        torch.testing.assert_close(torch.tensor(batched), torch.tensor(single), rtol=0, atol=1e-4)


def test_mxfp4_half_a_pair_is_an_error(tmp_path):
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    tensors = iter([(tmp_path / "m.safetensors", "x.gate_up_proj_blocks", blocks)])
    from llmctl.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="has no 'x.gate_up_proj_scales'"):
        list(mxfp4.dequantized_tensors(tensors, torch.float32))


# ---- windows and prefix caching ----------------------------------------------------------------


def test_prefix_cache_hits_past_the_window(hf_model_dirs):
    """Requests sharing a 40-token prefix (5 windows of 8) adopt its cached blocks and compute only
    their tails, whose queries must still see exactly their windows and sinks."""
    model_dir = hf_model_dirs["gpt_oss"]
    prefix = random_prompts(1, VOCAB, 40, 41, seed=11)[0]
    prompts = [prefix + [7, 8, 9], prefix + [200, 201, 202, 203, 204], prefix[:33] + [17] * 12]
    expected = hf_greedy(model_dir, prompts, 20)
    engine = make_engine(model_dir, enable_prefix_caching=True, block_size=8)
    assert generate_each(engine, prompts, 20) == expected
    assert engine.counters().prefix_cache_hits > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_staggered_shared_prefix_with_chunked_prefill(hf_model_dirs):
    """8 requests sharing a 48-token prefix, two joining per step, chunked prefill and prefix
    caching: each output equals transformers' alone."""
    model_dir = hf_model_dirs["gpt_oss"]
    prefix = random_prompts(1, VOCAB, 48, 49, seed=23)[0]
    prompts = [prefix + tail for tail in random_prompts(8, VOCAB, 1, 20, seed=29)]
    lengths = [6 + (i * 7) % 13 for i in range(8)]
    expected = hf_greedy(model_dir, prompts, max(lengths))
    engine = make_engine(model_dir, block_size=8, max_num_batched_tokens=40, enable_prefix_caching=True)
    results, ids, pending = {}, [], list(zip(prompts, lengths))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                prompt, n = pending.pop(0)
                ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants(engine.live_sequences())
    for request_id, n, want in zip(ids, lengths, expected):
        assert results[request_id] == want[:n], request_id
    assert engine.counters().prefix_cache_hits > 0


def test_int8_kv_cache_runs_the_sink_layers(hf_model_dirs):
    """An 8-bit KV cache runs the sink layers (the torch references over its dequantized blocks,
    tests/layers/test_attention_sinks.py checks them exactly): int8 keys and values move the
    logits a little, not this model's first greedy token."""
    model_dir = hf_model_dirs["gpt_oss"]
    prompt = list(range(3, 30))
    (want,) = hf_greedy(model_dir, [prompt], 8)
    (got,) = generate_each(make_engine(model_dir, kv_cache_dtype="int8"), [prompt], 8)
    assert len(got) == 8 and got[0] == want[0]


def test_triton_backend_matches_transformers(hf_model_dirs):
    """The engine on the Triton ops (Triton's interpreter here): the sink layers run the torch
    references, everything else the Triton kernels; greedy tokens are still transformers'."""
    model_dir = hf_model_dirs["gpt_oss"]
    prefix = list(range(10, 30))
    prompts = [prefix + [5, 6, 7], prefix + [40, 41], random_prompts(1, VOCAB, 35, 36, seed=2)[0]]
    expected = hf_greedy(model_dir, prompts, 8)
    engine = make_engine(model_dir, kernel_backend="triton", max_num_batched_tokens=24, block_size=16)
    assert engine.model.model.layers[0].self_attn.attn.ops.name == "triton"
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


# ---- the pieces against transformers' modules ---------------------------------------------------


def test_router_and_activation_are_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    config = GptOssConfig(
        hidden_size=32, num_local_experts=8, num_experts_per_tok=3, swiglu_limit=0.7, swiglu_alpha=1.3
    )
    torch.manual_seed(0)
    router = GptOssTopKRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.bias.normal_(0, 1.0)
    x = torch.randn(20, 32)
    _, scores, indices = router(x)
    weights, ids = route(
        torch.nn.functional.linear(x, router.weight, router.bias), RouterSpec(8, 3, False, "topk_softmax")
    )
    assert torch.equal(ids, indices)
    assert torch.equal(weights, scores)

    experts = GptOssExperts(config)
    gate_up = torch.randn(20, 64) * 2  # interleaved as transformers applies it; ours: gate then up
    ours = clamped_swiglu(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], -1), 1.3, 0.7)
    assert torch.equal(ours, experts._apply_gate(gate_up))


def test_expert_clamp_bites_in_the_test_model(hf_model_dirs):
    """The tiny checkpoint's SwiGLU limit (1.0) is reached by its gate and up features, so the
    exactness tests see the clamps."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_model_dirs["gpt_oss"], dtype=torch.float32).eval()
    seen = []
    experts = hf.model.layers[0].mlp.experts
    original = experts._apply_gate
    experts._apply_gate = lambda gate_up: (seen.append(gate_up.abs().max().item()), original(gate_up))[1]
    with torch.inference_mode():
        hf(torch.tensor([list(range(3, 40))]))
    assert seen and max(seen) > hf.config.swiglu_limit


def test_native_decode_loop_leaves_float_experts_to_the_modules(hf_model_dirs):
    """The loop runs gpt-oss with packed experts (tests/models/test_decode_loop.py); float ones stay
    on the module path, which says so."""
    from llmctl.models.native_decode import why_not
    from llmctl.platform import select_kernels

    model = load_model(
        hf_model_dirs["gpt_oss"], dtype="float32", device=torch.device("cpu"), ops=TorchOps(native_cpu=True)
    )
    kernels = select_kernels("torch", torch.device("cpu"))  # what why_not asks first, as it does
    if not kernels.decode_loop:
        pytest.skip(f"no decode loop here: {kernels.decode_loop_why_not()}")
    pool = torch.zeros(2, len(model.model.layers), 1, 16, model.config.num_kv_heads, model.config.head_dim)
    assert why_not(model, pool).startswith("float experts")


def test_registry_entry():
    from llmctl.models import registry

    family = registry.family_for("GptOssForCausalLM")
    assert family is not None and family.name == "gpt-oss"
    assert family.native_decode_why_not is None


def test_sinks_are_read_per_head(hf_model_dirs):
    """Each layer's attention gets its own sinks, one per query head, shared with the checkpoint's
    ``self_attn.sinks`` parameter."""
    model_dir = Path(hf_model_dirs["gpt_oss"])
    model = load_model(model_dir, dtype="float32", device=torch.device("cpu"), ops=TorchOps())
    weights = load_file(model_dir / "model.safetensors")
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.attn.sinks is layer.self_attn.sinks
        assert torch.equal(layer.self_attn.sinks, weights[f"model.layers.{i}.self_attn.sinks"])
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8, None, 8, None]
