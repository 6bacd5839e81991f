"""Penalties, logit_bias, min_tokens and min_p against straightforward per-token reference code
(vLLM's definitions) on fixed logits, and batched == each row alone."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from llmctl.engine.logits_processors import (
    apply_frequency_presence_penalties_,
    apply_logit_bias_,
    apply_logits_processors_,
    apply_min_p_,
    apply_min_p_rows_,
    apply_repetition_penalty_,
    token_counts,
)

VOCAB = 12
EOS = {2}


def fixed_logits(rows: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 5] = 0.0  # a zero logit: neither divided nor multiplied into something else
    return logits


def reference(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    *,
    repetition=1.0,
    presence=0.0,
    frequency=0.0,
    logit_bias=None,
    min_tokens=0,
    stop_token_ids=(),
    ignore_eos=False,
    allowed_token_ids=None,
    bad_words_token_ids=(),
) -> list[float]:
    """One row, one token at a time, exactly as vLLM documents the formulas."""
    out = list(logits)
    counts = Counter(output)
    if allowed_token_ids is not None:
        out = [v if t in allowed_token_ids else float("-inf") for t, v in enumerate(out)]
    for word in bad_words_token_ids:  # banned where the output ends with the word's other tokens
        *prefix, last = word
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            out[last] = float("-inf")
    if len(output) < min_tokens:
        for t in set(stop_token_ids) | (set() if ignore_eos else EOS):
            out[t] = float("-inf")
    for t, b in (logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        out[t] -= frequency * counts[t] + presence * (counts[t] > 0)
    return out


def seq(prompt, output, **params):
    defaults = dict(
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logit_bias=None,
        min_tokens=0,
        stop_token_ids=[],
        ignore_eos=False,
        allowed_token_ids=None,
        bad_words_token_ids=[],
    )
    defaults.update(params)
    p = SimpleNamespace(**defaults)
    p.has_penalties = p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
    return SimpleNamespace(
        token_ids=prompt + output,
        num_prompt_tokens=len(prompt),
        output_token_ids=output,
        num_output_tokens=len(output),
        params=p,
        grammar=None,
    )


ROWS = [
    (([1, 3, 3], [4, 4, 4, 7]), dict(repetition_penalty=1.3)),
    (([0, 5, 9], [9, 6, 6]), dict(repetition_penalty=0.7, presence_penalty=0.5, frequency_penalty=0.25)),
    (([1], [8, 8, 8, 8, 3]), dict(presence_penalty=-1.0, frequency_penalty=-0.5)),
    (([6, 6], []), dict(logit_bias={3: 5.0, 11: -100.0, 0: 0.5})),
    (([7], [1]), dict(min_tokens=3, stop_token_ids=[10])),
    (([7], [1, 1, 1]), dict(min_tokens=3, stop_token_ids=[10])),  # reached: nothing masked
    (([7], []), dict(min_tokens=2, ignore_eos=True, stop_token_ids=[4])),
    (([9, 9], [10]), {}),  # asks for nothing: untouched
    (([1, 2], [5, 5, 0]), dict(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={5: 1.0}, min_tokens=9)),
    (([3], [4, 4]), dict(allowed_token_ids=[0, 4, 9], logit_bias={9: 2.0})),
    # one-token words always; [4, 6, 8] only after ... 4, 6; [6, 1] not after 4; [2, 7, 3] longer than the output
    (([3], [6, 4, 6]), dict(bad_words_token_ids=[[11], [4, 6, 8], [6, 1], [2, 7, 3, 10]])),
    (([3], []), dict(bad_words_token_ids=[[0], [5, 2]], repetition_penalty=1.5)),
]


def test_batch_matches_the_reference_row_by_row():
    logits = fixed_logits(len(ROWS))
    seqs = [seq(list(p), list(o), **params) for (p, o), params in ROWS]
    expected = [
        reference(
            logits[i].tolist(),
            list(p),
            list(o),
            repetition=params.get("repetition_penalty", 1.0),
            presence=params.get("presence_penalty", 0.0),
            frequency=params.get("frequency_penalty", 0.0),
            logit_bias=params.get("logit_bias"),
            min_tokens=params.get("min_tokens", 0),
            stop_token_ids=params.get("stop_token_ids", ()),
            ignore_eos=params.get("ignore_eos", False),
            allowed_token_ids=params.get("allowed_token_ids"),
            bad_words_token_ids=params.get("bad_words_token_ids", ()),
        )
        for i, ((p, o), params) in enumerate(ROWS)
    ]
    apply_logits_processors_(logits, seqs, EOS)
    torch.testing.assert_close(logits, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert torch.equal(logits[7], fixed_logits(len(ROWS))[7])


def test_batched_equals_alone():
    seqs = [seq(list(p), list(o), **params) for (p, o), params in ROWS]
    batched = fixed_logits(len(ROWS))
    apply_logits_processors_(batched, seqs, EOS)
    for i, s in enumerate(seqs):
        alone = fixed_logits(len(ROWS))[i : i + 1].clone()
        apply_logits_processors_(alone, [s], EOS)
        assert torch.equal(alone[0], batched[i]), i


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 0.0, 3.0]])
    seen = torch.tensor([[True, True, True, False]])
    apply_repetition_penalty_(logits, seen, torch.tensor([2.0]))
    assert logits.tolist() == [[1.0, -4.0, 0.0, 3.0]]


def test_frequency_and_presence_count_output_tokens():
    counts = token_counts([[1, 1, 1, 3], []], 4)
    assert counts.tolist() == [[0, 3, 0, 1], [0, 0, 0, 0]]
    logits = torch.zeros(2, 4)
    apply_frequency_presence_penalties_(logits, counts, torch.tensor([0.5, 0.5]), torch.tensor([1.0, 1.0]))
    assert logits.tolist() == [[0, -2.5, 0, -1.5], [0, 0, 0, 0]]


def test_logit_bias_accumulates_sparse_entries():
    logits = torch.zeros(2, 3)
    apply_logit_bias_(logits, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 2]), torch.tensor([1.5, -3.0, 100.0]))
    assert logits.tolist() == [[0, 0, 1.5], [-3, 0, 100]]


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_keeps_tokens_within_a_fraction_of_the_top(min_p):
    logits = fixed_logits(3, seed=1)
    probs = torch.softmax(logits, dim=-1)
    expected = torch.where(probs >= min_p * probs.max(dim=-1, keepdim=True).values, logits, float("-inf"))
    apply_min_p_(logits, torch.full((3,), min_p))
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits).any(dim=-1).all()  # the top token always survives


def test_min_p_rows_leaves_other_rows_alone():
    logits, original = fixed_logits(3, seed=2), fixed_logits(3, seed=2)
    apply_min_p_rows_(logits, [0.0, 0.5, 0.0])
    assert torch.equal(logits[[0, 2]], original[[0, 2]])
    assert torch.isinf(logits[1]).any() and not torch.equal(logits[1], original[1])


def test_bad_words_are_tokenized_as_vllm_does():
    from llmctl.engine.logits_processors import bad_words_token_ids
    from llmctl.models.embedded import embedded_tokenizer

    tokenizer = embedded_tokenizer()

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    banned = bad_words_token_ids(encode, ["engine", "  pages"])
    assert encode("engine") in banned and encode("pages") in banned  # leading spaces stripped first
    for word in ("engine", "pages"):  # the in-sentence form, where it is other tokens of the same count
        alone, spaced = encode(word), encode(" " + word)
        assert (spaced in banned) == (spaced[0] != alone[0] and len(spaced) == len(alone))
    assert len(banned) == 2 + sum(
        len(encode(" " + w)) == len(encode(w)) and encode(" " + w)[0] != encode(w)[0] for w in ("engine", "pages")
    )
