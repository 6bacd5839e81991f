"""Chat-template rendering beyond the model's default: template variables (``enable_thinking``),
``continue_final_message``, another template, and ``--chat-template``. ``transformers``'
``apply_chat_template`` on the same tokenizer and template is the oracle."""

from __future__ import annotations

import pytest
from tokenizer_factory import QWEN3_STYLE, _byte_level_json, byte_level_bpe

from llmctl.chat.session import ChatSession, Message
from llmctl.errors import ConfigError, InvalidRequestError
from llmctl.tokenizer import read_chat_template

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the cat?"}]
# the last message is continued: the template trims it, and its text also occurs earlier
CONTINUE = [{"role": "user", "content": "Say: the cat"}, {"role": "assistant", "content": "the cat "}]


@pytest.fixture(scope="module")
def ours():
    tokenizer = byte_level_bpe()
    tokenizer.chat_template = QWEN3_STYLE
    return tokenizer


@pytest.fixture(scope="module")
def theirs():
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_str(_byte_level_json()), bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = QWEN3_STYLE
    return tokenizer


@pytest.mark.parametrize("variables", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_template_variables_render_as_transformers_renders_them(ours, theirs, variables):
    text = ours.apply_chat_template(ASK, **variables)
    assert text == theirs.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, **variables)
    assert ("<think>" in text) == (variables.get("enable_thinking") is False)


def test_continue_final_message_ends_where_transformers_ends_it(ours, theirs):
    text = ours.apply_chat_template(CONTINUE, add_generation_prompt=False, continue_final_message=True)
    assert text == theirs.apply_chat_template(
        CONTINUE, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\nthe cat")  # the later occurrence, stripped, left open
    closed = ours.apply_chat_template(CONTINUE, add_generation_prompt=False)
    assert closed.startswith(text) and closed[len(text) :] == "<|im_end|>\n"


def test_another_template_for_one_call(ours, theirs):
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert ours.apply_chat_template(ASK, chat_template=plain) == theirs.apply_chat_template(
        ASK, chat_template=plain, tokenize=False, add_generation_prompt=True
    )
    assert ours.chat_template == QWEN3_STYLE  # the model's own stays


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(messages=CONTINUE, continue_final_message=True), "cannot both be true"),
        (
            dict(
                messages=[*ASK, {"role": "assistant", "content": " "}],
                add_generation_prompt=False,
                continue_final_message=True,
            ),
            "needs a last message with text",
        ),
        (
            dict(
                messages=CONTINUE,
                add_generation_prompt=False,
                continue_final_message=True,
                chat_template="{{ messages | length }} messages",
            ),
            "did not write the last message's text",
        ),
        (dict(messages=ASK, chat_template="{% for %}"), "refused the conversation"),
        (dict(messages=ASK, chat_template="{{ messages[0].content + 1 }}"), "TypeError"),
        (dict(messages=ASK, chat_template="{{ raise_exception('no system messages') }}"), "no system messages"),
    ],
)
def test_what_cannot_render_is_an_invalid_request(ours, call, message):
    with pytest.raises(InvalidRequestError, match=message):
        ours.apply_chat_template(**call)


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(QWEN3_STYLE, encoding="utf-8")
    assert read_chat_template(str(path)) == QWEN3_STYLE
    assert read_chat_template(QWEN3_STYLE) == QWEN3_STYLE
    with pytest.raises(ConfigError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    path.write_text("{% for m in messages %}\n{{ m.content }", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"template\.jinja: line 2"):
        read_chat_template(str(path))


def test_chat_session_passes_its_template_variables(ours):
    session = ChatSession(ours, max_model_len=512, max_tokens=16, template_kwargs={"enable_thinking": False})
    text = session.render([Message("user", "Where is the cat?")], generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
