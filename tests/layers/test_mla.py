"""Latent attention (llmctl/layers/mla.py) against attention over explicitly up-projected keys and
values: the absorbed decode, a prefill reading its context back from the pool, and the pool's
two halves holding exactly the latent."""

from __future__ import annotations

import pytest
import torch

from llmctl.errors import UnsupportedModelError
from llmctl.layers.mla import LatentAttention
from llmctl.layers.ops import AttentionMetadata

H, R, NOPE, ROPE, V = 4, 24, 8, 8, 12  # heads, kv_lora_rank, k_nope, k_pe, v per head
BLOCK, SCALE = 4, 0.3


def _layer(num_blocks: int = 8) -> LatentAttention:
    layer = LatentAttention(H, R, NOPE, ROPE, V, SCALE)
    pool = torch.zeros(2, num_blocks, BLOCK, layer.num_kv_heads, layer.head_dim, dtype=torch.float64)
    layer.key_cache, layer.value_cache = pool[0], pool[1]
    return layer


def _inputs(n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return draw(n, H, NOPE), draw(n, H, ROPE), draw(n, R), draw(n, ROPE)


def _reference(q_nope, q_pe, latent, k_pe, w, query_positions) -> torch.Tensor:
    """Each query over the keys/values up-projected from every latent up to its position."""
    kv = (latent @ w.T).view(len(latent), H, NOPE + V)
    keys = torch.cat((kv[..., :NOPE], k_pe[:, None].expand(-1, H, -1)), -1)
    values = kv[..., NOPE:]
    query = torch.cat((q_nope, q_pe), -1)
    out = []
    for q, p in zip(query, query_positions):
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q, keys[: p + 1]) * SCALE, -1)
        out.append(torch.einsum("hl,lhv->hv", probs, values[: p + 1]))
    return torch.stack(out).flatten(1)


def _meta(prefill: tuple[int, int] | None, decode_len: int | None, table: list[int]) -> AttentionMetadata:
    """One sequence: a prefill chunk [start, end), or one decode row at position decode_len - 1."""
    i32 = torch.int32
    start, end = prefill or (0, 0)
    positions = range(start, end) if prefill else [decode_len - 1]
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_prefills=1 if prefill else 0,
        num_prefill_tokens=end - start,
        num_decodes=0 if prefill else 1,
        prefill_query_start_loc=torch.tensor([0, end - start] if prefill else [0], dtype=i32),
        prefill_seq_lens=torch.tensor([end] if prefill else [], dtype=i32),
        prefill_block_tables=torch.tensor([table] if prefill else [], dtype=i32).view(-1, len(table)),
        prefill_is_fresh=start == 0,
        decode_seq_lens=torch.tensor([] if prefill else [decode_len], dtype=i32),
        decode_block_tables=torch.tensor([] if prefill else [table], dtype=i32).view(-1, len(table)),
        max_decode_seq_len=decode_len or 0,
    )


@pytest.mark.parametrize("first_chunk", [11, 5])
def test_chunks_then_absorbed_decode_match_up_projected_attention(first_chunk):
    gen = torch.Generator().manual_seed(first_chunk)
    n = 14
    q_nope, q_pe, latent, k_pe = _inputs(n, gen)
    w = torch.randn(H * (NOPE + V), R, generator=gen, dtype=torch.float64)
    want = _reference(q_nope, q_pe, latent, k_pe, w, range(n))
    layer, table = _layer(), [5, 2, 7, 0]  # blocks out of order
    got = []
    for start, end in ((0, first_chunk), (first_chunk, n - 1)):  # the second chunk reads the pool
        part = slice(start, end)
        got.append(layer(q_nope[part], q_pe[part], latent[part], k_pe[part], w, _meta((start, end), None, table)))
    last = slice(n - 1, n)
    got.append(layer(q_nope[last], q_pe[last], latent[last], k_pe[last], w, _meta(None, n, table)))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-10, atol=1e-10)
    rows = torch.cat((layer.key_cache, layer.value_cache), -1).view(-1, R + ROPE)
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    assert torch.equal(rows[slots], torch.cat((latent, k_pe), -1))  # the pool holds the latent itself


def test_an_odd_latent_and_a_quantized_pool_are_refused():
    with pytest.raises(UnsupportedModelError, match="odd"):
        LatentAttention(H, R + 1, NOPE, ROPE, V, SCALE)
    layer = _layer()
    layer.quantized_kv = None  # what the model runner sets for a float pool
    with pytest.raises(UnsupportedModelError, match="--kv-cache-dtype auto"):
        layer.quantized_kv = object()
