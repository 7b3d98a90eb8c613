"""KV block pool with a prefix cache, and the SSM slot pool (host only, no jax).

Block 0 and slot 0 are the null entries padding points at; they are never handed out.

Every usable KV block is in exactly one of three states:
  free   -- on the free list: no hash, no references;
  used   -- referenced by that many block tables (the caller owns tables, the pool owns refs);
  cached -- unreferenced, but its KV and hash are kept in an LRU list so a later prompt with
            the same prefix can reuse it, until `allocate` or `reclaim_prefix_blocks_for`
            evicts it.
`num_free` counts only free blocks, so it can read near zero while many blocks are
reclaimable; `can_allocate` counts both. Queries (`can_allocate`, `match_prefix`,
`peek_prefix`, `cached_block`) never change state; `allocate`, `acquire`, `release`,
`commit_block` and the reclaim do. A cached block evicted to be reused is first offered
to `on_evict` (the prefix tier copies its KV off the device) while its contents are intact.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from metrale_jax.cache import prefix_hash
from metrale_jax.cache.prefix_hash import ROOT_HASH, BlockHash


class OutOfBlocks(RuntimeError):
    pass


class IntegrityError(RuntimeError):
    """The pool's books disagree with themselves or with the block tables: a bug, never load."""


@dataclass(frozen=True)
class BlockKey:
    """A cached block's full key, compared on a hit so a digest collision is only a miss."""
    block_hash: BlockHash
    parent_hash: BlockHash
    tokens: tuple[int, ...]
    adapter_id: int


@dataclass
class PrefixMatch:
    blocks: list[int]          # cached blocks holding the prompt's prefix, in table order
    hashes: list[BlockHash]    # their chain hashes; hashes[-1] is the next block's parent
    num_tokens: int            # len(blocks) * block_size: prompt tokens needing no compute


@dataclass
class Reclaim:
    target: int                # free blocks the request needs beyond its reused prefix
    evicted: int               # cached blocks this call moved to the free list
    reused_blocks: list[int]   # the request's cached prefix, which was spared


@dataclass
class PoolStats:
    """Counters for telemetry; they only ever grow."""
    prefix_queries: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up
    prefix_hit_tokens: int = 0    # of those, tokens found cached
    evictions: int = 0            # cached blocks whose hash was dropped to reuse the block


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_cache: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 2 (block 0 is the null block) "
                             f"and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.stats = PoolStats()
        # Popped from the end, so low ids are handed out first (easier to read in tests).
        self._free: list[int] = list(range(self.num_blocks - 1, 0, -1))
        self._refs: list[int] = [0] * self.num_blocks
        self._entries: dict[int, BlockKey] = {}        # block -> key, cached or used
        self._by_hash: dict[BlockHash, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, first out first
        # Called with each batch of evicted (block, key) pairs before the blocks are
        # handed on (None: evicted contents are gone).
        self.on_evict: Callable[[list[tuple[int, BlockKey]]], None] | None = None

    # -- counts -------------------------------------------------------------------------

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free - self.num_cached

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free + self.num_cached

    # -- references -----------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref 1: free ones first, then the least recently used cached."""
        if not self.can_allocate(n):
            raise OutOfBlocks(f"asked for {n} KV blocks: {self.num_free} free, "
                              f"{self.num_cached} cached, {self.num_used} in use")
        from_free = min(n, self.num_free)
        taken = self._free[self.num_free - from_free:][::-1]
        del self._free[self.num_free - from_free:]
        taken += self._evict_offered(itertools.islice(self._lru, n - from_free))
        for block in taken:
            self._refs[block] = 1
        return taken

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each block: a prefix hit joins a table to cached blocks."""
        for block in blocks:
            self._check_id(block)
            if self._refs[block] == 0:
                if block not in self._lru:
                    raise ValueError(f"acquire: block {block} is free; only used or cached "
                                     f"blocks can be shared")
                del self._lru[block]
            self._refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block of a table; unreferenced ones become cached or free."""
        # Deepest block first: it lands nearer the LRU head, so eviction trims a cached
        # sequence from its tail and the surviving head still matches.
        for block in reversed(blocks):
            self._check_id(block)
            if self._refs[block] <= 0:
                raise ValueError(f"release: block {block} has no reference to drop")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._entries:
                    self._lru[block] = None
                else:
                    self._free.append(block)

    free = release  # the name engine.py used before there was a prefix cache

    # -- prefix cache -----------------------------------------------------------------------

    def commit_block(self, block: int, parent_hash: BlockHash, tokens: Sequence[int],
                     adapter_id: int = 0) -> BlockHash:
        """Offers a full block for reuse; returns its chain hash (the next block's parent).

        Only for a block whose KV is computed and whose tokens are final: a token still on
        the device (not yet read back) may be rolled back, and its KV would then be wrong.
        If the hash already names another block, that one stays cached: tables point at it.
        """
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) != self.block_size:
            raise ValueError(f"commit_block: {len(tokens)} tokens, a full block has "
                             f"{self.block_size}")
        block_hash = prefix_hash.hash_block(parent_hash, tokens, adapter_id)
        if not self.enable_prefix_cache:
            return block_hash
        self._check_id(block)
        if self._refs[block] == 0:
            raise ValueError(f"commit_block: block {block} is not held by any table")
        entry = BlockKey(block_hash, parent_hash, tokens, adapter_id)
        old = self._entries.get(block)
        if old is not None and old != entry:
            raise ValueError(f"commit_block: block {block} was committed with other tokens; "
                             f"a full block's tokens are final")
        if old is None and block_hash not in self._by_hash:
            self._entries[block] = entry
            self._by_hash[block_hash] = block
        return block_hash

    def match_prefix(self, tokens: Sequence[int], adapter_id: int = 0,
                     usable: Callable[[BlockHash], bool] | None = None) -> PrefixMatch:
        """The longest cached prefix of a prompt; the caller `acquire`s what it uses.

        At least one prompt token is left out, since prefill must run to produce the first
        logits. `usable` (a hybrid model's "is there an SSM snapshot at this block") trims the
        match back to the longest prefix whose last block passes it.
        """
        match = self._match(tokens, adapter_id, usable)
        self.stats.prefix_queries += 1
        self.stats.prefix_query_tokens += len(tokens)
        self.stats.prefix_hit_tokens += match.num_tokens
        return match

    def peek_prefix(self, tokens: Sequence[int], adapter_id: int = 0) -> PrefixMatch:
        """What `match_prefix` would find on the device, without counting a query."""
        return self._match(tokens, adapter_id, None)

    def reclaim_prefix_blocks_for(self, reused_tokens: Sequence[int], adapter_id: int,
                                  min_blocks: int,
                                  usable: Callable[[BlockHash], bool] | None = None) -> Reclaim:
        """Evicts cached blocks to the free list until a new request's blocks fit (phase 7).

        The request's own cached prefix (what its prefill will reuse) is neither counted in
        the target nor evicted: evicting it would only make the request recompute it.
        Pass [] for a request that reuses nothing (it asks for prompt logprobs). The caller
        spills live sequences while `num_free < target`.
        """
        match = self._match(reused_tokens, adapter_id, usable)
        target = max(0, min_blocks - len(match.blocks))
        spared = set(match.blocks)
        victims = itertools.islice((b for b in self._lru if b not in spared),
                                   max(0, target - self.num_free))
        evicted = self._evict_offered(victims)
        self._free.extend(evicted)
        return Reclaim(target, len(evicted), match.blocks)

    def forget_cached(self) -> int:
        """Evict every unreferenced cached block to the free list (their KV is gone: the
        device caches were re-allocated); returns how many."""
        evicted = [self._evict(block) for block in list(self._lru)]
        self._free.extend(evicted)
        return len(evicted)

    def _match(self, tokens: Sequence[int], adapter_id: int,
               usable: Callable[[BlockHash], bool] | None) -> PrefixMatch:
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        if self.enable_prefix_cache:
            bs, parent = self.block_size, ROOT_HASH
            for start in range(0, max(len(tokens) - 1, 0) // bs * bs, bs):
                chunk = tuple(int(t) for t in tokens[start:start + bs])
                block_hash = prefix_hash.hash_block(parent, chunk, adapter_id)
                block = self._by_hash.get(block_hash)
                if block is None or self._entries[block] != BlockKey(block_hash, parent, chunk,
                                                                    adapter_id):
                    break
                blocks.append(block)
                hashes.append(block_hash)
                parent = block_hash
        while usable is not None and hashes and not usable(hashes[-1]):
            blocks.pop()
            hashes.pop()
        return PrefixMatch(blocks, hashes, len(blocks) * self.block_size)

    def cached_block(self, block_hash: BlockHash, key: BlockKey) -> int | None:
        """The block holding exactly `key` (cached or used), if any."""
        block = self._by_hash.get(block_hash) if self.enable_prefix_cache else None
        return block if block is not None and self._entries[block] == key else None

    def _evict_offered(self, blocks) -> list[int]:
        """Evict `blocks` (an iterable over the LRU: materialised first), offering them
        and their keys to `on_evict` before anyone can write to them."""
        blocks = list(blocks)
        keys = [self._entries[b] for b in blocks]
        evicted = [self._evict(block) for block in blocks]
        if self.on_evict is not None and evicted:
            self.on_evict(list(zip(evicted, keys)))
        return evicted

    def _evict(self, block: int) -> int:
        """Forgets an unreferenced cached block's hash; the caller hands the block on."""
        del self._lru[block]
        del self._by_hash[self._entries.pop(block).block_hash]
        self.stats.evictions += 1
        return block

    def _check_id(self, block: int) -> None:
        if not 0 < block < self.num_blocks:
            raise ValueError(f"block {block} is not a usable block id (1..{self.num_usable})")

    # -- integrity --------------------------------------------------------------------------

    def check_integrity(self, tables: Mapping[Hashable, Sequence[int]]) -> None:
        """Raises IntegrityError at the first disagreement between the books and the tables.

        Tests run it after every step and the engine on idle ticks: a leak or a double
        reference shows up where it happens, not as another sequence's garbage KV later.
        """
        held = self._check_tables(tables)
        self._check_refs(held)
        self._check_states()
        self._check_hashes()

    def _check_tables(self, tables: Mapping[Hashable, Sequence[int]]) -> Counter[int]:
        held: Counter[int] = Counter()
        for owner, table in tables.items():
            seen: set[int] = set()
            for index, block in enumerate(table):
                if block == 0:
                    raise IntegrityError(f"{owner!r}: null block 0 at table index {index}")
                if not 0 < block < self.num_blocks:
                    raise IntegrityError(f"{owner!r}: block id {block} out of range")
                if block in seen:
                    raise IntegrityError(f"{owner!r}: block {block} appears twice in one table")
                seen.add(block)
            held.update(seen)
        return held

    def _check_refs(self, held: Counter[int]) -> None:
        if self._refs[0] != 0:
            raise IntegrityError(f"null block 0 has refcount {self._refs[0]}")
        for block in range(1, self.num_blocks):
            if self._refs[block] != held[block]:
                raise IntegrityError(f"block {block}: refcount {self._refs[block]} but held by "
                                     f"{held[block]} tables")
            if held[block] > 1 and block not in self._entries:
                raise IntegrityError(f"block {block} is shared by {held[block]} tables but "
                                     f"is not in the prefix cache")

    def _check_states(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a block is on the free list twice")
        if 0 in free:
            raise IntegrityError("null block 0 is on the free list")
        used = {b for b in range(1, self.num_blocks) if self._refs[b] > 0}
        cached = set(self._lru)
        if free & used:
            raise IntegrityError(f"blocks both free and used: {sorted(free & used)}")
        if free & cached:
            raise IntegrityError(f"blocks both free and cached: {sorted(free & cached)}")
        for block in self._lru:
            if self._refs[block] > 0:
                raise IntegrityError(f"cached block {block} in the LRU has refcount "
                                     f"{self._refs[block]}")
            if block not in self._entries:
                raise IntegrityError(f"block {block} is in the LRU but has no hash")
        if len(free) + len(used) + len(cached) != self.num_usable:
            raise IntegrityError(f"free {len(free)} + used {len(used)} + cached {len(cached)} "
                                 f"!= {self.num_usable} usable blocks")

    def _check_hashes(self) -> None:
        free = set(self._free)
        for block_hash, block in self._by_hash.items():
            if block in free:
                raise IntegrityError(f"hash {block_hash.hex()[:12]} points at free block {block}")
            entry = self._entries.get(block)
            if entry is None or entry.block_hash != block_hash:
                raise IntegrityError(f"hash {block_hash.hex()[:12]} points at block {block}, "
                                     f"which is keyed otherwise")
        if len(self._entries) != len(self._by_hash):
            raise IntegrityError(f"{len(self._entries)} keyed blocks but {len(self._by_hash)} "
                                 f"hashes")


class SlotPool:
    """SSM state slots, one per running sequence of a model with Mamba2 layers."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks("no free SSM slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
