"""Tokenizer, chat template and streaming detokenizer, on the `tokenizers` and `jinja2` libraries.

``transformers`` is not a runtime dependency: ``tokenizer.json`` carries the vocabulary, the
normaliser and the BOS post-processor; ``tokenizer_config.json`` carries the special tokens and
the chat template, which is rendered the way ``transformers`` renders it (sandboxed jinja2,
``trim_blocks``/``lstrip_blocks``).
"""

from __future__ import annotations

import codecs
import json
import re
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from llmctl.errors import ConfigError, InvalidRequestError, ModelLoadError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Chat-template variables llmctl sets itself (``apply_chat_template``, and the server's tools): a
# request's or a flag's template variables cannot set them.
TEMPLATE_VARIABLES_SET_BY_LLMCTL = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        source: str = "tokenizer",
    ) -> None:
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

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` leaves out."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def byte_fallback_tokens(self) -> dict[int, int]:
        """``{id: byte}`` for the ``<0xNN>`` tokens of a SentencePiece byte-fallback vocabulary
        (empty for other tokenizers, byte-level BPE included)."""
        if '"ByteFallback"' not in self._decoder_json:
            return {}
        return {
            i: int(m.group(1), 16)
            for token, i in self.backend.get_vocab(with_added_tokens=False).items()
            if (m := _BYTE_TOKEN.fullmatch(token))
        }

    @cached_property
    def _decoder_json(self) -> str:
        return json.dumps(json.loads(self.backend.to_str()).get("decoder"))

    @cached_property
    def _byte_level_chars(self) -> dict[str, int] | None:
        """GPT-2's byte-to-character alphabet, inverted, when the decoder is byte-level."""
        return (
            {char: byte for byte, char in _bytes_to_unicode().items()} if '"ByteLevel"' in self._decoder_json else None
        )

    @cached_property
    def _anchor(self) -> list[int]:
        """A plain token to decode others after, so that a SentencePiece word keeps its leading
        space (``decode`` strips it at the start of a text)."""
        return self.encode("a", add_special_tokens=False)[-1:]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to a text: one byte for a byte-fallback token, the raw
        bytes of a byte-level token (part of a character, where ``decode`` would show U+FFFD), a
        SentencePiece word with its leading space, a special token's own text."""
        if (byte := self.byte_fallback_tokens.get(token_id)) is not None:
            return bytes([byte])
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self.backend.get_added_tokens_decoder():
            return token.encode()
        chars = self._byte_level_chars
        if chars is not None:
            return bytes(chars[c] for c in token) if all(c in chars for c in token) else token.encode()
        before = self.decode(self._anchor, skip_special_tokens=False)
        after = self.decode([*self._anchor, token_id], skip_special_tokens=False)
        return (after[len(before) :] if after.startswith(before) else self.decode([token_id])).encode()

    def decode_stream(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render the conversation to the prompt text; its special tokens are in the text, so encode it
        with ``add_special_tokens=False``. ``chat_template`` renders through that template instead of
        the model's; ``continue_final_message`` leaves the last message open (the text ends where its
        content does), so that the model continues it rather than answering it; ``extra`` are the
        template's own variables (``tools``, ``enable_thinking``, ...)."""
        source = chat_template or self.chat_template
        if not source:
            raise InvalidRequestError(
                "this model has no chat template (it is a base model): use completions instead of chat"
            )
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            text = compile_chat_template(source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"chat template refused the conversation: {exc}") from exc
        except Exception as exc:  # a template is code from the model or the request: its bugs are not ours
            raise InvalidRequestError(f"chat template failed on the conversation: {type(exc).__name__}: {exc}") from exc
        return _end_at_final_message(text, messages) if continue_final_message else text


def _sandbox() -> ImmutableSandboxedEnvironment:
    """The environment ``transformers`` renders chat templates in: sandboxed, ``trim_blocks`` and
    ``lstrip_blocks``, loop controls, ``tojson``, ``raise_exception`` and ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled once (the model's template, a ``--chat-template`` or a request's);
    a syntax error raises ``jinja2.TemplateSyntaxError``."""
    return _sandbox().from_string(source)


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value: the text of the file it names, else the template text itself
    (as vLLM reads it). Checked to compile, so that a broken template fails at start, not per request."""
    path = Path(value).expanduser()
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path:
        if not path.is_file():
            raise ConfigError(f"--chat-template {value}: no such file (give a file or the template text)")
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {path}: cannot read it: {exc}") from None
    try:
        compile_chat_template(value)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        where = path if looks_like_path else "the given text"
        raise ConfigError(f"--chat-template {where}: line {exc.lineno}: {exc.message}") from None
    return value


def _end_at_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` cut right after the last message's content (what ``transformers`` does for
    ``continue_final_message``). Some templates strip a message first, so the stripped content is
    looked for too."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise InvalidRequestError("continue_final_message needs a last message with text to continue")
    for probe in (final, final.strip()):
        at = text.rfind(probe)
        if at >= 0:
            return text[: at + len(probe)]
    raise InvalidRequestError("continue_final_message: the chat template did not write the last message's text")


class IncrementalDetokenizer:
    """Turns a token stream into text deltas that never raise and that add up to what the
    tokenizer's own ``decode`` gives for the same tokens.

    It decodes a short sliding window of ids with ``decode`` itself (vLLM's
    ``detokenize_incrementally``) and emits only the part of the window's text that later tokens
    cannot change:

    - byte-level BPE (GPT-2, Llama 3, Qwen): ``decode`` replaces bytes lossily, so only a trailing
      U+FFFD (an incomplete UTF-8 sequence) can still change into a character;
    - SentencePiece byte fallback (Llama 2, Mistral, stories260k): ``decode`` turns a whole run of
      ``<0xNN>`` tokens into U+FFFD, one per token, as soon as the run is not valid UTF-8, so a run
      that is still valid is held back until a non-byte token closes it.

    The tokenizers library's ``DecodeStream`` raises on exactly those sequences ("Invalid prefix
    encountered"), which random or high-temperature generations produce.

    The window starts on the prompt's last tokens, so a first generated word keeps its leading
    space (SentencePiece drops it at the very start of a text); the text the prompt context already
    shows is not repeated (see ``_common_prefix_len``)."""

    PROMPT_CONTEXT = 6

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.backend = tokenizer.backend
        self.skip_special_tokens = skip_special_tokens
        self._byte_tokens = tokenizer.byte_fallback_tokens
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = list(prompt_token_ids[-self.PROMPT_CONTEXT :])
        self._start = 0  # the window: ids[_start:]
        self._read = len(self._ids)  # ids[_start:_read] are consumed: prompt context or already emitted
        self._extra = 0  # characters emitted beyond the text of ids[_start:_read]

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back when the sequence ends (an incomplete character, an open run of
        byte tokens); called once, after the last ``step``."""
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        except (OverflowError, TypeError):  # an id that is not a vocabulary index: shows as nothing
            return self.backend.decode(
                [i for i in ids if isinstance(i, int) and 0 <= i < 2**32], skip_special_tokens=self.skip_special_tokens
            )

    def _emit(self, final: bool) -> str:
        window = self._ids[self._start :]
        consumed = self._shown_text(self._ids[self._start : self._read])
        text = self._decode(window)
        base = _common_prefix_len(consumed, text) + self._extra
        stable = len(text) if final else self._stable_len(text, window)
        if stable <= base:
            return ""
        delta = text[base:stable]
        if stable == len(text):  # a clean boundary: the next window starts at what was just read
            self._start, self._read, self._extra = self._read, len(self._ids), 0
        else:
            self._extra += len(delta)
        return delta

    def _stable_len(self, text: str, window: list[int]) -> int:
        """How much of the window's text no later token can change."""
        run, _ = self._open_byte_run(window)
        if run:
            return len(self._decode(window[:-run])) if run < len(window) else 0
        return len(text) - 1 if text.endswith("\ufffd") else len(text)

    def _shown_text(self, ids: list[int]) -> str:
        """The text ``ids`` stand for, where an open run of byte tokens (a prompt that ends inside a
        character) counts by the characters it completes, so that they are not emitted again."""
        run, raw = self._open_byte_run(ids)
        if not run:
            return self._decode(ids)
        return self._decode(ids[:-run]) + codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)

    def _open_byte_run(self, window: list[int]) -> tuple[int, bytes]:
        """The byte-fallback run at the end of the window (its length in ids, its bytes) if it is
        still valid UTF-8 so far, complete or not; ``(0, b"")`` when there is none or when it is
        already invalid (then ``decode`` shows it as U+FFFD whatever follows)."""
        if not self._byte_tokens:
            return 0, b""
        length, run = 0, bytearray()
        for token_id in reversed(window):
            if token_id in self._skipped:  # decode drops it: the run goes on across it
                length += 1
                continue
            byte = self._byte_tokens.get(token_id)
            if byte is None:
                break
            run.insert(0, byte)
            length += 1
        if not run:
            return 0, b""
        try:
            codecs.getincrementaldecoder("utf-8")().decode(bytes(run), final=False)
        except UnicodeDecodeError:
            return 0, b""
        while window[-length] in self._skipped:  # skipped ids before the run are not part of it
            length -= 1
        return length, bytes(run)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def _common_prefix_len(a: str, b: str) -> int:
    """Usually ``len(a)``. Shorter when the prompt context ends inside a character that the
    generated tokens complete: the character is then emitted whole, not repeated."""
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
