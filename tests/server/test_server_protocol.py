"""OpenAI request bodies to SamplingParams, without a server."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from llmctl.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, DeltaMessage


def test_completion_request_maps_to_sampling_params():
    req = CompletionRequest.model_validate(
        {
            "prompt": "hi",
            "n": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "END",
            "top_k": 40,
            "ignore_eos": True,
            "logprobs": 2,
        }
    )
    params = req.sampling_params(req.max_tokens, req.logprobs)
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (
        2,
        16,
        0.5,
        0.9,
        40,
        3,
    )
    assert params.stop == ["END"] and params.ignore_eos and params.logprobs == 2


def test_openai_defaults():
    req = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "temperature": None, "top_p": None})
    params = req.sampling_params(16, None)
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (1.0, 1.0, 0, [])
    assert req.prompts() == [[1, 2], [3]]
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True}
    )
    assert chat.requested_max_tokens == 4 and chat.engine_logprobs == 0


def test_chat_content_parts_become_text():
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}
            ]
        }
    )
    assert chat.messages[0].for_template() == {"role": "user", "content": "Hello there"}
    image = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    )
    with pytest.raises(APIError, match="image_url"):
        image.messages[0].for_template()


@pytest.mark.parametrize(
    "body", [{"suffix": "x"}, {"best_of": 3}, {"max_tokens": 0}, {"max_tokens": 0, "stream": True}]
)
def test_output_changing_fields_are_refused(body):
    with pytest.raises(APIError) as error:
        CompletionRequest.model_validate({"prompt": "hi", **body}).refuse_unsupported()
    assert error.value.status_code == 400


@pytest.mark.parametrize(
    "body", [{"echo": True, "logprobs": 1, "stream": True}, {"max_tokens": 0, "echo": True, "stream": True}]
)
def test_streamed_echo_is_accepted(body):
    CompletionRequest.model_validate({"prompt": "hi", **body}).refuse_unsupported()


def test_out_of_range_values_are_400s_naming_the_field():
    req = CompletionRequest.model_validate({"prompt": "hi", "top_p": 1.5})
    with pytest.raises(APIError, match="top_p") as error:
        req.sampling_params(16, None)
    assert error.value.status_code == 400 and error.value.param == "top_p"
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}
    )
    with pytest.raises(APIError) as error:
        chat.sampling_params(16, chat.engine_logprobs)
    assert error.value.param == "top_logprobs"


@pytest.mark.parametrize("body", [{"stream": "yes"}, {"max_tokens": "5"}, {"temperature": True}, {"n": 2.0}])
def test_wrong_types_are_not_coerced(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **body}))


def test_deltas_carry_only_what_changed():
    assert DeltaMessage(content="x").model_dump() == {"content": "x"}
    assert DeltaMessage().model_dump() == {}
