"""N-gram prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ``max_n`` down to ``min_n``) in its own prompt + output.

Edits, summaries and code rewrites copy long runs of their input, so the continuation of a
matching n-gram is often exactly what the model says next, at no model cost to propose it.
"""

from __future__ import annotations


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens (fewer near the end of the sequence; none without a match)."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        last = suffix[-1]
        # the latest earlier end position i of the suffix (i < length - 1), scanning backwards
        for i in range(length - 2, n - 2, -1):
            if token_ids[i] == last and token_ids[i - n + 1 : i + 1] == suffix:
                return token_ids[i + 1 : i + 1 + num_tokens]
    return []
