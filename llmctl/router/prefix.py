"""What the router hashes: the leading bytes of a request's prompt, cut into fixed-size chunks.

The router has no tokenizer (it fronts any llmctl or vLLM server, whatever the model), so it
cannot cut a prompt into the engine's KV blocks. It cuts the prompt's UTF-8 bytes instead: two
prompts whose first ``k`` chunks of ``chunk_bytes`` bytes are equal start with the same text, so
they tokenize to the same leading tokens (up to the token that straddles the chunk boundary) and
share the same leading KV blocks in a replica's prefix cache. 64 bytes is about 16 tokens of
English, one KV block of the default size, so a chunk stands for roughly one block.

A chat request is hashed over its messages rendered as ``role NUL content RS`` in order: every
chat template renders messages in order, so requests that share their first messages (a system
prompt) share the leading bytes of both renderings, and only a shared leading part matters here.
Each chunk's hash chains its predecessor's, like the engine's block hashes, so the hash of chunk
``i`` names the whole prefix up to it.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass
from typing import Any

DEFAULT_CHUNK_BYTES = 64
DEFAULT_MAX_CHUNKS = 64  # look at most 4 KiB into a prompt: prefixes longer than that route alike
DEFAULT_RING_CHUNKS = 4  # the consistent-hash key of a prefix never seen: its first 256 bytes

_MESSAGE_SEPARATOR = b"\x1e"


@dataclass(frozen=True)
class PrefixKey:
    """``chain[i]`` names the prompt's first ``i + 1`` full chunks; ``ring_key`` places a prefix
    never seen before on the hash ring."""

    chain: tuple[int, ...]
    ring_key: int


def _hash(previous: bytes, chunk: bytes) -> bytes:
    return hashlib.blake2b(previous + chunk, digest_size=8).digest()


def prefix_key(
    data: bytes,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_chunks: int = DEFAULT_MAX_CHUNKS,
    ring_chunks: int = DEFAULT_RING_CHUNKS,
) -> PrefixKey:
    """Chained hashes of the full leading chunks of ``data``. A prompt shorter than one chunk has
    no chain; its ring key is the hash of all of it."""
    digests: list[bytes] = []
    previous = b""
    for start in range(0, min(len(data) // chunk_bytes, max_chunks) * chunk_bytes, chunk_bytes):
        previous = _hash(previous, data[start : start + chunk_bytes])
        digests.append(previous)
    if digests:
        ring_digest = digests[min(ring_chunks, len(digests)) - 1]
    else:
        ring_digest = _hash(b"", data)
    return PrefixKey(tuple(int.from_bytes(d, "big") for d in digests), int.from_bytes(ring_digest, "big"))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep text parts, others as their JSON
        return "".join(
            part.get("text", "")
            if isinstance(part, dict) and part.get("type") == "text"
            else json.dumps(part, sort_keys=True)
            for part in content
        )
    return "" if content is None else json.dumps(content, sort_keys=True)


def _token_bytes(tokens: list[Any]) -> bytes:
    return array("q", (t for t in tokens if isinstance(t, int))).tobytes()


def routing_bytes(path: str, body: Any) -> bytes:
    """The bytes whose prefix decides where a request goes: the prompt of a completion (the first
    one of a batch of prompts), the rendered messages of a chat. Anything malformed hashes as
    empty: it goes somewhere, and that replica answers the 400."""
    if not isinstance(body, dict):
        return b""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return b""
        return b"".join(
            f"{m.get('role', '')}\x00{_content_text(m.get('content'))}".encode() + _MESSAGE_SEPARATOR
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts is one request, routed by its first prompt
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list):
        return _token_bytes(prompt)
    return b""
