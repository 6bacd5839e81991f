"""Logprobs in OpenAI's two formats, with token strings that add up.

A token is not always text: a byte-fallback ``<0xE7>`` or a byte-level token holding part of a
character decodes, alone, to U+FFFD. So:

- completions ``tokens`` are the part of the choice's text each token produced (a token that
  starts a character gets ``""``, the one that completes it the whole character), so they
  concatenate to the text and ``text_offset`` stays inside it;
- a token named on its own (``top_logprobs`` keys, chat ``token``) is its text when its bytes are
  valid UTF-8, else vLLM's ``"bytes:\\xe7\\x8c"`` form; keys that would still collide (two ids,
  same bytes) fall back to ``"token_id:N"``, so there are as many keys as candidates;
- chat ``bytes`` are each token's real bytes (``null`` for a special token the text leaves out), so
  joining them rebuilds the UTF-8 text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from llmctl.engine.outputs import CompletionOutput
from llmctl.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
from llmctl.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TokenTexts:
    """Where each generated token's text ends in the choice's text, found by running the same
    streaming detokenizer as the engine; plus what was already sent of one streamed choice."""

    detokenizer: IncrementalDetokenizer
    ends: list[int] = field(default_factory=list)
    length: int = 0
    flushed: bool = False
    chars_sent: int = 0
    bytes_sent: int = 0
    tokens_sent: int = 0

    def advance(self, c: CompletionOutput) -> None:
        for token_id in c.token_ids[len(self.ends) :]:
            self.length += len(self.detokenizer.step(token_id))
            self.ends.append(self.length)
        if c.finished and not self.flushed and self.ends:
            self.flushed = True
            self.length += len(self.detokenizer.flush())
            self.ends[-1] = self.length


class LogprobsFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.name = lru_cache(maxsize=65536)(self._name)

    def texts(self, prompt_token_ids: list[int], skip_special_tokens: bool) -> TokenTexts:
        return TokenTexts(self.tokenizer.decode_stream(prompt_token_ids, skip_special_tokens))

    def _name(self, token_id: int) -> str:
        raw = self.tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _candidates(self, c: CompletionOutput, position: int) -> list[tuple[str, int, float]]:
        """(name, id, logprob) of the position's alternatives and the chosen token, most likely
        first, with distinct names."""
        candidates = dict(c.top_logprobs[position]) if c.top_logprobs else {}
        candidates.setdefault(c.token_ids[position], c.logprobs[position])
        return self._named(candidates)

    def _named(self, candidates: dict[int, float]) -> list[tuple[str, int, float]]:
        named, seen = [], set()
        for token_id, logprob in sorted(candidates.items(), key=lambda kv: -kv[1]):
            name = self.name(token_id)
            if name in seen:
                name = f"token_id:{token_id}"
            seen.add(name)
            named.append((name, token_id, logprob))
        return named

    def completion(self, c: CompletionOutput, texts: TokenTexts, end: int) -> CompletionLogprobs:
        """Tokens ``texts.tokens_sent:end`` in the legacy completions format. The chosen token is
        always among its position's ``top_logprobs`` (so there may be logprobs + 1 entries)."""
        texts.advance(c)
        result = CompletionLogprobs()
        last = len(c.token_ids) - 1
        for position in range(texts.tokens_sent, end):
            stop = len(c.text) if c.finished and position == last else min(texts.ends[position], len(c.text))
            token = c.text[texts.chars_sent : max(texts.chars_sent, stop)]
            result.tokens.append(token)
            result.token_logprobs.append(c.logprobs[position])
            result.top_logprobs.append({name: lp for name, _, lp in self._candidates(c, position)})
            result.text_offset.append(texts.chars_sent)
            texts.chars_sent += len(token)
        texts.tokens_sent = end
        return result

    def prompt(
        self,
        prompt_token_ids: list[int],
        prompt_logprobs: list[dict[int, float] | None],
        text: str,
        skip_special_tokens: bool,
        num_top: int,
    ) -> CompletionLogprobs:
        """An echoed prompt in the completions format, as vLLM gives it: ``tokens`` join to
        ``text`` (the prompt as echoed), the first token's logprob is ``null`` (nothing predicts
        it) and each ``top_logprobs`` entry holds the prompt's own token and the top alternatives."""
        detokenizer = self.tokenizer.decode_stream([], skip_special_tokens)
        ends, length = [], 0
        for token_id in prompt_token_ids:
            length += len(detokenizer.step(token_id))
            ends.append(length)
        result, start, last = CompletionLogprobs(), 0, len(prompt_token_ids) - 1
        for position, (token_id, entry) in enumerate(zip(prompt_token_ids, prompt_logprobs)):
            stop = len(text) if position == last else max(start, min(ends[position], len(text)))
            result.tokens.append(text[start:stop])
            result.text_offset.append(start)
            start = stop
            result.token_logprobs.append(None if entry is None else entry[token_id])
            result.top_logprobs.append(
                None if entry is None else {name: lp for name, _, lp in self._named(_top(entry, token_id, num_top))}
            )
        return result

    def prompt_logprobs(
        self, prompt_token_ids: list[int], prompt_logprobs: list[dict[int, float] | None], num_top: int, ranked: int
    ) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs``: per position the prompt's own token first, then the ``num_top``
        most likely, keyed by token id. The engine computed the top ``ranked`` (>= ``num_top``), so
        a token's rank is exact when it is among them and unknown (``null``) otherwise."""
        result: PromptLogprobs = []
        for token_id, entry in zip(prompt_token_ids, prompt_logprobs):
            if entry is None:
                result.append(None)
                continue
            outside = len(entry) > ranked  # the engine's top-k left the prompt's own token out
            values = list(entry.values())
            result.append(
                {
                    str(candidate): PromptLogprob(
                        logprob=lp,
                        rank=None if outside and candidate == token_id else 1 + sum(v > lp for v in values),
                        decoded_token=self.name(candidate),
                    )
                    for candidate, lp in _top(entry, token_id, num_top).items()
                }
            )
        return result

    def chat(self, c: CompletionOutput, texts: TokenTexts, end: int, skip_special_tokens: bool) -> ChatLogprobs:
        """Tokens ``texts.tokens_sent:end`` in the chat format. Bytes past the end of a text that a
        stop string cut short are left out, so the bytes still join to the text."""
        content = []
        limit = len(c.text.encode("utf-8")) if c.finished else None
        skipped = self.tokenizer.special_token_ids if skip_special_tokens else frozenset()
        for position in range(texts.tokens_sent, end):
            token_id = c.token_ids[position]
            raw: bytes | None = None if token_id in skipped else self.tokenizer.token_bytes(token_id)
            if raw is not None and limit is not None:
                raw = raw[: max(0, limit - texts.bytes_sent)]
            texts.bytes_sent += len(raw or b"")
            alternatives = [
                TopLogprob(token=name, logprob=lp, bytes=list(self.tokenizer.token_bytes(i)))
                for name, i, lp in self._candidates(c, position)
                if c.top_logprobs and i in c.top_logprobs[position]
            ]
            content.append(
                TokenLogprob(
                    token=self.name(token_id),
                    logprob=c.logprobs[position],
                    bytes=None if raw is None else list(raw),
                    top_logprobs=alternatives,
                )
            )
        texts.tokens_sent = end
        return ChatLogprobs(content=content)


def _top(entry: dict[int, float], own: int, num_top: int) -> dict[int, float]:
    """The prompt's own token, then the ``num_top`` most likely of ``entry`` (the engine may have
    computed more); on a tie the own token ranks last, as it is only there because it was asked."""
    ranked = sorted(entry.items(), key=lambda item: (-item[1], item[0] == own))
    return {own: entry[own], **dict(ranked[:num_top])}
