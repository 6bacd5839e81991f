"""vLLM's chat-template controls end to end, with the official ``openai`` client against a real
``llmctl serve``: ``--chat-template``, ``--default-chat-template-kwargs`` and a request's
``chat_template_kwargs`` (Qwen3's ``enable_thinking``), ``continue_final_message``, and a request's
own ``chat_template``, which only a server started with ``--trust-request-chat-template`` renders.

What the engine was given is checked twice: the prompt the server counts in ``usage`` equals the
tokens of the same rendering done here, and greedy text from the chat endpoint equals greedy text
from ``/v1/completions`` on exactly those tokens."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_helpers import scrape, wait_until
from tokenizer_factory import QWEN3_STYLE
from typer.testing import CliRunner

from llmctl.cli import app
from llmctl.models.embedded import embedded_tokenizer

MODEL = "tiny-random-llama"
PLAIN = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ASK = [{"role": "user", "content": "Where is the cat?"}]
CONTINUE = [*ASK, {"role": "assistant", "content": "The cat is"}]


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "qwen3_style.jinja"
    template.write_text(QWEN3_STYLE, encoding="utf-8")
    return start_server(
        MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--chat-template",
        str(template),
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--trust-request-chat-template",
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def expected_prompt(messages, template=QWEN3_STYLE, **kwargs) -> list[int]:
    tokenizer = embedded_tokenizer()
    text = tokenizer.apply_chat_template(messages, chat_template=template, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def chat(client, messages=ASK, **extra_body):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, **extra_body}
    )


def tokenize(server, messages=ASK, **fields) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **fields}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def completion_text(client, prompt: list[int]) -> str:
    return (
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )


@pytest.mark.parametrize(
    "request_kwargs, rendered_kwargs",
    [
        ({}, {"enable_thinking": False}),  # the server's default
        ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}),  # the request's wins
    ],
)
def test_template_and_its_variables_make_the_prompt(server, client, request_kwargs, rendered_kwargs):
    prompt = expected_prompt(ASK, **rendered_kwargs)
    assert tokenize(server, **request_kwargs) == prompt
    reply = chat(client, **request_kwargs)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].message.content == completion_text(client, prompt)


def test_thinking_switch_changes_the_prompt(server):
    off, on = (tokenize(server, chat_template_kwargs={"enable_thinking": flag}) for flag in (False, True))
    assert len(off) > len(on) and off[: len(on)] == on  # the empty think block, appended


def test_continue_final_message_continues_the_assistant_text(server, client):
    prompt = expected_prompt(CONTINUE, add_generation_prompt=False, continue_final_message=True)
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    assert tokenize(server, CONTINUE, **fields) == prompt
    closed = tokenize(server, CONTINUE, add_generation_prompt=False)
    assert closed[: len(prompt)] == prompt and len(closed) > len(prompt)  # <|im_end|> left off
    reply = chat(client, CONTINUE, **fields)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].message.content == completion_text(client, prompt)


def test_a_trusted_request_brings_its_own_template(server, client):
    prompt = expected_prompt(ASK, template=PLAIN)
    assert tokenize(server, chat_template=PLAIN) == prompt
    reply = chat(client, chat_template=PLAIN)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].message.content == completion_text(client, prompt)


def test_an_untrusted_server_refuses_request_templates(chat_server):
    from server_helpers import API_KEY

    untrusted = openai.OpenAI(base_url=chat_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as refused:
        untrusted.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={"chat_template": PLAIN})
    assert refused.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.value.body["message"]
    # the model's own template, with a variable it does not use, still answers
    ok = untrusted.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "extra_body, param, message",
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt: false"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "cannot set messages"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", None),
        ({"chat_template": "{% for %}"}, None, "refused the conversation"),
        ({"chat_template": "{{ messages[0].content + 1 }}"}, None, "TypeError"),
        (
            {
                "add_generation_prompt": False,
                "continue_final_message": True,
                "chat_template": "{{ messages | length }}",
            },
            None,
            "did not write the last message's text",
        ),
    ],
)
def test_bad_template_fields_are_400s_and_lose_nothing(server, client, extra_body, param, message):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, CONTINUE, **extra_body)
    body = refused.value.body
    assert body["param"] == param
    if message is not None:
        assert message in body["message"]
    with httpx.Client(base_url=server.url) as http:
        assert wait_until(lambda: scrape(http)["llmctl:num_requests_running"]["llmctl:num_requests_running"] == 0)
    assert chat(client).choices[0].finish_reason == "length"  # still serving


@pytest.mark.parametrize(
    "args, message",
    [
        (["--default-chat-template-kwargs", "[1]"], "a JSON object"),
        (["--default-chat-template-kwargs", "{enable_thinking: false}"], "not JSON"),
        (["--default-chat-template-kwargs", json.dumps({"tools": []})], "tools cannot be set"),
        (["--chat-template", "/nonexistent/template.jinja"], "no such file"),
        (["--chat-template", "{% if %}"], "line 1"),
    ],
)
def test_bad_template_flags_are_one_line_before_loading(args, message):
    result = CliRunner().invoke(app, ["serve", MODEL, "--port", "0", *args])
    assert result.exit_code == 1, result.output
    assert "error:" in result.output and message in result.output
    assert "Traceback" not in result.output and "model:" not in result.output  # nothing was loaded
