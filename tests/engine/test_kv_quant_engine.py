"""The engine with a quantized KV cache (``--kv-cache-dtype``): sizing by bytes, the same
scheduling guarantees as the float cache (batched == alone, prefix caching, chunking, n > 1
copy-on-write, preemption), and greedy text on the real stories260k model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, invariant
from model_factory import random_prompts
from test_block_invariants import BLOCK_SIZE, NUM_BLOCKS, BlockMachine
from test_prefix_caching import run_staggered, shared_prefix_workload

from llmctl.config import KV_CACHE_DTYPES
from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ConfigError
from llmctl.sampling_params import SamplingParams

VOCAB = 320
QUANTIZED = [d for d in KV_CACHE_DTYPES if d != "auto"]


# KIVI's default window (128 tokens) would keep these short test sequences in full precision
# throughout; two blocks make every mechanism (groups quantized mid-prompt, mid-decode) happen.
TEST_RESIDUAL = 32


def make_engine(model_dir, kind: str, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 4 << 20)
    kw.setdefault("kv_residual_length", TEST_RESIDUAL)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", kv_cache_dtype=kind, **kw)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(params=[16, 64], ids=["head_dim16", "head_dim64"])
def model_dir(request, llama_dir, llama64_dir):
    """head_dim 16 runs the kv_quant module's kernels; 64 the float module's 8-bit ones (int8, fp8)
    and, for those, the native decode loop."""
    return llama_dir if request.param == 16 else llama64_dir


def assert_all_blocks_back(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    kv = engine.runner.quantized_kv
    if kv is not None:  # no KIVI residual slot leaked
        assert sorted(kv.free_residual) == list(range(kv.residual["k"].shape[1]))
        assert all(slot == -1 for slot in kv.residual_of)


@pytest.mark.parametrize("kind", KV_CACHE_DTYPES)
def test_pool_is_sized_by_bytes(llama_dir, kind):
    budget = 4 << 20
    engine = make_engine(llama_dir, kind, kv_cache_memory=budget, max_num_seqs=8)
    fmt = engine.kv_format
    num_blocks = engine.block_manager.num_blocks
    residual = engine.runner.quantized_kv.residual["k"].shape[1] if engine.runner.quantized_kv else 0
    assert num_blocks * fmt.block_bytes() + residual * fmt.residual_block_bytes() <= budget
    assert (num_blocks + 1) * fmt.block_bytes() + residual * fmt.residual_block_bytes() > budget
    assert residual == (8 * 2 if kind.startswith("kivi") else 0)  # 8 seats x a 2-block window
    auto_blocks = make_engine(llama_dir, "auto", kv_cache_memory=budget).block_manager.num_blocks
    # fp32 model (head_dim 16): fp8/int8 (16 + 4 B per head and token) hold 3.2x the tokens of fp32 (64 B)
    ratio = {"auto": 1.0, "fp8_e4m3": 3.1, "fp8_e5m2": 3.1, "int8": 3.1, "kivi4": 3.5, "kivi2": 5.0}[kind]
    assert num_blocks >= ratio * auto_blocks
    assert f"KV {kind}" in engine.kv_description and "B/token" in engine.kv_description
    config = engine.stats_snapshot()["config"]  # what /v1/engine/stats and `llmctl top` show
    assert config["kv_cache_dtype"] == kind and config["kv_bytes_per_token"] == fmt.bytes_per_token()


def test_unknown_kv_dtype_is_a_config_error(llama_dir):
    with pytest.raises(ConfigError, match="unknown KV cache dtype 'fp4'"):
        make_engine(llama_dir, "fp4")


def test_prefix_cache_keys_include_the_kv_dtype(llama_dir):
    prompt = random_prompts(1, VOCAB, 40, 40, seed=2)[0]
    keys = {}
    for kind in ("auto", "int8"):
        engine = make_engine(llama_dir, kind)
        engine.generate([prompt], greedy(2))
        keys[kind] = set(engine.block_manager.cache)
        assert all(isinstance(key[0], int) for key in keys[kind]) or any(key[0] == kind for key in keys[kind])
    assert keys["auto"] and not keys["auto"] & keys["int8"]


def test_head_dim_64_takes_the_native_8bit_kernels(llama64_dir):
    from llmctl_kernels.cpu_native import decode_codes_native_supported

    if not decode_codes_native_supported(64):
        pytest.skip("needs the native CPU kernels on an AVX2 (or better) CPU")
    for kind in QUANTIZED:
        assert make_engine(llama64_dir, kind).runner.quantized_kv.native_codes == (not kind.startswith("kivi")), kind


@pytest.mark.parametrize("kind", QUANTIZED)
def test_batched_equals_alone(model_dir, kind):
    prompts = random_prompts(8, VOCAB, 2, 40, seed=3)
    engine = make_engine(model_dir, kind)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=1000 + i, max_tokens=10 + i % 5, ignore_eos=True)
        if i % 2
        else greedy(10 + i % 5)
        for i in range(len(prompts))
    ]
    alone = [engine.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    together = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("kind", QUANTIZED)
def test_outputs_identical_with_caching_and_chunking_on_and_off(model_dir, kind):
    """Attention always reads what the cache holds, so neither a prefix hit nor a chunk boundary
    changes a token."""
    prompts = shared_prefix_workload(6)
    params = [greedy(8)] * len(prompts)
    results = {}
    for caching, chunked in itertools.product([True, False], repeat=2):
        engine = make_engine(
            model_dir,
            kind,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=32,
            max_model_len=256,
        )
        results[caching, chunked] = run_staggered(engine, prompts, params)
        assert (engine.scheduler.prefix_hit_tokens > 0) == caching
        assert_all_blocks_back(engine)
    assert all(value == results[False, False] for value in results.values())


@pytest.mark.parametrize("kind", ["int8", "kivi2"])
def test_n4_samples_copy_on_write_equal_single_runs(model_dir, kind):
    """The shared partial block is copied with its scales (and KIVI's residual) on first write."""
    engine = make_engine(model_dir, kind, enable_prefix_caching=False)
    prompt = random_prompts(1, VOCAB, 40, 40, seed=21)[0]  # 2 full blocks + 8 tokens open
    final = engine.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=500, max_tokens=10, ignore_eos=True))[0]
    assert engine.block_manager.num_copies == 3
    samples = [o.token_ids for o in final.outputs]
    assert len({tuple(s) for s in samples}) > 1
    for i, sample in enumerate(samples):
        alone = engine.generate(
            [prompt], SamplingParams(temperature=1.0, seed=500 + i, max_tokens=10, ignore_eos=True)
        )[0]
        assert alone.outputs[0].token_ids == sample, i
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("kind", QUANTIZED)
def test_preemption_matches_a_large_pool(model_dir, kind):
    prompts = random_prompts(10, VOCAB, 30, 60, seed=8)
    params = greedy(30)
    expected = make_engine(model_dir, kind).generate(prompts, params)
    probe = make_engine(model_dir, kind, kv_cache_memory=1 << 20)
    block_bytes = probe.kv_format.block_bytes()
    residual = 4 * probe.kv_format.residual_blocks_per_seq() * probe.kv_format.residual_block_bytes()
    small = make_engine(model_dir, kind, kv_cache_memory=14 * block_bytes + residual, max_model_len=128, max_num_seqs=4)
    assert small.block_manager.num_blocks == 14
    outs = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert_all_blocks_back(small)


# stories260k, greedy, token ids of the float cache vs a quantized one: the first token where they
# differ, measured over 200 tokens for three prompts: fp8_e4m3 at 44 / 14 / 13, fp8_e5m2 at
# 40 / 1 / 3, int8 at 114 / 21 / 125 (kivi4 92 / 122 / 19, kivi2 16 / 20 / 6). A 260k-parameter
# model has near-tied logits, so a 2^-4 relative perturbation of K/V flips a token within a few
# dozen; the test pins the measured agreement with a margin of one token.
STORIES_PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park. They"]
IDENTICAL_TOKENS = {"fp8_e4m3": [43, 13, 12], "int8": [113, 20, 124]}


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_stories_greedy_text_matches_the_float_cache(stories_dir, kind):
    counts = IDENTICAL_TOKENS[kind]
    outs = {}
    for k in ("auto", kind):
        engine = LLMEngine(model=str(stories_dir), dtype="float32", kv_cache_dtype=k, kv_cache_memory=8 << 20)
        params = [greedy(n) for n in counts]
        outs[k] = [o.outputs[0].token_ids for o in engine.generate(STORIES_PROMPTS, params)]
    assert outs[kind] == outs["auto"]


# ---- the block-invariant property test, with KIVI's residual slots --------------------------------
class KiviBlockMachine(BlockMachine):
    """The random traffic of test_block_invariants.py on a kivi2 pool: block accounting as there,
    plus every open block holds exactly one residual slot and none leaks."""

    seen = {"preemptions": 0, "copies": 0, "evictions": 0, "prefix_hits": 0, "resumed_hits": 0}
    kv_format = None  # the pool's sizes, probed once (an engine start per example cost most of the test)

    @initialize()
    def make_engine(self):
        window = 2 * BLOCK_SIZE  # a window group of two blocks: quantized (and cacheable) two at a time
        if KiviBlockMachine.kv_format is None:
            KiviBlockMachine.kv_format = LLMEngine(
                model=str(self.model_dir),
                skip_tokenizer=True,
                dtype="float32",
                block_size=BLOCK_SIZE,
                kv_cache_dtype="kivi2",
                kv_cache_memory=1 << 20,
                kv_residual_length=window,
            ).kv_format
        fmt = KiviBlockMachine.kv_format
        self.engine = LLMEngine(
            model=str(self.model_dir),
            skip_tokenizer=True,
            dtype="float32",
            block_size=BLOCK_SIZE,
            kv_cache_dtype="kivi2",
            kv_residual_length=window,
            kv_cache_memory=NUM_BLOCKS * fmt.block_bytes() + 6 * 2 * fmt.residual_block_bytes(),
            max_model_len=96,
            max_num_seqs=6,
            max_num_batched_tokens=40,
        )
        assert self.engine.block_manager.num_blocks == NUM_BLOCKS
        self.live = set()

    @invariant()
    def residual_slots_accounted_for(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        kv = engine.runner.quantized_kv
        held = [slot for slot in kv.residual_of if slot >= 0]
        assert len(set(held)) == len(held), "a residual slot is held twice"
        assert sorted(held + kv.free_residual) == list(range(kv.residual["k"].shape[1])), "a residual slot leaked"
        live_blocks = {b for s in engine.live_sequences() for b in s.block_table}
        assert all(b in live_blocks for b, slot in enumerate(kv.residual_of) if slot >= 0), "a free block is open"

    def teardown(self):
        before = dict(BlockMachine.seen)  # the parent counts into its own class: move them to ours
        super().teardown()
        for key, value in BlockMachine.seen.items():
            KiviBlockMachine.seen[key] += value - before[key]
        BlockMachine.seen.update(before)
        engine = getattr(self, "engine", None)
        if engine is not None:
            assert_all_blocks_back(engine)


# derandomize: the same examples every run, so that the vacuity check below cannot fail by chance
# (with fresh random examples about 1 run in 12 saw no preemption).
KiviBlockMachine.TestCase.settings = settings(
    max_examples=20,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_invariants_with_kivi2 = KiviBlockMachine.TestCase


def test_kivi_random_traffic_exercised_every_mechanism():
    if not any(KiviBlockMachine.seen.values()):  # the property test ran in another pytest-xdist worker
        test_block_invariants_with_kivi2("runTest").runTest()
    assert all(KiviBlockMachine.seen.values()), KiviBlockMachine.seen


@pytest.fixture(scope="module", autouse=True)
def _machine_model_dir(llama_dir):
    KiviBlockMachine.model_dir = llama_dir
