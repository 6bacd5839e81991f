"""Kernels for llmctl: each Triton kernel sits beside a pure-torch reference with the same signature.

The torch references are the CPU path of the engine and the oracle of the kernel tests.
Tensor layout conventions shared by every kernel:

- paged KV cache (one per layer, per K and V): ``[num_blocks, block_size, num_kv_heads, head_dim]``
- ``slot_mapping[t] = block_id * block_size + offset`` (``-1`` = skip, used for padding)
- ``block_tables``: ``[num_seqs, max_blocks_per_seq]`` int32, padded with any valid block id
- ``seq_lens``: ``[num_seqs]`` int32, the number of KV tokens each sequence attends to
  (its cached prefix plus the tokens of this step, whose K/V were stored before attention)
- ``query_start_loc``: ``[num_seqs + 1]`` int32, cumulative query lengths of a varlen batch
"""
