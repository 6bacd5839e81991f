"""Tokenizer, chat template and streaming detokenizer, on the `tokenizers` and `jinja2` libraries.

``transformers`` is not a runtime dependency: ``tokenizer.json`` carries the vocabulary, the
normaliser and the BOS post-processor; ``tokenizer_config.json`` carries the special tokens and
the chat template, which is rendered the way ``transformers`` renders it (sandboxed jinja2,
``trim_blocks``/``lstrip_blocks``).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from llmctl.errors import InvalidRequestError, ModelLoadError


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict[str, Any] | None = None,
                 generation_config: dict[str, Any] | None = None, source: str = "tokenizer") -> None:
        self.backend = backend
        self.config = config or {}
        self.source = source
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.chat_template: str | None = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        eos_ids = set()
        for source_cfg in (generation_config or {}, self.config):
            eos = source_cfg.get("eos_token_id")
            if isinstance(eos, int):
                eos_ids.add(eos)
            elif isinstance(eos, list):
                eos_ids.update(int(e) for e in eos)
        if self.eos_token is not None and (eid := backend.token_to_id(self.eos_token)) is not None:
            eos_ids.add(eid)
        self.eos_token_ids: set[int] = eos_ids

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found (llmctl reads the fast-tokenizer file tokenizer.json)")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises a bare Exception on malformed files
            raise ModelLoadError(f"{path}: cannot parse tokenizer ({exc})") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text()
        return cls(backend, config, _read_json(model_dir / "generation_config.json"), source=str(path))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render the conversation to the prompt text; its special tokens are in the text, so encode it
        with ``add_special_tokens=False``."""
        if not self.chat_template:
            raise InvalidRequestError(
                "this model has no chat template (it is a base model): use completions instead of chat"
            )
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"chat template refused the conversation: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a token stream into text deltas; a multi-byte character split over several tokens is
    held back until it is complete (the library's ``DecodeStream`` does the byte bookkeeping).

    The stream starts from the prompt's last tokens, so a first generated word keeps its leading
    space (SentencePiece-style tokenizers drop it at the very start of a text)."""

    PROMPT_CONTEXT = 8

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Feed the context through the stream itself rather than as its initial ids: a prompt that
        # ends inside a multi-byte character then leaves that character pending, and the first
        # generated token completes it instead of repeating the prompt's tail.
        for token_id in prompt_token_ids[-self.PROMPT_CONTEXT:]:
            self.stream.step(tokenizer.backend, token_id)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.tokenizer.backend, token_id) or ""

    def flush(self) -> str:
        """Text still held back when the sequence ends (bytes that never completed a character);
        called once, after the last ``step``."""
        return ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
