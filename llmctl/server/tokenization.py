"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Clients that must count or split tokens exactly as the server does use them instead of loading the
model's tokenizer themselves; lm-evaluation-harness's ``local-completions`` model detects them
(its "remote" tokenizer backend), which is what lets it run against a model it cannot download, a
GGUF file included. They sit beside ``/v1`` as in vLLM, behind ``--api-key`` like ``/v1``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from llmctl.server.protocol import STRICT, ChatMessage, ChatTemplateFields, bad_request
from llmctl.server.serving import OpenAIServing

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class TokenizeRequest(ChatTemplateFields):
    """A ``prompt`` (text) or chat ``messages`` (rendered through the chat template first, as
    ``/v1/chat/completions`` renders them)."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: list[int]


def tokenize(serving: OpenAIServing, req: TokenizeRequest) -> dict[str, Any]:
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("tokenize takes either prompt or messages", "prompt")
    tokenizer = serving.tokenizer
    if req.messages is not None:
        text = serving.render_chat(req.messages, req)
        tokens = tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
    else:
        tokens = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    body: dict[str, Any] = {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}
    if req.return_token_strs:
        body["token_strs"] = [serving.logprobs.name(t) for t in tokens]
    return body


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict[str, Any]:
    serving.check_model(req.model)
    if not all(0 <= t < serving.vocab_size for t in req.tokens):
        raise bad_request(f"tokens must be integers in [0, {serving.vocab_size})", "tokens")
    return {"prompt": serving.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(serving: OpenAIServing) -> dict[str, Any]:
    """What a client needs to tokenize like the server: special tokens and the chat template."""
    tokenizer = serving.tokenizer
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": None,
        "eos_token_id": tokenizer.eos_token_id,
        "chat_template": tokenizer.chat_template,
        "model_max_length": serving.max_model_len,
        "vocab_size": tokenizer.vocab_size,
    }
