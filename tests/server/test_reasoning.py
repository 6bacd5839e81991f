"""Reasoning output through the ``openai`` client against real ``llmctl serve`` processes: the think
block split on its token ids into ``reasoning_content``, streamed and not, with ``deepseek_r1`` and
``qwen3`` (picked by ``auto``), thinking turned off, structured output after the block; and the
parser, the split and the grammar gate in process."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import reasoning_model
import torch

from llmctl.errors import ConfigError
from llmctl.reasoning import ReasoningParser, resolve_parser
from llmctl.structured.gate import GatedGrammar, ReasoningGate

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> dict:
    return reasoning_model.build(tmp_path_factory.mktemp("thinker") / "model")


def _serve(start_server, thinker, parser):
    return start_server(
        thinker["dir"], "--reasoning-parser", parser, "--max-model-len", "256", "--kv-cache-memory", "16MiB"
    )


@pytest.fixture(scope="module")
def servers(start_server, thinker) -> dict:
    return {"qwen3": _serve(start_server, thinker, "auto"), "deepseek_r1": _serve(start_server, thinker, "deepseek_r1")}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def text(thinker, key) -> str:
    return thinker["tokenizer"].decode(thinker[key])


def chat(server, content, stream=False, **extra):
    return client(server).chat.completions.create(
        model=client(server).models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_completion_tokens=extra.pop("max_tokens", 64),
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        extra_body=extra or None,
    )


def joined(chunks) -> tuple[str | None, str | None, list, object]:
    """(reasoning, content) joined over a stream's chunks; the chunks with a delta; the usage."""
    reasoning, content, deltas, usage = None, None, [], None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None)
            if piece:
                reasoning = (reasoning or "") + piece
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            deltas.append((piece, choice.delta.content, choice.finish_reason))
    return reasoning, content, deltas, usage


# ---- servers ------------------------------------------------------------------------------------


def test_auto_picks_qwen3_from_the_template_and_says_so(servers, thinker):
    assert "reasoning parser: qwen3" in " ".join(servers["qwen3"].log().split())
    assert "reasoning parser: deepseek_r1" in " ".join(servers["deepseek_r1"].log().split())


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_think_block_is_split_on_its_token_ids(servers, thinker, parser):
    answer = chat(servers[parser], "alpha")
    message = answer.choices[0].message
    assert message.reasoning_content == text(thinker, "reasoning")
    assert message.content == text(thinker, "answer")
    assert answer.choices[0].finish_reason == "stop"
    # <think>, the reasoning tokens, </think>
    assert answer.usage.completion_tokens_details.reasoning_tokens == len(thinker["reasoning"]) + 2
    assert answer.usage.completion_tokens == len(thinker["reasoning"]) + len(thinker["answer"]) + 3


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_streamed_split_equals_the_whole_one_and_spans_chunks(servers, thinker, parser):
    reasoning, content, deltas, usage = joined(chat(servers[parser], "alpha", stream=True))
    assert (reasoning, content) == (text(thinker, "reasoning"), text(thinker, "answer"))
    thought_chunks = [i for i, (r, _, _) in enumerate(deltas) if r]
    answer_chunks = [i for i, (_, c, _) in enumerate(deltas) if c]
    assert len(thought_chunks) >= 3  # the block came over several chunks, one per token
    assert max(thought_chunks) < min(answer_chunks)
    assert not any(r and c for r, c, _ in deltas)
    assert usage.completion_tokens_details.reasoning_tokens == len(thinker["reasoning"]) + 2


def test_deepseek_r1_reads_reasoning_without_a_start_tag_qwen3_does_not(servers, thinker):
    r1 = chat(servers["deepseek_r1"], "omega").choices[0].message
    assert (r1.reasoning_content, r1.content) == (text(thinker, "reasoning"), text(thinker, "answer"))
    q3 = chat(servers["qwen3"], "omega")
    assert q3.choices[0].message.reasoning_content is None
    assert q3.choices[0].message.content == text(thinker, "reasoning") + text(thinker, "answer")
    assert q3.usage.completion_tokens_details.reasoning_tokens == 0
    streamed = joined(chat(servers["qwen3"], "omega", stream=True))
    assert streamed[:2] == (None, q3.choices[0].message.content)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_start_tag_in_the_prompt_opens_the_block(servers, thinker, parser):
    """DeepSeek-R1 style: the template writes <think>; the model starts inside the block."""
    message = chat(servers[parser], "hello", chat_template_kwargs={"open_think": True}).choices[0].message
    assert (message.reasoning_content, message.content) == (text(thinker, "reasoning"), text(thinker, "answer"))


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("stream", [False, True])
def test_no_end_tag_is_all_reasoning_and_null_content(servers, thinker, parser, stream):
    cut = 3  # <think> and the first two reasoning tokens
    answer = chat(servers[parser], "alpha", stream=stream, max_tokens=cut)
    expected = thinker["tokenizer"].decode(thinker["reasoning"][: cut - 1])
    if stream:
        reasoning, content, deltas, usage = joined(answer)
        assert deltas[-1][2] == "length"
    else:
        message, usage = answer.choices[0].message, answer.usage
        reasoning, content = message.reasoning_content, message.content
        assert answer.choices[0].finish_reason == "length"
    assert (reasoning, content) == (expected, None)
    assert usage.completion_tokens_details.reasoning_tokens == cut


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("stream", [False, True])
def test_enable_thinking_false_answers_without_reasoning(servers, thinker, parser, stream):
    answer = chat(servers[parser], "alpha", stream=stream, chat_template_kwargs={"enable_thinking": False})
    if stream:
        reasoning, content, _, _ = joined(answer)
    else:
        reasoning, content = answer.choices[0].message.reasoning_content, answer.choices[0].message.content
    assert (reasoning, content) == (None, text(thinker, "answer"))


def test_deepseek_r1_output_after_a_closed_block_in_the_prompt_is_the_answer(servers, thinker):
    message = chat(servers["deepseek_r1"], "x</think>").choices[0].message
    assert (message.reasoning_content, message.content) == (None, text(thinker, "answer"))


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_applies_after_the_reasoning(servers, thinker, parser, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    answer = client(servers[parser]).chat.completions.create(
        model=client(servers[parser]).models.list().data[0].id,
        messages=[{"role": "user", "content": "alpha"}],
        temperature=0,
        max_completion_tokens=200,
        response_format=fmt,
        stream=stream,
    )
    if stream:
        reasoning, content, _, _ = joined(answer)
    else:
        reasoning, content = answer.choices[0].message.reasoning_content, answer.choices[0].message.content
    assert reasoning == text(thinker, "reasoning")  # free text: the grammar did not touch it
    assert json.loads(content) == {"answer": "yes"}  # the model's own answer is not JSON: the grammar made it


def test_include_reasoning_false_and_reasoning_effort(servers, thinker):
    message = chat(servers["qwen3"], "alpha", include_reasoning=False).choices[0].message
    assert (message.reasoning_content, message.content) == (None, text(thinker, "answer"))
    server = servers["qwen3"]
    rendered = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": [{"role": "user", "content": "alpha"}], "reasoning_effort": "high"},
        timeout=60,
    ).json()
    assert thinker["tokenizer"].decode(rendered["tokens"]).startswith("effort=high\n")
    effort = chat(server, "alpha", reasoning_effort="low")  # the template takes it, the answer follows
    assert effort.choices[0].message.content is not None
    bad = httpx.post(
        f"{server.base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "alpha"}], "reasoning_effort": "extreme"},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_an_unknown_parser_or_a_model_without_think_tokens_is_refused(start_server, tmp_path):
    with pytest.raises(RuntimeError, match="--reasoning-parser bogus"):
        start_server("tiny-random-llama", "--reasoning-parser", "bogus")
    with pytest.raises(RuntimeError, match="no single-token <think>"):
        start_server("tiny-random-llama", "--reasoning-parser", "qwen3", "--kv-cache-memory", "16MiB")


# ---- in process ---------------------------------------------------------------------------------


def test_auto_needs_the_tags_and_a_template_that_writes_them(thinker):
    from llmctl.models.embedded import embedded_tokenizer

    assert resolve_parser("auto", embedded_tokenizer()) is None
    with pytest.raises(ConfigError, match="no single-token"):
        resolve_parser("deepseek_r1", embedded_tokenizer())
    tok = thinker["tokenizer"]
    assert resolve_parser("auto", tok) == ReasoningParser("qwen3", thinker["think"], thinker["end_think"])
    tok.chat_template = tok.chat_template.replace("enable_thinking", "thinking_on")
    assert resolve_parser("auto", tok).name == "deepseek_r1"


def test_split_states_from_the_prompt(thinker):
    start, end = thinker["think"], thinker["end_think"]
    r1, q3 = ReasoningParser("deepseek_r1", start, end), ReasoningParser("qwen3", start, end)
    assert r1.initial_state([5, 6]) == "reasoning" and q3.initial_state([5, 6]) == "undecided"
    assert r1.initial_state([start, end, 7]) == "answer" == q3.initial_state([5, start, end])
    assert q3.initial_state([5, start]) == "reasoning"
    # qwen3: text before a later <think> stays in the answer; one block only
    split = q3.splitter([5])
    split.feed([10, start, 11, 12, end, 13, start, 14])
    ends = [1, 1, 2, 3, 3, 4, 4, 5]
    assert split.parts("abcde", ends) == ("bc", "ade") and split.reasoning_tokens == 4


class _Recorder:
    """A grammar matcher that allows token 7 only and records what it accepted."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token_id):
        self.accepted.append(token_id)
        return token_id == 7

    def fill_bitmask(self, bitmask, row):
        bitmask[row].zero_()
        bitmask[row, 0] = 1 << 7

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n :]

    def copy(self):
        twin = _Recorder()
        twin.accepted = list(self.accepted)
        return twin

    is_terminated = False
    error = ""


class _Compiled:
    def new_matcher(self):
        return _Recorder()


def test_gate_lets_the_block_through_then_hands_over_to_the_grammar():
    gate = GatedGrammar(_Compiled(), start_id=2, end_id=3, state="undecided").new_matcher()
    mask = torch.zeros(1, 1, dtype=torch.int32)
    gate.fill_bitmask(mask, 0)
    assert int(mask[0, 0]) == (1 << 7) | (1 << 2)  # the grammar's tokens, and <think> first
    for token in (2, 9, 8, 3):  # <think> free text </think>
        assert gate.accept_token(token)
        assert gate.inner.accepted == []
    gate.fill_bitmask(mask, 0)
    assert int(mask[0, 0]) == 1 << 7 and gate.is_open
    twin = gate.copy()
    assert gate.accept_token(7) and gate.inner.accepted == [7] and twin.inner.accepted == []
    gate.rollback(2)  # back before </think>: the grammar forgets its token, the gate closes
    assert not gate.is_open and gate.inner.accepted == []
    gate.fill_bitmask(mask, 0)
    assert int(mask[0, 0]) == -1
    straight = GatedGrammar(_Compiled(), 2, 3, "undecided").new_matcher()
    assert not straight.accept_token(9) and straight.is_open  # a first token that is not <think>: grammar
    assert isinstance(straight, ReasoningGate)
