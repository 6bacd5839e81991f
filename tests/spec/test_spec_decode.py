"""Speculative decoding (llmctl/spec/): greedy output identical to decoding without it, token for
token (n-gram drafts and draft models, batched and alone, through preemption, stops and limits in
the middle of an accepted run), the rejection sampler's distribution, and every block returned.

A random model drafting for itself accepts every draft (the exact path where several tokens land in
one step); a different random model accepts almost none (the rejection path).
"""

from __future__ import annotations

import pytest
import torch
from model_factory import make_hf_model, random_prompts

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import ConfigError
from llmctl.sampling_params import SamplingParams
from llmctl.server.metrics import ServerMetrics
from llmctl.spec.ngram import propose_ngram
from llmctl.spec.rejection import accept_sampled
from llmctl.structured import StructuredOutputSpec
from llmctl.tui.panels import spec_decode_text

VOCAB = 320


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("draft") / "llama", seed=11)


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(model=str(model_dir), skip_tokenizer=True, dtype="float32", **kw)


def run_checked(engine: LLMEngine, prompts, params) -> list[list[int]]:
    """Generate step by step, checking the block invariants after every step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [done[i] for i in ids]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- n-gram proposals --------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert propose_ngram(tokens, 3, 2, 4) == [5, 6, 7]  # "1 2 3" last followed by 5 6 7
    assert propose_ngram(tokens, 10, 2, 4) == [5, 6, 7, 1, 2, 3]  # stops at the end of the sequence
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([7, 8, 7], 2, 1, 3) == [8, 7]  # n = 1 when allowed ...
    assert propose_ngram([7, 8, 7], 2, 2, 3) == []  # ... and not below --ngram-prompt-lookup-min
    assert propose_ngram([5, 5, 5, 5], 2, 2, 2) == [5]  # the match may overlap the suffix


# ---- greedy equivalence ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts():
    loops = [[5, 6, 7, 8, 9, 10, 11] * 4, [40, 41, 42, 43] * 3, [60, 61] * 9]
    shared = [
        [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19] + p for p in random_prompts(3, VOCAB, 2, 20, 1)
    ]
    return loops + shared + random_prompts(4, VOCAB, 2, 40, seed=3)


@pytest.fixture(scope="module")
def baseline(llama_dir, prompts):
    return make_engine(llama_dir).generate(prompts, greedy())


@pytest.mark.parametrize("draft", ["ngram", "self", "other"])
def test_greedy_output_is_unchanged(llama_dir, other_llama, prompts, baseline, draft):
    model = {"ngram": "ngram", "self": str(llama_dir), "other": str(other_llama)}[draft]
    engine = make_engine(llama_dir, speculative_model=model, num_speculative_tokens=3, ngram_prompt_lookup_min=1)
    together = run_checked(engine, prompts, greedy())
    assert together == [o.outputs[0].token_ids for o in baseline]
    counters = engine.speculator.counters
    assert counters.num_drafted > 0
    if draft == "self":
        assert counters.num_accepted == counters.num_drafted  # a model agrees with itself
    if draft == "other":
        assert counters.acceptance_rate < 0.2
    alone = [
        make_engine(llama_dir, speculative_model=model, num_speculative_tokens=3).generate([p], greedy())[0]
        for p in prompts[:3]
    ]
    assert [o.outputs[0].token_ids for o in alone] == together[:3]


def test_logprobs_penalties_and_min_tokens_with_several_tokens_a_step(llama_dir, prompts, baseline):
    looped = baseline[0].outputs[0].token_ids  # banning a pair it generates changes it from there on
    params = [
        greedy(logprobs=2),
        greedy(repetition_penalty=1.3),
        greedy(frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=12, stop_token_ids=[7, 8, 9, 10, 40, 41]),
        greedy(logit_bias={50: 3.0}),
        greedy(allowed_token_ids=list(range(40, 90))),
        greedy(bad_words_token_ids=[looped[3:5], [looped[8]]]),
    ]
    prompts = [prompts[i] for i in (1, 2, 3, 4, 5, 6, 0)]  # the banned pair's own prompt last
    expected = make_engine(llama_dir).generate(prompts[: len(params)], params)
    assert expected[-1].outputs[0].token_ids[:4] == looped[:4] and expected[-1].outputs[0].token_ids != looped
    assert set(expected[5].outputs[0].token_ids) <= set(range(40, 90))
    engine = make_engine(llama_dir, speculative_model=str(llama_dir), num_speculative_tokens=4)
    got = engine.generate(prompts[: len(params)], params)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert got[0].outputs[0].top_logprobs[5].keys() == expected[0].outputs[0].top_logprobs[5].keys()
    assert got[0].outputs[0].logprobs == pytest.approx(expected[0].outputs[0].logprobs, abs=1e-4)
    assert engine.speculator.counters.num_accepted > 20


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 9])
def test_max_tokens_and_stop_ids_inside_an_accepted_run(llama_dir, prompts, baseline, max_tokens):
    engine = make_engine(llama_dir, speculative_model=str(llama_dir), num_speculative_tokens=4)
    out = run_checked(engine, prompts[:2], greedy(max_tokens))
    assert out == [o.outputs[0].token_ids[:max_tokens] for o in baseline[:2]]
    # a stop token id generated at position max_tokens - 1 ends the output right there
    stop = baseline[3].outputs[0].token_ids[max_tokens - 1]
    want = make_engine(llama_dir).generate([prompts[3]], greedy(stop_token_ids=[stop]))[0].outputs[0]
    got = engine.generate([prompts[3]], greedy(stop_token_ids=[stop]))[0].outputs[0]
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (want.token_ids, "stop", stop)


def test_stop_strings_inside_an_accepted_run(stories_dir):
    prompt, params = "Once upon a time", SamplingParams(temperature=0, max_tokens=60)
    text = LLMEngine(model=str(stories_dir), dtype="float32").generate([prompt], params)[0].outputs[0].text
    stops = [text[30:36], text[47:50]]
    for include in (False, True):
        stop_params = SamplingParams(temperature=0, max_tokens=60, stop=stops, include_stop_str_in_output=include)
        want = LLMEngine(model=str(stories_dir), dtype="float32").generate([prompt], stop_params)[0].outputs[0]
        engine = LLMEngine(
            model=str(stories_dir), dtype="float32", speculative_model=str(stories_dir), num_speculative_tokens=5
        )
        request_id = engine.add_request(prompt, stop_params)
        seq = engine.requests[request_id].sequences()[0]
        while engine.has_unfinished():
            (out,) = engine.step()
        got = out.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text,
            want.token_ids,
            "stop",
            stops[0],
        )
        # the tokens drafted past the stop string were dropped from the sequence, not only from the output
        assert seq.output_token_ids == got.token_ids
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_tiny_pool_preempts_with_speculation_and_matches(llama_dir):
    prompts = random_prompts(10, VOCAB, 30, 60, seed=5)
    expected = make_engine(llama_dir).generate(prompts, greedy(20))
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4
    for model in ("ngram", str(llama_dir)):
        small = make_engine(
            llama_dir,
            kv_cache_memory=16 * block_bytes,
            max_model_len=128,
            speculative_model=model,
            ngram_prompt_lookup_min=1,
        )
        assert run_checked(small, prompts, greedy(20)) == [o.outputs[0].token_ids for o in expected]
        assert small.scheduler.num_preemptions > 0


def test_sampling_with_speculation_finishes_and_returns_every_block(llama_dir, other_llama):
    prompts = random_prompts(4, VOCAB, 5, 30, seed=8) + [[60, 61] * 9]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True) for i in range(5)]
    for model in (str(llama_dir), str(other_llama), "ngram"):
        engine = make_engine(llama_dir, speculative_model=model, ngram_prompt_lookup_min=1)
        out = run_checked(engine, prompts, params)
        assert [len(t) for t in out] == [12] * 5
        assert engine.speculator.counters.num_drafted > 0
    again = make_engine(llama_dir, speculative_model="ngram", ngram_prompt_lookup_min=1).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == out  # seeded: reproducible


def test_abort_while_speculating_returns_every_block(llama_dir, prompts):
    engine = make_engine(llama_dir, speculative_model=str(llama_dir))
    ids = [engine.add_request(p, greedy(40)) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.speculator.counters.num_drafted > 0
    for request_id in ids[::2]:
        assert engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
        engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_structured_requests_do_not_speculate(stories_dir):
    spec = StructuredOutputSpec.choice(["Lily", "Tom", "the big dog"])
    params = [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec),
        SamplingParams(temperature=0, max_tokens=40),
    ]
    prompts = ["Once upon a time", "Once upon a time"]
    want = LLMEngine(model=str(stories_dir), dtype="float32").generate(prompts, params)
    engine = LLMEngine(model=str(stories_dir), dtype="float32", speculative_model=str(stories_dir))
    got = engine.generate(prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert got[0].outputs[0].text in ("Lily", "Tom", "the big dog")
    counters = engine.speculator.counters
    assert 0 < counters.num_verifies <= 39  # only the free request verified drafts


def test_a_draft_model_with_another_vocabulary_is_refused(llama_dir, tmp_path):
    other = make_hf_model("llama", tmp_path / "small_vocab", vocab_size=300)
    with pytest.raises(ConfigError, match="vocabulary"):
        make_engine(llama_dir, speculative_model=str(other))


def test_speculation_shows_in_counters_and_snapshot(llama_dir, prompts):
    engine = make_engine(llama_dir, speculative_model=str(llama_dir), num_speculative_tokens=2)
    engine.generate(prompts[:2], greedy(10))
    counters = engine.counters()
    assert counters.spec_num_draft_tokens == counters.spec_num_accepted_tokens > 0
    section = engine.stats_snapshot()["spec_decode"]
    assert section["acceptance_rate"] == 1.0 and section["mean_accepted_length"] == 3.0
    assert make_engine(llama_dir).stats_snapshot()["spec_decode"] is None
    exposition = ServerMetrics(AsyncEngine(engine), "m").exposition().decode()
    drafted = counters.spec_num_draft_tokens
    assert f'llmctl:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(drafted)}' in exposition
    assert "100.0% accepted, 3.00 tok/verify" in spec_decode_text(section).plain


# ---- the rejection sampler ---------------------------------------------------------------------
def _first_tokens(
    target: torch.Tensor, draft: torch.Tensor | None, k: int, trials: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Histograms of the first and second emitted tokens over ``trials`` verifications of k drafts
    drawn from ``draft`` (one-hot on token 0 when None)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.shape[1]
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(trials):
        if draft is None:
            drafts = [0] * k
        else:
            drafts = torch.multinomial(draft[:k], 1, generator=gen).squeeze(1).tolist()
        out = accept_sampled(drafts, target, None if draft is None else draft[:k], gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first / first.sum(), second / second.sum()


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-model", "ngram"])
def test_rejection_sampling_keeps_the_target_distribution(one_hot):
    target = torch.tensor([[0.10, 0.45, 0.05, 0.30, 0.10], [0.50, 0.05, 0.15, 0.10, 0.20], [0.2, 0.2, 0.2, 0.2, 0.2]])
    draft = None if one_hot else torch.tensor([[0.60, 0.05, 0.25, 0.05, 0.05], [0.05, 0.55, 0.10, 0.20, 0.10]])
    first, second = _first_tokens(target, draft, k=2, trials=20000, seed=0)
    # 20000 draws: a cell's standard error is <= 0.0036, so 0.02 is over 5 sigma; the draft's own
    # law is >= 0.45 away in total variation, so a sampler that just kept the drafts cannot pass.
    assert (first - target[0]).abs().max() < 0.02, first
    assert (second - target[1]).abs().max() < 0.025, second  # given the first draft was kept
    wrong = torch.tensor([1.0, 0, 0, 0, 0]) if one_hot else draft[0]
    assert (wrong - target[0]).abs().sum() / 2 > 0.45


def test_bench_reports_the_acceptance_rate(llama_dir):
    import asyncio

    from llmctl.bench.datasets import BenchRequest
    from llmctl.bench.metrics import summarize
    from llmctl.bench.report import BenchReport, _rows, report_dict
    from llmctl.bench.runner import InProcessTarget, run_load

    engine = make_engine(llama_dir, speculative_model=str(llama_dir), num_speculative_tokens=3)
    requests = [BenchRequest(p, len(p), 9) for p in random_prompts(3, VOCAB, 4, 12, seed=2)]

    async def run():
        async_engine = AsyncEngine(engine).start()
        try:
            return await run_load(InProcessTarget(async_engine, ignore_eos=True), requests, concurrency=3)
        finally:
            async_engine.shutdown()

    result = asyncio.run(run())
    assert summarize(result.records).output_tokens == 27
    stats = result.engine_stats
    assert stats.spec_acceptance_rate == 1.0 and stats.spec_mean_accepted_length == 4.0  # 1 + 3 drafts a step
    report = BenchReport("llmctl", summarize(result.records), stats)
    assert report_dict([report], {})["result"]["engine"]["spec_acceptance_rate"] == 1.0
    rows = {row.label: row.values for row in _rows([report]) if row is not None}
    assert rows["Spec. decode acceptance (%)"] == [100.0] and rows["Spec. decode tokens per verify"] == [4.0]
