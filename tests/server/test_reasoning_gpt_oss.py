"""The ``gpt_oss`` reasoning parser: harmony's analysis channel split from the final one on token
ids (whole and token by token, as a stream sees it), ``auto`` picking it from a harmony template;
and through the ``openai`` client against a real ``llmctl serve`` of a model that writes harmony
(tests/harmony_model.py): analysis as ``reasoning_content``, the final channel as ``content``,
streamed and not, cut short, ``reasoning_effort`` rendered by the template, structured output
refused clearly."""

from __future__ import annotations

import harmony_model
import httpx
import openai
import pytest

from llmctl.errors import ConfigError, InvalidRequestError
from llmctl.reasoning import TokenOffsets, reasoning_gate, resolve_parser

REASONING, ANSWER = "Why is the sky blue", "Reasoning: high"
OUTPUT = (
    f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)


@pytest.fixture(scope="module")
def tok():
    return harmony_model.tokenizer()


def split_of(tok, output: str, prompt: str = "<|start|>assistant", stream: bool = False):
    """``(reasoning, answer, reasoning_tokens)`` of ``output`` after ``prompt``; streamed: fed token by
    token, every step's parts a prefix of the next one's."""
    parser = resolve_parser("gpt_oss", tok)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(output, add_special_tokens=False)
    split, offsets = parser.splitter(prompt_ids), TokenOffsets(tok, prompt_ids)
    previous = ("", "")
    for n in range(1, len(ids) + 1) if stream else [len(ids)]:
        split.feed(ids[:n])
        offsets.advance(ids[:n], n == len(ids))
        text = tok.decode(ids[:n])
        parts = split.parts(text, offsets.ends)
        assert parts[0].startswith(previous[0]) and parts[1].startswith(previous[1]), (previous, parts)
        previous = parts
    return (*previous, split.reasoning_tokens, split)


@pytest.mark.parametrize("stream", [False, True])
def test_analysis_is_reasoning_final_is_the_answer(tok, stream):
    reasoning, answer, reasoning_tokens, split = split_of(tok, OUTPUT, stream=stream)
    assert (reasoning, answer) == (REASONING, ANSWER)
    assert split.has_reasoning and split.ended
    through_end = OUTPUT[: OUTPUT.index("<|end|>") + len("<|end|>")]
    assert reasoning_tokens == len(tok.encode(through_end, add_special_tokens=False))


def test_cut_inside_the_analysis_is_all_reasoning(tok):
    reasoning, answer, reasoning_tokens, split = split_of(tok, f"<|channel|>analysis<|message|>{REASONING}")
    assert (reasoning, answer, split.ended) == (REASONING, "", False)
    assert reasoning_tokens == split.seen


def test_commentary_is_reasoning_one_message_a_line_and_headers_belong_to_neither(tok):
    output = (
        "<|channel|>analysis<|message|>sky<|end|><|start|>assistant<|channel|>commentary<|message|>blue<|end|>"
        "<|start|>assistant<|channel|>final<|message|>high<|return|>"
    )
    assert split_of(tok, output, stream=True)[:2] == ("sky\nblue", "high")


def test_output_without_the_format_is_the_answer_and_a_final_only_output_has_no_reasoning(tok):
    reasoning, answer, reasoning_tokens, split = split_of(tok, "the sky is blue", stream=True)
    assert (reasoning, answer, reasoning_tokens, split.has_reasoning) == ("", "the sky is blue", 0, False)
    reasoning, answer, _, split = split_of(tok, "<|channel|>final<|message|>blue<|return|>")
    assert (reasoning, answer, split.has_reasoning) == ("", "blue", False)


def test_a_body_the_template_opened_starts_the_output(tok):
    prompt = "<|start|>assistant<|channel|>analysis<|message|>"
    output = f"{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
    assert split_of(tok, output, prompt=prompt, stream=True)[:2] == (REASONING, ANSWER)


def test_auto_picks_gpt_oss_from_a_harmony_template_only(tok):
    parser = resolve_parser("auto", tok)
    assert parser.name == "gpt_oss" and parser.start_id == tok.backend.token_to_id("<|channel|>")
    assert parser.description.startswith(f"gpt_oss (<|channel|> {parser.start_id}, <|message|> ")
    plain = harmony_model.tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve_parser("auto", plain) is None
    assert resolve_parser("gpt_oss", plain).name == "gpt_oss"  # named: the vocabulary decides
    from llmctl.models.embedded import embedded_tokenizer

    with pytest.raises(ConfigError, match="harmony special tokens"):
        resolve_parser("gpt_oss", embedded_tokenizer())
    with pytest.raises(InvalidRequestError, match="structured outputs are not supported"):
        reasoning_gate(parser, [1, 2])


# ---- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harmony(tmp_path_factory) -> dict:
    return harmony_model.build(tmp_path_factory.mktemp("harmony") / "model")


@pytest.fixture(scope="module")
def server(start_server, harmony):
    return start_server(
        harmony["dir"], "--reasoning-parser", "auto", "--max-model-len", "256", "--kv-cache-memory", "16MiB"
    )


ASK = [{"role": "user", "content": "Why is the sky blue"}]


def chat(server, stream=False, **extra):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=ASK,
        temperature=0,
        max_completion_tokens=extra.pop("max_tokens", 64),
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        extra_body=extra or None,
    )


def joined(chunks) -> tuple[str | None, str | None, list, object]:
    reasoning, content, deltas, usage = None, None, [], None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None)
            if piece:
                reasoning = (reasoning or "") + piece
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            deltas.append((piece, choice.delta.content, choice.finish_reason))
    return reasoning, content, deltas, usage


def test_served_analysis_is_reasoning_content_and_final_is_content(server, harmony):
    assert "reasoning parser: gpt_oss" in " ".join(server.log().split())
    tok, analysis = harmony["tokenizer"], {"chat_template_kwargs": {"open_analysis": True}}
    reasoning, answer = tok.decode(harmony["reasoning"]), tok.decode(harmony["answer"])
    whole = chat(server, **analysis)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, answer)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(harmony["reasoning"]) + 1  # and <|end|>
    streamed_reasoning, streamed_content, deltas, usage = joined(chat(server, stream=True, **analysis))
    assert (streamed_reasoning, streamed_content) == (reasoning, answer)
    thought_chunks = [i for i, (r, _, _) in enumerate(deltas) if r]
    answer_chunks = [i for i, (_, c, _) in enumerate(deltas) if c]
    assert len(thought_chunks) >= 3 and max(thought_chunks) < min(answer_chunks)
    assert usage.completion_tokens_details.reasoning_tokens == len(harmony["reasoning"]) + 1
    # the model writes the final channel only: no reasoning
    final_only = chat(server)
    assert (final_only.choices[0].message.reasoning_content, final_only.choices[0].message.content) == (None, answer)
    assert final_only.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
def test_served_cut_inside_the_analysis_is_all_reasoning(server, harmony, stream):
    answer = chat(server, stream=stream, max_tokens=2, chat_template_kwargs={"open_analysis": True})
    expected = harmony["tokenizer"].decode(harmony["reasoning"][:2])
    if stream:
        reasoning, content, deltas, _ = joined(answer)
        finish = deltas[-1][2]
    else:
        message = answer.choices[0].message
        reasoning, content, finish = message.reasoning_content, message.content, answer.choices[0].finish_reason
    assert (reasoning, content, finish) == (expected, None, "length")


def test_served_reasoning_effort_and_structured_output_refused(server, harmony):
    tok = harmony["tokenizer"]
    for effort in ("low", "high"):
        rendered = httpx.post(f"{server.url}/tokenize", json={"messages": ASK, "reasoning_effort": effort}, timeout=60)
        assert tok.decode(rendered.json()["tokens"], skip_special_tokens=False).startswith(
            f"<|start|>system<|message|>Reasoning: {effort}<|end|>"
        )
    assert chat(server, reasoning_effort="low").choices[0].message.content == tok.decode(harmony["answer"])
    refused = httpx.post(
        f"{server.base_url}/chat/completions",
        json={"messages": ASK, "response_format": {"type": "json_object"}},
        timeout=60,
    )
    assert refused.status_code == 400 and "gpt_oss" in refused.json()["error"]["message"]
    assert chat(server).choices[0].finish_reason == "stop"  # the server is fine
