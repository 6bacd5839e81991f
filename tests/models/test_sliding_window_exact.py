"""Sliding-window checkpoints (Mistral, Qwen2 with per-layer windows, Qwen3) with prompts well past
the window: greedy output token-identical to transformers (fp32, CPU), alone, batched with chunked
prefill, with prefix caching, on the native CPU kernels and on the torch references; and with a
quantized KV cache against its own windowless equivalent."""

from __future__ import annotations

import pytest
from model_factory import hf_greedy, make_hf_model, random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

VOCAB = 320
WINDOW = 16
CHECKPOINTS = {  # name -> (family, overrides)
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    # layer 0 full, layer 1 sliding (max_window_layers = 1)
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}),
    # head_dim 64: the native kernels' tiled paths (prefill tiles, the 8-bit KV kernels)
    "mistral64": ("mistral", {"sliding_window": WINDOW, "head_dim": 64}),
    "mistral64_wide": ("mistral", {"sliding_window": 512, "head_dim": 64}),  # a window no prompt reaches
    "mistral64_full": ("mistral", {"sliding_window": None, "head_dim": 64}),  # same weights, no window
}
PROMPTS = [list(range(3, 72)), [5], list(range(20, 36)), list(range(40, 57)), list(range(100, 140))]  # 69 ... tokens


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding_models")
    seeds = {"mistral64_wide": 7, "mistral64_full": 7, "mistral64": 7}
    return {
        name: make_hf_model(family, root / name, seed=seeds.get(name, i), **overrides)
        for i, (name, (family, overrides)) in enumerate(CHECKPOINTS.items())
    }


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def generate_each(engine, prompts, n):
    outs = []
    for prompt in prompts:
        (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        outs.append(out.outputs[0].token_ids)
    return outs


def test_config_reads_layer_windows(model_dirs):
    from llmctl.models.config import ModelConfig

    mistral = ModelConfig.from_dir(model_dirs["mistral"])
    assert mistral.layer_types == ["sliding_attention"] * 2 and mistral.layer_window(1) == WINDOW
    qwen2 = ModelConfig.from_dir(model_dirs["qwen2"])
    assert qwen2.layer_types == ["full_attention", "sliding_attention"]
    assert [qwen2.layer_window(i) for i in range(2)] == [None, WINDOW]
    assert ModelConfig.from_dir(model_dirs["mistral64_full"]).layer_types == ["full_attention"] * 2
    engine = make_engine(model_dirs["qwen2"])
    assert [a.sliding_window for a in engine.model.attention_layers()] == [None, WINDOW]
    assert engine.max_model_len > WINDOW  # the context is no longer capped at the window


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "mistral64"])
def test_single_requests_match_transformers(model_dirs, name, native, monkeypatch):
    monkeypatch.setenv("LLMCTL_NATIVE_CPU_KERNELS", "1" if native else "0")
    expected = hf_greedy(model_dirs[name], PROMPTS, 24)
    engine = make_engine(model_dirs[name])
    assert generate_each(engine, PROMPTS, 24) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["mistral", "qwen2", "mistral64"])
def test_sixteen_staggered_requests_match_transformers(model_dirs, name):
    prompts = random_prompts(16, VOCAB, 1, 80, seed=3)
    lengths = [8 + (i * 5) % 17 for i in range(16)]
    expected = hf_greedy(model_dirs[name], prompts, max(lengths))
    engine = make_engine(model_dirs[name], max_num_batched_tokens=64)  # chunked prefill of the longer prompts
    results: dict[str, list[int]] = {}
    ids = []
    pending = list(zip(prompts, lengths))
    while pending or engine.has_unfinished():
        for _ in range(2):  # two new arrivals per step while any remain
            if pending:
                prompt, n = pending.pop(0)
                ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants(engine.live_sequences())
    assert [r for r in engine.stats.steps if r.prefill_tokens and r.decode_tokens], "no step mixed prefill and decode"
    for request_id, n, want in zip(ids, lengths, expected):
        assert results[request_id] == want[:n], request_id
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["mistral", "qwen2", "mistral64"])
def test_prefix_cache_hit_past_the_window(model_dirs, name):
    """A second request sharing a 64-token prefix adopts its cached blocks and computes only its
    tail, whose queries must still see exactly their windows."""
    prefix = list(range(50, 114))
    prompts = [prefix + [7, 8, 9], prefix + [200, 201, 202, 203, 204]]
    expected = hf_greedy(model_dirs[name], prompts, 20)
    engine = make_engine(model_dirs[name], enable_prefix_caching=True, block_size=16)
    assert generate_each(engine, prompts, 20) == expected
    assert engine.counters().prefix_cache_hits > 0


def test_quantized_kv_with_a_window_no_prompt_reaches_is_windowless(model_dirs):
    """int8 KV: with a window longer than every sequence the windowed kernels give the tokens of the
    same weights without a window (its own reference), native and torch paths alike."""
    prompts = [PROMPTS[0], PROMPTS[4]]
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LLMCTL_NATIVE_CPU_KERNELS", native)
            wide = generate_each(make_engine(model_dirs["mistral64_wide"], kv_cache_dtype="int8"), prompts, 16)
            full = generate_each(make_engine(model_dirs["mistral64_full"], kv_cache_dtype="int8"), prompts, 16)
        assert wide == full


def test_quantized_kv_window_batched_equals_alone(model_dirs):
    """int8 KV with a window of 16 and 69-token prompts: batched with chunked prefill, each request's
    tokens equal its tokens alone, and the native and torch paths agree."""
    prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[2], list(range(7, 90))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LLMCTL_NATIVE_CPU_KERNELS", native)
            engine = make_engine(model_dirs["mistral64"], kv_cache_dtype="int8", max_num_batched_tokens=48)
            alone = generate_each(engine, prompts, 16)
            batched = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
        assert batched == alone
        runs.append(alone)
    assert runs[0] == runs[1]


# ---- KV-cache groups: sliding layers give back the blocks they no longer see ----------------------


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """Gemma 3 (text): sliding, full, sliding layers (window 8): three KV-cache groups."""
    return make_hf_model("gemma3", tmp_path_factory.mktemp("sliding_gemma3") / "gemma3", seed=21)


LONG_PROMPTS = [list(range(3, 150)), list(range(60, 160)), [9] * 5 + list(range(100, 230))]  # far past the windows


def _dirs(model_dirs, gemma3_dir):
    return {**model_dirs, "gemma3": gemma3_dir}


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma3"])
def test_long_prompts_alone_match_transformers_with_groups(model_dirs, gemma3_dir, name):
    """Prompts of 100-140 tokens (windows of 8 or 16) in 32-token chunks: the sliding groups release
    their old blocks as the prompt and the output advance, and the tokens stay transformers'."""
    model_dir = _dirs(model_dirs, gemma3_dir)[name]
    expected = hf_greedy(model_dir, LONG_PROMPTS, 24)
    engine = make_engine(model_dir, block_size=8, max_num_batched_tokens=32)
    assert generate_each(engine, LONG_PROMPTS, 24) == expected
    bm = engine.block_manager
    assert any(w is not None for w in bm.group_windows)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma3"])
def test_sixteen_staggered_shared_prefix_with_groups(model_dirs, gemma3_dir, name):
    """16 requests sharing a 96-token prefix, joining two per step, with chunked prefill and prefix
    caching: every output equals transformers', invariants hold every step, the sliding groups stay
    within their bound, prefix hits happen, and every block comes back."""
    from model_factory import random_prompts

    from llmctl.engine.block_manager import blocks_per_seq

    model_dir = _dirs(model_dirs, gemma3_dir)[name]
    prefix = random_prompts(1, VOCAB, 96, 97, seed=23)[0]
    prompts = [prefix + tail for tail in random_prompts(16, VOCAB, 1, 40, seed=29)]
    lengths = [6 + (i * 7) % 19 for i in range(16)]
    expected = hf_greedy(model_dir, prompts, max(lengths))
    engine = make_engine(model_dir, block_size=8, max_num_batched_tokens=48, enable_prefix_caching=True)
    bm = engine.block_manager
    results: dict[str, list[int]] = {}
    ids = []
    pending = list(zip(prompts, lengths))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                prompt, n = pending.pop(0)
                ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        live = engine.live_sequences()
        bm.check_invariants(live)
        for seq in live:
            for g, window in enumerate(bm.group_windows):
                if window is not None:
                    assert bm.held_blocks(seq, g) <= blocks_per_seq([window], 8, seq.num_tokens, 48)
    for request_id, n, want in zip(ids, lengths, expected):
        assert results[request_id] == want[:n], request_id
    assert engine.counters().prefix_cache_hits > 0
    assert bm.num_free_blocks == bm.num_blocks
