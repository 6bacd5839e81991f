"""The grammar engine behind llmctl's structured outputs, driven directly (no model, no server).

The strongest check is the random walk: sample from random logits through the bitmask, accept each
token into the matcher, and require the decoded text to satisfy the constraint. Random logits are
what a noise model produces, so this is "enforced by construction" with nothing else helping.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from structured_schemas import PERSON

from llmctl.errors import InvalidRequestError
from llmctl.models.embedded import embedded_tokenizer
from llmctl.structured import (
    StructuredOutputManager,
    StructuredOutputSpec,
    allocate_bitmask,
    apply_bitmask_,
    unpack_bitmask,
)
from llmctl.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """Byte-level BPE (GPT-2/Llama-3/Qwen style): the embedded model's tokenizer."""
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def byte_fallback(stories_dir) -> Tokenizer:
    """SentencePiece-style BPE with <0xNN> byte-fallback tokens (Llama-2 style): stories260k."""
    return Tokenizer.from_dir(stories_dir)


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    m = StructuredOutputManager.for_tokenizer(tokenizer, vocab_size=tokenizer.vocab_size + 13)
    yield m
    m.shutdown()


def random_walk(
    manager: StructuredOutputManager, tokenizer: Tokenizer, spec: StructuredOutputSpec, seed: int, max_steps: int = 400
) -> tuple[list[int], bool]:
    """Sample uniformly among allowed tokens until EOS or the grammar ends; (tokens, ended)."""
    gen = torch.Generator().manual_seed(seed)
    matcher = manager.new_matcher(spec)
    tokens: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, manager.vocab_size, generator=gen) * 4
        found = manager.bitmask_for([matcher])
        assert found is not None
        apply_bitmask_(logits, found[0])
        token = int(logits.argmax())
        assert logits[0, token] > float("-inf"), "the grammar left no token allowed"
        if token in tokenizer.eos_token_ids:
            return tokens, True
        assert matcher.accept_token(token), matcher.error
        tokens.append(token)
        if matcher.is_terminated:
            return tokens, True
    return tokens, False


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_holds_for_random_logits(manager, tokenizer, seed):
    tokens, ended = random_walk(manager, tokenizer, StructuredOutputSpec.json_schema(PERSON), seed)
    assert ended
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), PERSON)


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_choice_hold_for_random_logits(manager, tokenizer, seed):
    tokens, ended = random_walk(manager, tokenizer, StructuredOutputSpec.regex(r"(ab|[0-9]{2,4})-[xyz]"), seed)
    assert ended and re.fullmatch(r"(ab|[0-9]{2,4})-[xyz]", tokenizer.decode(tokens))
    choices = ["yes", "no", "maybe so", 'with "quotes"']
    tokens, ended = random_walk(manager, tokenizer, StructuredOutputSpec.choice(choices), seed)
    assert ended and tokenizer.decode(tokens) in choices


def test_json_object_gives_an_object(manager, tokenizer):
    matcher = manager.new_matcher(StructuredOutputSpec.json_object())
    ids = tokenizer.encode('{"a": [1, 2]}', add_special_tokens=False)
    if tokenizer.backend.id_to_token(ids[0]) == "\u2581":  # SentencePiece's prefix space: not JSON
        ids = ids[1:]
    accepted = [matcher.accept_token(t) for t in ids]
    assert all(accepted) and matcher.is_terminated
    refused = manager.new_matcher(StructuredOutputSpec.json_object())
    assert not refused.accept_token(tokenizer.encode("[", add_special_tokens=False)[-1])


def test_byte_fallback_tokens_carry_their_byte(byte_fallback):
    """A newline exists only as the byte token <0x0A> in stories260k: the grammar must allow it."""
    manager = StructuredOutputManager.for_tokenizer(byte_fallback)
    matcher = manager.new_matcher(StructuredOutputSpec.regex(r"\n[0-9]"))
    allowed = unpack_bitmask(manager.bitmask_for([matcher])[0], manager.vocab_size)[0]
    newline = byte_fallback.backend.token_to_id("<0x0A>")
    assert allowed.nonzero().flatten().tolist() == [newline]
    assert matcher.accept_token(newline)


def test_byte_level_tokens_carry_their_bytes(byte_level):
    """'Ġ' is a space in byte-level BPE: a regex for ' x' must allow exactly the tokens spelling it."""
    manager = StructuredOutputManager.for_tokenizer(byte_level)
    matcher = manager.new_matcher(StructuredOutputSpec.regex(r" [a-z]+"))
    allowed = unpack_bitmask(manager.bitmask_for([matcher])[0], manager.vocab_size)[0].nonzero().flatten()
    texts = {byte_level.decode([int(t)]) for t in allowed}
    assert texts and all(re.fullmatch(r" [a-z]*", t) for t in texts)
    assert " " in texts and " the" in texts


def test_model_vocab_larger_than_tokenizer(manager, tokenizer):
    """Rows past the tokenizer's vocabulary (padding in the embedding) are never allowed."""
    assert manager.vocab_size == tokenizer.vocab_size + 13
    matcher = manager.new_matcher(StructuredOutputSpec.regex(r"(.|\n)*"))  # anything at all
    allowed = unpack_bitmask(manager.bitmask_for([matcher])[0], manager.vocab_size)[0]
    assert allowed[: tokenizer.vocab_size].any() and not allowed[tokenizer.vocab_size :].any()
    logits = torch.zeros(2, manager.vocab_size + 50)  # even wider than the grammar's bitmask
    apply_bitmask_(logits, manager.bitmask_for([matcher])[0], torch.tensor([1]))
    assert (logits[0] == 0).all()  # an unconstrained row is untouched
    assert torch.isinf(logits[1, tokenizer.vocab_size :]).all()


@pytest.mark.parametrize(
    "spec, problem",
    [
        (lambda: StructuredOutputSpec.json_schema({"type": "sandwich"}), "sandwich"),
        (lambda: StructuredOutputSpec.json_schema({"type": "string", "format": "shoe-size"}), "shoe-size"),
        (lambda: StructuredOutputSpec.json_schema({"type": "object", "if": {"required": ["a"]}}), "if"),
        (lambda: StructuredOutputSpec.json_schema("{not json"), "not valid JSON"),
        (lambda: StructuredOutputSpec.json_schema([1, 2]), "must be an object"),
        (lambda: StructuredOutputSpec.regex("[a-"), "unclosed character class"),
        (lambda: StructuredOutputSpec.choice([]), "non-empty list"),
        (lambda: StructuredOutputSpec.grammar("start: foo"), "foo"),
    ],
)
def test_invalid_specs_name_the_problem(byte_level, spec, problem):
    manager = StructuredOutputManager.for_tokenizer(byte_level)
    with pytest.raises(InvalidRequestError) as info:
        manager.compile(spec())
    message = str(info.value)
    assert problem in message and "\n" not in message
    assert manager.cached_specs() == []  # a failure is not cached


def test_equal_schemas_share_one_cached_grammar(byte_level):
    manager = StructuredOutputManager.for_tokenizer(byte_level, cache_size=2)
    a = StructuredOutputSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputSpec.json_schema('{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a == b and hash(a) == hash(b)
    assert manager.compile(a) is manager.compile(b)
    manager.compile(StructuredOutputSpec.regex("x+"))
    manager.compile(StructuredOutputSpec.regex("y+"))  # evicts the least recently used: the schema
    assert manager.cached_specs() == [StructuredOutputSpec.regex("x+"), StructuredOutputSpec.regex("y+")]


def test_compilation_runs_off_the_calling_thread(byte_level):
    """The engine loop only waits on a future; the work happens on the manager's pool, once."""

    class RecordingBackend:
        def __init__(self, inner):
            self.inner, self.threads, self.release = inner, [], threading.Event()

        vocab_size = property(lambda self: self.inner.vocab_size)

        def compile(self, spec):
            self.threads.append(threading.current_thread().name)
            self.release.wait(5)
            return self.inner.compile(spec)

        def fill_bitmasks(self, matchers, bitmask):
            self.inner.fill_bitmasks(matchers, bitmask)

    backend = RecordingBackend(StructuredOutputManager.for_tokenizer(byte_level).backend)
    manager = StructuredOutputManager(backend)
    spec = StructuredOutputSpec.json_schema(PERSON)
    first, second = manager.compile_async(spec), manager.compile_async(spec)
    assert first is second and not first.done()  # not compiled on this thread, not twice
    backend.release.set()
    assert first.result(5) is not None
    assert len(backend.threads) == 1 and backend.threads[0].startswith("llmctl-grammar")


def test_matchers_are_independent_and_roll_back(manager, tokenizer):
    spec = StructuredOutputSpec.choice(["alpha", "beta"])
    first, second = manager.new_matcher(spec), manager.new_matcher(spec)
    start_mask = manager.bitmask_for([first])[0].clone()
    token = int(unpack_bitmask(start_mask, manager.vocab_size)[0].nonzero()[0])
    assert first.accept_token(token)
    both = manager.bitmask_for([first, None, second])
    assert both[1] == [0, 2]
    assert not torch.equal(both[0][0], start_mask[0]) and torch.equal(both[0][1], start_mask[0])
    twin = first.copy()
    first.rollback(1)
    assert torch.equal(manager.bitmask_for([first])[0], start_mask)
    assert torch.equal(manager.bitmask_for([twin])[0][0], both[0][0])  # the copy kept its state


def test_no_constrained_rows_means_no_bitmask(manager):
    assert manager.bitmask_for([None, None]) is None


def test_unpack_matches_bit_arithmetic():
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 40), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    expected = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(5, -1)[:, :1250]
    assert torch.equal(unpack_bitmask(bitmask, 1250), expected)
    assert allocate_bitmask(3, 33).shape == (3, 2)


def test_request_fields_map_to_one_spec():
    from llmctl.structured.request import spec_from_request

    schema = {"type": "object"}
    assert spec_from_request() is None
    assert spec_from_request(response_format={"type": "text"}) is None
    assert spec_from_request(response_format={"type": "json_object"}) == StructuredOutputSpec.json_object()
    assert spec_from_request(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    ) == StructuredOutputSpec.json_schema(schema)
    assert spec_from_request(guided_json='{"type": "object"}') == StructuredOutputSpec.json_schema(schema)
    assert spec_from_request(guided_choice=["a", "b"]) == StructuredOutputSpec.choice(["a", "b"])
    assert spec_from_request(
        structured_outputs={"regex": "a+", "disable_fallback": True}
    ) == StructuredOutputSpec.regex("a+")
    assert spec_from_request(structured_outputs={"json_object": True}) == StructuredOutputSpec.json_object()
    with pytest.raises(InvalidRequestError, match="one output constraint; got response_format, guided_regex"):
        spec_from_request(response_format={"type": "json_object"}, guided_regex="a")
    with pytest.raises(InvalidRequestError, match="json_schema.schema"):
        spec_from_request(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(InvalidRequestError, match="'yaml' is not supported"):
        spec_from_request(response_format={"type": "yaml"})
    with pytest.raises(InvalidRequestError, match="structural_tag is not supported"):
        spec_from_request(structured_outputs={"structural_tag": "{}"})
    with pytest.raises(InvalidRequestError, match="takes one constraint"):
        spec_from_request(structured_outputs={"regex": "a", "choice": ["b"]})
