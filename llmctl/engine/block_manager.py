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
never matches blocks stored in another format, and the sequence's LoRA adapter, so requests on
different adapters (or on the base model) never share blocks. Only full blocks are cached, and
they are never written again, so sharing them needs no copy. The one block that can be shared *and* written is the
partial last block of ``n > 1`` samples forked from one prompt: the first sharer to write into it
gets a private copy (copy-on-write), recorded in ``pending_copies`` for the model runner.

``cache_group`` (KIVI's residual window, in blocks) makes the prefix cache work in whole groups of
blocks: a block is registered only once its group is complete (the KIVI pool quantizes the group
then, and only then is its content final), and a hit is cut to whole groups, so a request that
adopts cached blocks starts at a group boundary, where none of them is read in full precision.

**KV-cache groups** (``group_windows``; vLLM's hybrid allocator). The model runner groups the
attention layers by kind -- full attention, or each distinct sliding window -- in groups of equal
layer count, so every group's block has the same bytes and all groups draw from this one pool of
block ids (a block belongs to one group at a time; its K/V slots are the group's layers).
A sequence holds one block table per group (``Sequence.block_tables``; group 0 is full attention
when the model has any). A sliding group of window W keeps only the blocks some future query can
still see: once ``num_computed_tokens`` = c, the next query is at c and sees keys > c - W, so the
blocks wholly before c - W + 1 go back to the pool the next time the sequence is allocated for
(prefill chunk or decode) and their table entries become ``NULL_BLOCK`` (the kernels index the
table by position and never read an entry outside the window unmasked). Prefix caching is per
group (a block's key lives in its group's map); a hit is the longest prefix every group can
serve: full groups need every block of it, a sliding group only the blocks within the window of
the first token left to compute (``find_cached_prefix``). Without windows there is one group and
everything is as before.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmctl.engine.sequence import Sequence

CacheKey = tuple[int | str, tuple[int, ...]]
NULL_BLOCK = -1  # a sliding group's table entry for a block no future query sees (released)


def blocks_per_seq(group_windows: Iterable[int | None], block_size: int, num_tokens: int, chunk: int) -> int:
    """The most blocks one sequence of ``num_tokens`` tokens holds at once over all KV-cache groups,
    computing at most ``chunk`` tokens a step: a full group all of its blocks, a sliding group of
    window W those from its window's first key to the chunk's last token, at most
    ``(W + chunk - 2) // block_size + 2`` (``ceil(W / block_size) + 1`` for a decode)."""
    full = -(-num_tokens // block_size)
    total = 0
    for window in group_windows:
        if window is None:
            total += full
        else:
            total += min(full, (window + min(chunk, num_tokens) - 2) // block_size + 2)
    return total


@dataclass
class PrefixHit:
    """A prefix-cache hit: ``num_blocks`` leading blocks of the sequence, and for each KV-cache group
    the blocks to adopt (``NULL_BLOCK`` where a sliding group needs none)."""

    num_blocks: int
    tables: list[list[int]]

    def __len__(self) -> int:
        return self.num_blocks


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    cache_key: CacheKey | None = None  # set while the block's content is findable in the prefix cache
    group: int = 0  # the KV-cache group whose prefix-cache map holds ``cache_key``


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
        group_windows: Iterable[int | None] = (None,),
    ) -> None:
        """``on_release``: called with a block id when its last owner lets go (the quantized KV pool
        frees the block's full-precision residual slot then, before the block can be handed out
        again). ``cache_group``: blocks per prefix-cache unit (KIVI: the residual window's blocks).
        ``group_windows``: each KV-cache group's sliding window in tokens (None: full attention)."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        if cache_group < 1:
            raise ValueError("a prefix-cache group holds at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_uncached: deque[int] = deque(range(num_blocks))  # ref 0, nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached content, LRU first
        self.group_windows: list[int | None] = list(group_windows)
        if not self.group_windows or any(w is not None and w < 1 for w in self.group_windows):
            raise ValueError("every KV-cache group needs a window of at least one token, or None")
        self.num_groups = len(self.group_windows)
        self.caches: list[dict[CacheKey, int]] = [{} for _ in self.group_windows]  # per group: key -> block
        self.cache = self.caches[0]
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

    def num_dead_blocks(self, group: int, num_computed: int) -> int:
        """Leading blocks of group ``group`` that no query at position ``num_computed`` or later
        sees (0 for full attention): those wholly before ``num_computed - window + 1``."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, (num_computed - window + 1) // self.block_size)

    def max_blocks_per_seq(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds at once over all groups
        (``blocks_per_seq``)."""
        return blocks_per_seq(self.group_windows, self.block_size, num_tokens, chunk)

    def held_blocks(self, seq: Sequence, group: int | None = None) -> int:
        """Blocks ``seq`` holds (in one group, or in all)."""
        groups = range(len(seq.block_tables)) if group is None else [group]
        return sum(1 for g in groups if g < len(seq.block_tables) for b in seq.block_tables[g] if b != NULL_BLOCK)

    def chain_root(self, seq: Sequence) -> str:
        """The first block's parent in the hash chain: the KV dtype and the LoRA adapter (its id:
        a name loaded again is another adapter)."""
        return self.kv_cache_dtype if seq.lora is None else f"{self.kv_cache_dtype}+lora{seq.lora.id}"

    def find_cached_prefix(self, seq: Sequence) -> list[int] | PrefixHit:
        """The longest run of cached blocks matching the sequence's leading tokens. At least one
        token is always left to compute, because its logits are needed to sample. With several
        KV-cache groups: a ``PrefixHit``, the longest prefix that every group can serve."""
        if self.num_groups > 1 or self.group_windows[0] is not None:
            return self._find_hit(seq)
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | str = self.chain_root(seq)
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            key = (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            block_id = self.cache.get(key)
            if block_id is None:
                break
            hits.append(block_id)
            parent = hash(key)
        return hits[: len(hits) - len(hits) % self.cache_group]

    def _find_hit(self, seq: Sequence) -> PrefixHit:
        if not self.enable_prefix_caching:
            return PrefixHit(0, [[] for _ in self.group_windows])
        bs = self.block_size
        full = [self.caches[g] for g, w in enumerate(self.group_windows) if w is None]
        keys: list[CacheKey] = []
        parent: int | str = self.chain_root(seq)
        for i in range((seq.num_tokens - 1) // bs):  # full groups need every block of the hit
            key = (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            if any(key not in cache for cache in full):
                break
            keys.append(key)
            parent = hash(key)
        hit = len(keys) - len(keys) % self.cache_group
        while True:  # a sliding group may serve a shorter prefix only: shrink until every group agrees
            shorter = hit
            for g, window in enumerate(self.group_windows):
                if window is not None:
                    shorter = self._sliding_hit(g, keys, shorter)
            shorter -= shorter % self.cache_group
            if shorter == hit:
                break
            hit = shorter
        tables = []
        for g, cache in enumerate(self.caches):
            dead = self.num_dead_blocks(g, hit * bs)
            tables.append([NULL_BLOCK] * dead + [cache[key] for key in keys[dead:hit]])
        return PrefixHit(hit, tables)

    def _sliding_hit(self, group: int, keys: list[CacheKey], most: int) -> int:
        """The longest hit of at most ``most`` blocks that sliding group ``group`` can serve: the
        blocks within the window of the first token to compute are all cached."""
        cache, run, runs = self.caches[group], 0, []
        for key in keys[:most]:
            run = run + 1 if key in cache else 0
            runs.append(run)
        for hit in range(most, 0, -1):
            if runs[hit - 1] >= hit - self.num_dead_blocks(group, hit * self.block_size):
                return hit
        return 0

    # ---- allocation --------------------------------------------------------------------------
    def _tables(self, seq: Sequence) -> list[list[int]]:
        tables = seq.block_tables
        while len(tables) < self.num_groups:
            tables.append([])
        return tables

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] | PrefixHit = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after adopting ``cached_prefix``
        if the sequence holds no blocks yet) in every KV-cache group, first giving back the blocks
        its sliding groups no longer see. Returns False, changing nothing else, when the pool is
        short."""
        if self.num_groups > 1 or self.group_windows[0] is not None or isinstance(cached_prefix, PrefixHit):
            return self._allocate_groups(seq, num_new_tokens, cached_prefix)
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
            self._copy_on_write(seq.block_table, write_index)
        seq.block_table.extend(self._take_free() for _ in range(num_new_blocks))
        return True

    def _allocate_groups(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] | PrefixHit) -> bool:
        tables = self._tables(seq)
        if isinstance(cached_prefix, PrefixHit):
            num_hit, adopt_tables = cached_prefix.num_blocks, cached_prefix.tables
        else:
            num_hit, adopt_tables = len(cached_prefix), [list(cached_prefix)]
        if any(tables):
            num_hit = 0
            self.release_dead(seq)
        num_computed = seq.num_computed_tokens + num_hit * self.block_size
        write_index = num_computed // self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens)
        plan = []
        total = 0
        for g, table in enumerate(tables):
            adopt = adopt_tables[g] if num_hit else []
            num_new_blocks = max(0, needed - len(table) - len(adopt))
            needs_copy = write_index < len(table) and self.blocks[table[write_index]].ref_count > 1
            reclaimed = sum(1 for b in adopt if b != NULL_BLOCK and self.blocks[b].ref_count == 0)
            total += num_new_blocks + needs_copy + reclaimed
            plan.append((adopt, num_new_blocks, needs_copy))
        if total > self.num_free_blocks:
            return False
        for table, (adopt, num_new_blocks, needs_copy) in zip(tables, plan):
            for block_id in adopt:
                if block_id != NULL_BLOCK:
                    self._acquire(block_id)
                table.append(block_id)
            if needs_copy:
                self._copy_on_write(table, write_index)
            table.extend(self._take_free() for _ in range(num_new_blocks))
        if num_hit:
            seq.num_computed_tokens = num_computed
        return True

    def release_dead(self, seq: Sequence) -> int:
        """Give back the blocks of ``seq``'s sliding groups that no query from its next token on
        sees; their entries become ``NULL_BLOCK``. Returns how many were released."""
        released = 0
        for g, table in enumerate(seq.block_tables):
            dead = min(self.num_dead_blocks(g, seq.num_computed_tokens), len(table))
            first = dead
            while first > 0 and table[first - 1] != NULL_BLOCK:
                first -= 1
            for i in range(first, dead):  # oldest first: the first to be evicted
                self._release(table[i])
                table[i] = NULL_BLOCK
                released += 1
        return released

    def _copy_on_write(self, table: list[int], index: int) -> None:
        src = table[index]
        dst = self._take_free()
        self.pending_copies.append((src, dst))
        self.num_copies += 1
        self.blocks[src].ref_count -= 1
        table[index] = dst

    def release_tail(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens: the lookahead slots of rejected draft
        tokens (speculative decoding). They were never computed, so none is in the prefix cache."""
        keep = self.blocks_needed(seq.num_tokens)
        for table in seq.block_tables:
            for block_id in reversed(table[keep:]):
                block = self.blocks[block_id]
                block.ref_count -= 1
                if block.ref_count == 0:
                    self.free_uncached.append(block_id)
            del table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent, including the partial last one."""
        for table in parent.block_tables:
            for block_id in table:
                if block_id != NULL_BLOCK:
                    self.blocks[block_id].ref_count += 1
        child.block_tables = [list(table) for table in parent.block_tables]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Its tail goes back first, so under pressure the cache evicts
        a prefix's end before its start (a start is what other requests share)."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if self.on_release is not None:
                self.on_release(block_id)
            if block.cache_key is not None:
                self.evictable[block_id] = None
            else:
                self.free_uncached.append(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed (fully computed) blocks in the prefix cache (of
        every group that still holds them)."""
        if not self.enable_prefix_caching:
            return
        bs, group = self.block_size, self.cache_group
        tables = seq.block_tables
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // (bs * group) * group):
            parent = seq.block_hashes[-1] if i else self.chain_root(seq)
            key = (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            seq.block_hashes.append(hash(key))
            for g, table in enumerate(tables):
                block_id = table[i]
                if block_id == NULL_BLOCK:
                    continue
                block = self.blocks[block_id]
                cache = self.caches[g]
                if block.cache_key is None and key not in cache:
                    block.cache_key, block.group = key, g
                    cache[key] = block_id

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
            del self.caches[block.group][block.cache_key]
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
            assert len(seq.block_tables) in (1, self.num_groups), f"seq {seq.seq_id}: tables of other groups"
            for g, table in enumerate(seq.block_tables):
                if not table:
                    continue
                live = [b for b in table if b != NULL_BLOCK]
                assert len(set(live)) == len(live), f"seq {seq.seq_id} holds a block twice"
                assert len(table) * self.block_size >= seq.num_computed_tokens, "computed tokens without blocks"
                dead = table.count(NULL_BLOCK)
                assert table[:dead] == [NULL_BLOCK] * dead, f"seq {seq.seq_id}: a released block past a held one"
                assert dead <= self.num_dead_blocks(g, seq.num_computed_tokens), (
                    f"seq {seq.seq_id}, group {g}: released a block a query still sees"
                )
                for block_id in live:
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
                assert self.caches[block.group].get(block.cache_key) == block.block_id, (
                    f"cache map lost block {block.block_id}"
                )
        assert sum(map(len, self.caches)) == sum(b.cache_key is not None for b in self.blocks), "stale cache entries"
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + self.num_free_blocks == self.num_blocks, "free + used != total"
