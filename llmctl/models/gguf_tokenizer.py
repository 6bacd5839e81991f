"""The tokenizer a GGUF file describes in its metadata, built as a ``tokenizers`` Tokenizer.

A GGUF carries no tokenizer.json: ``tokenizer.ggml.*`` holds the vocabulary, merges or scores,
token types and special token ids, and ``tokenizer.chat_template`` the template. Two kinds cover
the Llama family:

- ``gpt2``: byte-level BPE with the file's merges; ``tokenizer.ggml.pre`` names how text is split
  before BPE (llama.cpp's pre-tokenizer names, mapped below to the regexes the model was trained
  with);
- ``llama``: SentencePiece BPE with byte fallback; the merges are recovered from the token scores
  (a higher score merges first), as llama.cpp's tokenizer and transformers' converter do.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from llmctl.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regexes applied in order (llama.cpp's llm_tokenizer_bpe table).
_PRE_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # digits one by one, as SmolLM's own tokenizer.json does
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
}


class GGUFTokenizerError(ValueError):
    """A tokenizer field the builder cannot use; the loader names the file around it."""


def _byte_alphabet() -> set[str]:
    return set(pre_tokenizers.ByteLevel.alphabet())


def _byte_level_model(meta: dict[str, Any]) -> tuple[HFTokenizer, list[str]]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    pre = meta.get("tokenizer.ggml.pre", "default")
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.pre {pre!r} is not a pre-tokenizer llmctl knows ({', '.join(sorted(_PRE_SPLITS))})"
        )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, tokens


def _score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges from token scores: every split of a token into two tokens is a
    merge, ranked by the merged token's score (transformers' ``generate_merges``)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in ids and token[i:] in ids]
        ranked.extend(sorted(local, key=lambda m: (ids[m[0]], ids[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _sentencepiece_model(meta: dict[str, Any]) -> tuple[HFTokenizer, list[str]]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise GGUFTokenizerError("tokenizer.ggml.scores is missing or does not match tokenizer.ggml.tokens")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        {t: i for i, t in enumerate(tokens)},
        _score_merges(tokens, list(scores)),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = HFTokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return backend, tokens


def _add_special_tokens(backend: HFTokenizer, meta: dict[str, Any], tokens: list[str], byte_level: bool) -> None:
    """Control tokens (``<|im_start|>``) and user-defined ones stay whole in text; in a byte-level
    vocabulary a 'control' token spelled outside the byte alphabet is a mislabel and is skipped."""
    types = meta.get("tokenizer.ggml.token_type") or []
    alphabet = _byte_alphabet() if byte_level else None
    special_ids = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    special = [
        AddedToken(t, special=True, normalized=False)
        for i, (t, kind) in enumerate(zip(tokens, types))
        if (kind == CONTROL or i in special_ids) and (alphabet is None or set(t) <= alphabet)
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    )


def _token(tokens: list[str], meta: dict[str, Any], key: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{key}_token_id")
    if index is None:
        return None
    if not 0 <= index < len(tokens):
        raise GGUFTokenizerError(f"tokenizer.ggml.{key}_token_id {index} is outside the vocabulary")
    return tokens[index]


def build_gguf_tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    """llmctl's Tokenizer for GGUF metadata (a dict of the ``tokenizer.*`` fields' values)."""
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFTokenizerError("tokenizer.ggml.tokens is missing (the file carries no vocabulary)")
    if kind == "gpt2":
        backend, tokens = _byte_level_model(meta)
    elif kind == "llama":
        backend, tokens = _sentencepiece_model(meta)
    else:
        raise GGUFTokenizerError(f"tokenizer.ggml.model {kind!r} is not supported (llmctl reads 'gpt2' and 'llama')")
    _add_special_tokens(backend, meta, tokens, byte_level=kind == "gpt2")
    bos, eos = _token(tokens, meta, "bos"), _token(tokens, meta, "eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and bos is not None:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": _token(tokens, meta, "padding"),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    # llama.cpp also stops at end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>)
    eos_ids = [
        meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom") if f"tokenizer.ggml.{k}_token_id" in meta
    ]
    return Tokenizer(backend, config, {"eos_token_id": eos_ids}, source=source)
