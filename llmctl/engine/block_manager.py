"""Physical KV blocks: allocation, reference counts, prefix caching and copy-on-write.

A block's life::

    free ──allocate──> owned (ref 1) ──fork / prefix hit──> shared (ref n)
      ^                    │ full: registered in the prefix cache under its chained key
      │                    v
      └──evict (LRU)── cached (ref 0, content kept) <──last owner releases── shared/owned
                           └──prefix hit──> owned again (no recompute)

A full block's cache key is ``(hash of the previous block's key, its token ids)``, so a hit means
the whole prefix up to and including that block matches (the dict compares the token ids; only
the parent link relies on a hash); the first block's parent is the KV cache dtype, so a cache key
never matches blocks stored in another format. Only full blocks are cached, and they are never written
again, so sharing them needs no copy. The one block that can be shared *and* written is the
partial last block of ``n > 1`` samples forked from one prompt: the first sharer to write into it
gets a private copy (copy-on-write), recorded in ``pending_copies`` for the model runner.

``cache_group`` (KIVI's residual window, in blocks) makes the prefix cache work in whole groups of
blocks: a block is registered only once its group is complete (the KIVI pool quantizes the group
then, and only then is its content final), and a hit is cut to whole groups, so a request that
adopts cached blocks starts at a group boundary, where none of them is read in full precision.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmctl.engine.sequence import Sequence

CacheKey = tuple[int | str, tuple[int, ...]]


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    cache_key: CacheKey | None = None  # set while the block's content is findable in the prefix cache


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        *,
        on_release: Callable[[int], None] | None = None,
        cache_group: int = 1,
    ) -> None:
        """``on_release``: called with a block id when its last owner lets go (the quantized KV pool
        frees the block's full-precision residual slot then, before the block can be handed out
        again). ``cache_group``: blocks per prefix-cache unit (KIVI: the residual window's blocks)."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        if cache_group < 1:
            raise ValueError("a prefix-cache group holds at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_uncached: deque[int] = deque(range(num_blocks))  # ref 0, nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached content, LRU first
        self.cache: dict[CacheKey, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, drained each step
        self.num_blocks_touched = 0  # 1 + the highest block id ever handed out
        self.num_evictions = 0
        self.num_copies = 0
        self.kv_cache_dtype = kv_cache_dtype  # the prefix-cache hash chain starts from it
        self.on_release = on_release
        self.cache_group = cache_group

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-evictable blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """The longest run of cached blocks matching the sequence's leading tokens. At least one
        token is always left to compute, because its logits are needed to sample."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | str = self.kv_cache_dtype
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            key = (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            block_id = self.cache.get(key)
            if block_id is None:
                break
            hits.append(block_id)
            parent = hash(key)
        return hits[: len(hits) - len(hits) % self.cache_group]

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after adopting ``cached_prefix``
        if the sequence holds no blocks yet). Returns False, changing nothing, when the pool is short."""
        adopt = list(cached_prefix) if not seq.block_table else []
        num_computed = seq.num_computed_tokens + len(adopt) * self.block_size
        held = len(seq.block_table) + len(adopt)
        num_new_blocks = max(0, self.blocks_needed(num_computed + num_new_tokens) - held)
        write_index = num_computed // self.block_size
        needs_copy = write_index < len(seq.block_table) and self.blocks[seq.block_table[write_index]].ref_count > 1
        reclaimed = sum(1 for b in adopt if self.blocks[b].ref_count == 0)
        if num_new_blocks + needs_copy + reclaimed > self.num_free_blocks:
            return False
        for block_id in adopt:
            self._acquire(block_id)
            seq.block_table.append(block_id)
        if adopt:
            seq.num_computed_tokens = num_computed
        if needs_copy:
            src = seq.block_table[write_index]
            dst = self._take_free()
            self.pending_copies.append((src, dst))
            self.num_copies += 1
            self.blocks[src].ref_count -= 1
            seq.block_table[write_index] = dst
        seq.block_table.extend(self._take_free() for _ in range(num_new_blocks))
        return True

    def release_tail(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens: the lookahead slots of rejected draft
        tokens (speculative decoding). They were never computed, so none is in the prefix cache."""
        keep = self.blocks_needed(seq.num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_uncached.append(block_id)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent, including the partial last one."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Its tail goes back first, so under pressure the cache evicts
        a prefix's end before its start (a start is what other requests share)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if self.on_release is not None:
                    self.on_release(block_id)
                if block.cache_key is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_uncached.append(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed (fully computed) blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs, group = self.block_size, self.cache_group
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // (bs * group) * group):
            parent = seq.block_hashes[-1] if i else self.kv_cache_dtype
            key = (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            seq.block_hashes.append(hash(key))
            block = self.blocks[seq.block_table[i]]
            if block.cache_key is None and key not in self.cache:
                block.cache_key = key
                self.cache[key] = block.block_id

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        if self.free_uncached:
            block_id = self.free_uncached.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cache[block.cache_key]
            block.cache_key = None
            self.num_evictions += 1
        self.blocks[block_id].ref_count = 1
        self.num_blocks_touched = max(self.num_blocks_touched, block_id + 1)
        return block_id

    # ---- introspection -----------------------------------------------------------------------
    def block_states(self) -> str:
        """One character per block: ``.`` free, ``c`` cached (evictable), ``u`` used by one
        sequence, ``s`` shared by several."""
        chars = []
        for block in self.blocks:
            if block.ref_count > 1:
                chars.append("s")
            elif block.ref_count == 1:
                chars.append("u")
            else:
                chars.append("c" if block.cache_key is not None else ".")
        return "".join(chars)

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless every block is accounted for exactly once."""
        owners = [0] * self.num_blocks
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq.seq_id} holds a block twice"
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, "computed tokens without blocks"
            for block_id in seq.block_table:
                owners[block_id] += 1
        free_ids = set(self.free_uncached)
        assert len(free_ids) == len(self.free_uncached), "a block is free twice"
        assert not free_ids & set(self.evictable), "a block is both free and evictable"
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} but {owners[block.block_id]} owners"
            )
            is_free = block.block_id in free_ids or block.block_id in self.evictable
            assert is_free == (block.ref_count == 0), f"block {block.block_id} free={is_free} ref={block.ref_count}"
            if block.block_id in self.evictable:
                assert block.cache_key is not None, f"evictable block {block.block_id} has no cached content"
            if block.block_id in free_ids:
                assert block.cache_key is None, f"free block {block.block_id} still registered in the cache"
            if block.cache_key is not None:
                assert self.cache.get(block.cache_key) == block.block_id, f"cache map lost block {block.block_id}"
        assert len(self.cache) == sum(b.cache_key is not None for b in self.blocks), "stale cache entries"
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + self.num_free_blocks == self.num_blocks, "free + used != total"
