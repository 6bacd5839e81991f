"""KV-cache groups for sliding-window models (llmctl/engine/block_manager.py, model_runner.py): a
sliding group gives back the blocks no query can see any more, the pool's blocks are shared by the
groups, prefix-cache hits are limited to what every group can serve, and every block comes back
when requests finish, are aborted or preempted. Token-exactness against transformers is in
tests/models/test_sliding_window_exact.py."""

from __future__ import annotations

import pytest
from model_factory import make_hf_model, random_prompts

from llmctl.engine.block_manager import NULL_BLOCK, BlockManager, PrefixHit, blocks_per_seq
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.sequence import Sequence
from llmctl.errors import ConfigError
from llmctl.sampling_params import SamplingParams

WINDOW = 16
BLOCK = 8
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding_blocks")
    qwen2 = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
    return {
        # layer 0 full, layer 1 sliding: two groups of one layer
        "qwen2": make_hf_model("qwen2", root / "qwen2", seed=1, **qwen2),
        # the same weights, every layer full attention: the all-global baseline
        "qwen2_global": make_hf_model("qwen2", root / "qwen2_global", seed=1),
        "mistral": make_hf_model("mistral", root / "mistral", seed=2, sliding_window=WINDOW),  # one sliding group
        "gemma3": make_hf_model("gemma3", root / "gemma3", seed=3),  # sliding, full, sliding (window 8)
        "llama": make_hf_model("llama", root / "llama", seed=4),
    }


def engine_for(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    kw.setdefault("block_size", BLOCK)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def run(engine, *, check=None):
    """Step to the end; invariants after every step; token ids per request id."""
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants(engine.live_sequences())
        if check is not None:
            check(engine)
    return results


def test_groups_and_pool_layout(dirs):
    llama = engine_for(dirs["llama"])
    assert [(g.window, g.layers) for g in llama.kv_groups] == [(None, (0, 1))]
    assert llama.block_manager.group_windows == [None]
    assert llama.runner.kv_cache.shape[1] == 2  # one slot per layer, as always
    gemma = engine_for(dirs["gemma3"])
    assert [(g.window, g.layers) for g in gemma.kv_groups] == [(None, (1,)), (8, (0,)), (8, (2,))]
    assert gemma.runner.kv_cache.shape[1] == 1  # a block holds one group's layer
    assert [a.kv_group for a in gemma.model.attention_layers()] == [1, 0, 2]
    assert gemma.stats_snapshot()["config"]["kv_groups"] == [
        {"window": None, "layers": 1},
        {"window": 8, "layers": 1},
        {"window": 8, "layers": 1},
    ]
    mistral = engine_for(dirs["mistral"])
    assert [(g.window, g.layers) for g in mistral.kv_groups] == [(WINDOW, (0, 1))]
    assert mistral.max_model_len == mistral.model.config.max_position_embeddings  # no full group to fill


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3"])
def test_sliding_group_holds_at_most_its_window(dirs, name):
    """A 300-token prompt in chunks of 32, then 40 decodes: after each step the sliding groups hold
    at most the window's blocks (plus a chunk's while prefilling), the full group the whole context."""
    engine = engine_for(dirs[name], max_num_batched_tokens=32)
    bm = engine.block_manager
    prompt = random_prompts(1, 320, 300, 301, seed=5)[0]
    engine.add_request(prompt, SamplingParams(max_tokens=40, **GREEDY))
    seen = {"decode": 0, "prefill": 0}

    def check(engine):
        for seq in engine.live_sequences():
            for g, window in enumerate(bm.group_windows):
                table, held = seq.block_tables[g], bm.held_blocks(seq, g)
                if window is None:  # the whole context
                    assert held == len(table) and held * BLOCK >= seq.num_computed_tokens
                    continue
                # what the last step allocated: the window before its first token, and its chunk
                assert held <= blocks_per_seq([window], BLOCK, seq.num_tokens, 32)
                if seq.num_output_tokens >= 2:  # the last step was a decode
                    seen["decode"] += 1
                    assert held <= -(-window // BLOCK) + 1
                else:
                    seen["prefill"] += 1
                assert seq.num_computed_tokens < 200 or table.count(NULL_BLOCK) > 0

    run(engine, check=check)
    assert seen["decode"] > 30 and seen["prefill"] > 5
    assert bm.num_free_blocks == bm.num_blocks


def test_blocks_released_as_the_window_moves(dirs):
    """Unit level: a sliding group's leading blocks go back once no query from the next token on
    sees them; the full group keeps every block."""
    bm = BlockManager(64, BLOCK, group_windows=[None, WINDOW])
    seq = Sequence("r", list(range(100)), 100, SamplingParams())
    assert bm.allocate(seq, 40)
    assert [len(t) for t in seq.block_tables] == [5, 5]
    seq.num_computed_tokens = 40
    bm.cache_full_blocks(seq)
    assert bm.allocate(seq, 1)  # next query at 40 sees keys 25..40: blocks 3, 4, 5
    assert seq.block_tables[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in seq.block_tables[0]
    assert bm.held_blocks(seq, 0) == 6 and bm.held_blocks(seq, 1) == 3
    bm.check_invariants([seq])
    bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_hit_is_what_every_group_can_serve():
    """The full group serves 8 blocks; the sliding group (window 16: the first new token sees the
    last two blocks) lost block 7, so the hit is 7 blocks, adopting only blocks 5 and 6 there."""
    bm = BlockManager(64, BLOCK, group_windows=[None, WINDOW])
    first = Sequence("a", list(range(64)), 64, SamplingParams())
    assert bm.allocate(first, 64)
    first.num_computed_tokens = 64
    bm.cache_full_blocks(first)
    full, sliding = list(first.block_tables[0]), list(first.block_tables[1])
    bm.free(first)
    second = Sequence("b", list(range(64)) + [99] * 10, 74, SamplingParams())
    hit = bm.find_cached_prefix(second)
    assert isinstance(hit, PrefixHit) and len(hit) == 8
    assert hit.tables == [full, [NULL_BLOCK] * 6 + sliding[6:8]]
    # evict the sliding group's block 7 (as pool pressure would)
    block = bm.blocks[sliding[7]]
    del bm.evictable[block.block_id], bm.caches[1][block.cache_key]
    block.cache_key = None
    bm.free_uncached.append(block.block_id)
    hit = bm.find_cached_prefix(second)
    assert len(hit) == 7 and hit.tables == [full[:7], [NULL_BLOCK] * 5 + sliding[5:7]]
    assert bm.allocate(second, 74 - 56, hit)
    assert second.num_computed_tokens == 56
    assert bm.held_blocks(second, 1) == 2 + 3 and bm.held_blocks(second, 0) == 10
    bm.check_invariants([second])
    bm.free(second)
    assert bm.num_free_blocks == bm.num_blocks


def test_more_long_sequences_fit_in_the_same_memory(dirs):
    """The same --kv-cache-memory (60 blocks of both layers) and 8 requests of 150 + 40 tokens: with
    the window a block holds one layer (120 blocks), and a decoding sequence needs all its blocks
    in the full layer but 3 in the sliding one, so 4 sequences decode at once without preemption
    where the all-global model fits 3 and preempts (measured on the engine's own accounting)."""
    memory = 60 * engine_for(dirs["qwen2_global"]).kv_format.block_bytes()
    prompts = random_prompts(8, 320, 150, 151, seed=9)
    peaks, preemptions = {}, {}
    for name in ("qwen2_global", "qwen2"):
        engine = engine_for(dirs[name], kv_cache_memory=memory, max_num_batched_tokens=512, max_model_len=240)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_tokens=40, **GREEDY))
        peak = 0

        def check(engine):
            nonlocal peak
            peak = max(peak, sum(s.num_computed_tokens >= 150 for s in engine.scheduler.running))

        run(engine, check=check)
        peaks[name], preemptions[name] = peak, engine.scheduler.num_preemptions
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.block_manager.num_blocks == 120
    assert peaks == {"qwen2_global": 3, "qwen2": 4}, peaks
    assert preemptions["qwen2"] == 0 < preemptions["qwen2_global"]


def test_every_block_back_after_aborts_and_preemptions(dirs):
    """Gemma 3 shape (two sliding groups and a full one) in a pool that forces preemption, with
    aborts and n > 1 forks mixed in: invariants every step, everything free at the end."""
    engine = engine_for(
        dirs["gemma3"], kv_cache_memory=2 * 2 * 32 * BLOCK * 4 * 70, max_num_batched_tokens=48, max_num_seqs=8
    )
    prompts = random_prompts(12, 320, 20, 120, seed=11)
    ids = []
    for i, prompt in enumerate(prompts):
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=30, n=2 if i % 4 == 0 else 1, **GREEDY)))
    for step in range(400):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.block_manager.check_invariants(engine.live_sequences())
        if step in (5, 17, 30):
            engine.abort(ids[step % len(ids)])
    assert not engine.has_unfinished()
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    snapshot = engine.stats_snapshot()
    assert [g["held"] for g in snapshot["kv"]["groups"]] == [0, 0, 0]


def test_preempted_sequence_resumes_identically(dirs):
    """Greedy output under preemption (recompute, with prefix-cache hits on resuming) equals the
    output with a pool large enough for all."""
    prompts = random_prompts(6, 320, 60, 100, seed=13)
    params = SamplingParams(max_tokens=24, **GREEDY)
    roomy = [o.outputs[0].token_ids for o in engine_for(dirs["gemma3"]).generate(prompts, params)]
    tight = engine_for(dirs["gemma3"], kv_cache_memory=2 * 2 * 32 * BLOCK * 4 * 60, max_num_batched_tokens=40)
    ids = [tight.add_request(p, params) for p in prompts]
    results = run(tight)
    assert tight.scheduler.num_preemptions > 0
    assert [results[i] for i in ids] == roomy


def test_ngram_speculation_with_groups(dirs):
    prompt = ([5, 6, 7, 8, 9] * 20)[:90]
    params = SamplingParams(max_tokens=30, **GREEDY)
    (plain,) = engine_for(dirs["gemma3"]).generate([prompt], params)
    spec = engine_for(dirs["gemma3"], speculative_model="ngram", num_speculative_tokens=3)
    (out,) = spec.generate([prompt], params)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_draft_model_reads_the_full_group(dirs):
    """Group 0 is full attention, so a draft model works (here the target itself: every draft accepted)."""
    prompt = random_prompts(1, 320, 70, 71, seed=17)[0]
    params = SamplingParams(max_tokens=20, **GREEDY)
    (plain,) = engine_for(dirs["gemma3"]).generate([prompt], params)
    spec = engine_for(dirs["gemma3"], speculative_model=str(dirs["gemma3"]), num_speculative_tokens=3)
    (out,) = spec.generate([prompt], params)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec.speculator.counters.num_accepted > 0


def test_refusals(dirs):
    with pytest.raises(ConfigError, match="ngram"):
        engine_for(dirs["mistral"], speculative_model=str(dirs["mistral"]), num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        engine_for(dirs["gemma3"], kv_cache_dtype="kivi4", kv_residual_length=BLOCK)


def test_int8_kv_with_groups_batched_equals_alone(dirs):
    prompts = random_prompts(4, 320, 40, 90, seed=19)
    params = SamplingParams(max_tokens=12, **GREEDY)
    engine = engine_for(dirs["gemma3"], kv_cache_dtype="int8", max_num_batched_tokens=48)
    alone = [engine.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert batched == alone
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
