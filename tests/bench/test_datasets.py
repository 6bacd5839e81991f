"""Workloads: lengths as asked, reproducible from the seed, users sharing prefixes, ShareGPT parsing."""

from __future__ import annotations

import json

import pytest

from llmctl.bench.datasets import (
    DatasetError,
    PromptFactory,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from llmctl.models.embedded import embedded_tokenizer
from llmctl.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return embedded_tokenizer()


def test_random_lengths_stay_within_the_range_ratio(tokenizer):
    factory = PromptFactory(tokenizer)
    requests = random_requests(factory, 200, input_len=100, output_len=40, range_ratio=0.25, seed=3)
    assert len(requests) == 200
    in_lens = [r.prompt_len for r in requests]
    out_lens = [r.output_len for r in requests]
    assert min(in_lens) >= 75 and max(in_lens) <= 125
    assert min(out_lens) >= 30 and max(out_lens) <= 50
    assert len(set(in_lens)) > 20  # actually spread out, not one value
    for r in requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert not set(r.prompt) & tokenizer.eos_token_ids and 0 not in r.prompt  # no BOS/EOS/special ids
    fixed = random_requests(factory, 10, input_len=16, output_len=8, range_ratio=0.0, seed=3)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(16, 8)}


def test_random_is_reproducible_from_the_seed(tokenizer):
    factory = PromptFactory(tokenizer)
    first = random_requests(factory, 20, 32, 16, 0.5, seed=11)
    again = random_requests(PromptFactory(tokenizer), 20, 32, 16, 0.5, seed=11)
    other = random_requests(factory, 20, 32, 16, 0.5, seed=12)
    assert first == again
    assert first != other


def test_text_prompts_encode_to_the_asked_length(tokenizer):
    factory = PromptFactory(tokenizer, as_text=True)
    requests = random_requests(factory, 40, input_len=64, output_len=8, range_ratio=0.5, seed=0)
    for r in requests:
        assert isinstance(r.prompt, str) and r.prompt.isprintable()
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len
    assert all(32 <= r.prompt_len <= 96 for r in requests)


def test_text_prompts_for_a_sentencepiece_tokenizer(stories_dir):
    tok = Tokenizer.from_dir(stories_dir)
    requests = random_requests(PromptFactory(tok, as_text=True), 10, 50, 4, 0.0, seed=5)
    assert [len(tok.encode(r.prompt)) for r in requests] == [r.prompt_len for r in requests] == [50] * 10


@pytest.mark.parametrize("as_text", [False, True])
def test_shared_prefix_users_share_their_system_prompt(tokenizer, as_text):
    factory = PromptFactory(tokenizer, as_text=as_text)
    requests = shared_prefix_requests(
        factory, 12, num_users=3, prefix_len=48, input_len=16, output_len=8, range_ratio=0.0, seed=1
    )
    assert [r.user for r in requests[:4]] == ["user-0", "user-1", "user-2", "user-0"]
    ids = [tokenizer.encode(r.prompt) if as_text else r.prompt for r in requests]
    by_user: dict[str, list[list[int]]] = {}
    for r, prompt in zip(requests, ids):
        by_user.setdefault(r.user, []).append(prompt)
        assert len(prompt) == r.prompt_len
        assert abs(r.prompt_len - (48 + 16 + (1 if as_text else 0))) <= 1  # text adds the BOS
    heads = {}
    for user, prompts in by_user.items():
        assert len(prompts) == 4
        head = prompts[0][:40]
        assert all(p[:40] == head for p in prompts)  # one system prompt per user
        assert len({tuple(p) for p in prompts}) == 4  # different questions
        heads[user] = tuple(head)
    assert len(set(heads.values())) == 3  # users do not share each other's prefix


def test_sharegpt_parsing_and_filters(tmp_path, tokenizer):
    long_reply = "the engine wrote a long story about dragons and trains " * 4
    data = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me a story about the moon and a river"},
                {"from": "gpt", "value": long_reply},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_reply}]},  # short prompt
        {
            "conversations": [
                {"from": "gpt", "value": "I start"},
                {"from": "human", "value": "Who asked you?"},
                {"from": "gpt", "value": "Nobody asked me, but the engine likes questions"},
            ]
        },
        {"conversations": [{"from": "human", "value": "A question with no answer at all"}]},  # no reply
        {"id": "no conversations"},
        {
            "conversations": [{"from": "human", "value": "Short answer please, engine"}, {"from": "gpt", "value": "ok"}]
        },  # reply under 4 tokens
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_requests(path, tokenizer, num_prompts=10, seed=0)
    prompts = sorted(r.prompt for r in requests)
    assert prompts == ["Tell me a story about the moon and a river", "Who asked you?"]
    for r in requests:
        assert r.prompt_len == len(tokenizer.encode(r.prompt))
    story = next(r for r in requests if r.prompt.startswith("Tell"))
    assert story.output_len == len(tokenizer.encode(long_reply, add_special_tokens=False))
    assert len(sharegpt_requests(path, tokenizer, num_prompts=1, seed=0)) == 1
    fixed = sharegpt_requests(path, tokenizer, num_prompts=10, seed=0, output_len=7)
    assert {r.output_len for r in fixed} == {7} and len(fixed) == 3  # "ok" no longer filtered: its length is set
    tight = sharegpt_requests(path, tokenizer, num_prompts=10, seed=0, max_model_len=30)
    assert all(r.prompt_len + r.output_len <= 30 for r in tight)


def test_sharegpt_bad_files(tmp_path, tokenizer):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DatasetError, match="cannot read"):
        sharegpt_requests(bad, tokenizer, 5, 0)
    bad.write_text(json.dumps({"conversations": []}))
    with pytest.raises(DatasetError, match="JSON list"):
        sharegpt_requests(bad, tokenizer, 5, 0)
    bad.write_text(json.dumps([{"conversations": [{"from": "human", "value": "x"}]}]))
    with pytest.raises(DatasetError, match="no usable"):
        sharegpt_requests(bad, tokenizer, 5, 0)
    with pytest.raises(DatasetError, match="range-ratio"):
        random_requests(PromptFactory(tokenizer), 1, 8, 8, 1.0, 0)
