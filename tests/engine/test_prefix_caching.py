"""Prefix caching, copy-on-write for n > 1, chunked prefill and fair scheduling."""

from __future__ import annotations

import itertools

import pytest
from model_factory import random_prompts

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

VOCAB = 320


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def shared_prefix_workload(n: int = 12) -> list[list[int]]:
    system = random_prompts(1, VOCAB, 45, 45, seed=11)[0]  # 2 full blocks + 13 tokens
    suffixes = random_prompts(n, VOCAB, 1, 30, seed=12)
    return [system + s for s in suffixes]


def run_staggered(engine: LLMEngine, prompts, params) -> list[list[int]]:
    """Requests arrive one per step, so later ones can hit blocks cached by earlier ones."""
    ids, results = [], {}
    pending = list(zip(prompts, params))
    while pending or engine.has_unfinished():
        if pending:
            prompt, sp = pending.pop(0)
            ids.append(engine.add_request(prompt, sp))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [o.token_ids for o in out.outputs]
        engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [results[i] for i in ids]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_outputs_identical_with_caching_and_chunking_on_and_off(llama_dir, greedy):
    prompts = shared_prefix_workload()
    params = [
        SamplingParams(
            temperature=0 if greedy else 0.8,
            top_p=0.95,
            seed=None if greedy else 77 + i,
            max_tokens=12,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    results = {}
    for caching, chunked in itertools.product([True, False], repeat=2):
        engine = make_engine(
            llama_dir,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=32,
            max_model_len=256,
        )
        results[caching, chunked] = run_staggered(engine, prompts, params)
        hits = engine.scheduler.prefix_hit_tokens
        assert (hits > 0) == caching
        if chunked:
            assert max(r.prefill_tokens + r.decode_tokens for r in engine.stats.steps) <= 32
        else:
            assert any(r.prefill_tokens > 32 for r in engine.stats.steps)
    baseline = results[False, False]
    for key, value in results.items():
        assert value == baseline, key


def test_second_request_reuses_cached_prefix(llama_dir):
    engine = make_engine(llama_dir)
    prompt = random_prompts(1, VOCAB, 50, 50, seed=4)[0]
    first = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert first.num_cached_tokens == 0
    states = engine.block_manager.block_states()
    assert states.count("c") == 3  # the prompt's three full blocks stay cached after it finished
    second = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert second.num_cached_tokens == 48
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.scheduler.prefix_query_tokens == 100 and engine.scheduler.prefix_hit_tokens == 48


def test_whole_prompt_hit_still_computes_last_token(llama_dir):
    engine = make_engine(llama_dir)
    prompt = random_prompts(1, VOCAB, 32, 32, seed=9)[0]  # exactly two blocks
    a = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    b = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert b.num_cached_tokens == 16  # the last block is recomputed: its last token's logits are needed
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_n4_samples_share_prompt_blocks_and_equal_single_runs(llama_dir):
    engine = make_engine(llama_dir, enable_prefix_caching=False)
    prompt = random_prompts(1, VOCAB, 40, 40, seed=21)[0]  # 2 full blocks + a partial one of 8 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=500, max_tokens=10, ignore_eos=True)
    request_id = engine.add_request(prompt, params)
    engine.step()  # prefill, then fork into 4 samples that each sampled a first token
    seqs = engine.requests[request_id].sequences()
    assert len(seqs) == 4
    tables = {tuple(s.block_table) for s in seqs}
    assert len(tables) == 1 and len(next(iter(tables))) == 3  # the prompt's blocks are held once
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == 3
    assert engine.block_manager.block_states().count("s") == 3
    engine.step()  # every sample writes its first token into the shared partial block: copy-on-write
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == 2 + 4
    assert len({s.block_table[2] for s in seqs}) == 4 and len({tuple(s.block_table[:2]) for s in seqs}) == 1
    engine.block_manager.check_invariants(engine.live_sequences())
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    samples = [o.token_ids for o in final.outputs]
    assert len({tuple(s) for s in samples}) > 1
    for i, sample in enumerate(samples):
        alone = engine.generate(
            [prompt], SamplingParams(temperature=1.0, seed=500 + i, max_tokens=10, ignore_eos=True)
        )[0]
        assert alone.outputs[0].token_ids == sample, i
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preempted_sequence_finds_its_blocks_again(llama_dir):
    prompts = random_prompts(10, VOCAB, 40, 60, seed=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = make_engine(llama_dir).generate(prompts, params)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4
    small = make_engine(llama_dir, kv_cache_memory=14 * block_bytes, max_model_len=128)
    outs = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert small.scheduler.resumed_hit_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def steps_until_done(engine: LLMEngine, request_ids: set[str], max_steps: int = 5000) -> int:
    remaining = set(request_ids)
    steps = 0
    while remaining:
        assert steps < max_steps, f"requests {sorted(remaining)} still unfinished after {max_steps} steps"
        for out in engine.step():
            if out.finished:
                remaining.discard(out.request_id)
        steps += 1
    return steps


def fairness_run(llama_dir, light_user: str) -> int:
    engine = make_engine(
        llama_dir, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, enable_prefix_caching=False
    )
    heavy = random_prompts(50, VOCAB, 100, 100, seed=30)
    for prompt in heavy:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), user="A")
    for _ in range(3):
        engine.step()
    light = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), user=light_user)
        for p in random_prompts(2, VOCAB, 10, 10, seed=31)
    ]
    return steps_until_done(engine, set(light))


def test_light_user_is_not_starved_by_heavy_user(llama_dir):
    fair_steps = fairness_run(llama_dir, light_user="B")
    fcfs_steps = fairness_run(llama_dir, light_user="A")  # same user: plain FCFS behind 50 long requests
    # B gets seats at once (A is above its fair share of 8 // 2 seats) and half the prefill budget:
    # one step to prefill its 10-token prompts, then 10 decode steps.
    assert fair_steps <= 12
    assert fcfs_steps > 10 * fair_steps


def test_whole_prompts_of_two_users_are_not_starved_without_chunking(llama_dir):
    """Chunked prefill off: two users' prompts each longer than half the budget still run (an even
    split of the budget between the users would fit neither)."""
    engine = make_engine(llama_dir, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=100)
    prompts = random_prompts(4, VOCAB, 55, 60, seed=40)
    ids = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), user=u)
        for p, u in zip(prompts, "ABAB")
    ]
    steps = steps_until_done(engine, set(ids))
    assert steps <= 4 * 4 + 4
    assert all(r.prefill_tokens + r.decode_tokens <= 100 for r in engine.stats.steps)


def test_whole_prompt_is_admitted_while_another_user_keeps_decoding(llama_dir):
    """Chunked prefill off: decodes of user B must not keep user A's long prompt out forever."""
    engine = make_engine(llama_dir, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    short = iter(random_prompts(400, VOCAB, 3, 5, seed=51))
    for _ in range(8):  # B's decodes already take more of the budget than A's prompt leaves room for
        engine.add_request(next(short), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), user="B")
        engine.step()
    assert len(engine.scheduler.running) > 64 - 60
    long_id = engine.add_request(
        random_prompts(1, VOCAB, 60, 60, seed=50)[0],
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        user="A",
    )
    for _step in range(200):
        engine.add_request(next(short), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), user="B")
        if any(out.request_id == long_id and out.finished for out in engine.step()):
            break
    else:
        raise AssertionError("the long prompt never ran")
    assert _step < 10
