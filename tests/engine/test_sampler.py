"""Sampler arithmetic: filters, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import torch

from llmctl.engine.sampler import Sampler, _top_k_top_p
from llmctl.engine.sequence import Sequence
from llmctl.sampling_params import SamplingParams


def seq(params: SamplingParams, seed: int | None = None) -> Sequence:
    s = Sequence(request_id="r", token_ids=[1], num_prompt_tokens=1, params=params)
    if seed is not None:
        s.generator = torch.Generator().manual_seed(seed)
    return s


def test_greedy_takes_argmax_and_reports_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]])
    result = Sampler()(logits, [seq(SamplingParams(temperature=0, logprobs=2))])
    assert result.token_ids == [1]
    expected = torch.log_softmax(logits, -1)[0]
    assert math.isclose(result.logprobs[0], expected[1].item(), rel_tol=1e-6)
    assert list(result.top_logprobs[0]) == [1, 2]


def test_top_k_keeps_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = _top_k_top_p(logits, [2], [1.0])
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = _top_k_top_p(probs.log(), [0], [0.8])
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    out = _top_k_top_p(probs.log(), [0], [0.81])
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]
    out = _top_k_top_p(probs.log(), [0], [0.01])  # the top token always stays
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)]])
    sampler = Sampler(seed=0)
    s = seq(SamplingParams(temperature=1.0))
    counts = torch.zeros(3)
    for _ in range(4000):
        counts[sampler(logits, [s]).token_ids[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)
    alone = [Sampler()(logits[i : i + 1], [seq(params, seed=i)]).token_ids[0] for i in range(5)]
    batch = Sampler()(logits, [seq(params, seed=i) for i in range(5)]).token_ids
    assert batch == alone


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = Sampler._probabilities(logits, [seq(SamplingParams(temperature=0.1))])
    warm = Sampler._probabilities(logits, [seq(SamplingParams(temperature=2.0))])
    assert cold[0, 0] > 0.99 and warm[0, 0] < 0.6
