"""The KV block pool and its prefix cache: accounting, prefix hits, eviction order, the
phase-7 reclaim, the integrity check, and a random-operation state machine. Host only."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from metrale_jax.cache import block_pool, prefix_hash
from metrale_jax.cache.block_pool import BlockPool, IntegrityError, OutOfBlocks
from metrale_jax.cache.prefix_hash import ROOT_HASH, hash_blocks

BS = 4


def _prefill(pool: BlockPool, tokens: list[int], adapter_id: int = 0) -> list[int]:
    """What a scheduler does for one prompt: reuse its cached prefix, allocate the rest,
    commit every full block (as if its KV had been computed and read back)."""
    match = pool.match_prefix(tokens, adapter_id)
    pool.acquire(match.blocks)
    table = match.blocks + pool.allocate(-(-len(tokens) // BS) - len(match.blocks))
    parent = ROOT_HASH
    for i in range(len(tokens) // BS):
        parent = pool.commit_block(table[i], parent, tokens[i * BS:(i + 1) * BS], adapter_id)
    return table


def test_allocation_and_release_accounting():
    pool = BlockPool(8, BS)
    assert (pool.num_usable, pool.num_free, pool.num_used, pool.num_cached) == (7, 7, 0, 0)
    a = pool.allocate(3)
    assert a == [1, 2, 3] and (pool.num_free, pool.num_used) == (4, 3)
    b = pool.allocate(4)
    assert not pool.can_allocate(1)
    with pytest.raises(OutOfBlocks, match="asked for 1 KV blocks: 0 free, 0 cached, 7 in use"):
        pool.allocate(1)
    pool.release(a)
    pool.free(b)  # the old name still works
    assert (pool.num_free, pool.num_used, pool.num_cached) == (7, 0, 0)
    pool.check_integrity({})
    with pytest.raises(ValueError, match="no reference"):
        pool.release(a)


def test_null_block_is_never_handed_out():
    pool = BlockPool(5, BS)
    for _ in range(3):
        blocks = pool.allocate(4)
        assert 0 not in blocks and sorted(blocks) == [1, 2, 3, 4]
        pool.release(blocks)
    with pytest.raises(ValueError):
        pool.release([0])
    with pytest.raises(ValueError):
        pool.commit_block(0, ROOT_HASH, [1, 2, 3, 4])


def test_shared_prompt_shares_blocks():
    pool = BlockPool(16, BS)
    prompt = list(range(10))  # two full blocks and a partial one
    a = _prefill(pool, prompt)
    b = _prefill(pool, prompt)
    assert b[:2] == a[:2] and b[2] != a[2]
    assert pool._refs[a[0]] == pool._refs[a[1]] == 2
    pool.check_integrity({"a": a, "b": b})
    assert pool.stats.prefix_queries == 2 and pool.stats.prefix_hit_tokens == 8


def test_match_leaves_one_token_to_compute():
    pool = BlockPool(16, BS)
    prompt = list(range(8))
    table = _prefill(pool, prompt)
    assert pool.match_prefix(prompt).blocks == table[:1]  # not both: 8 tokens, 2 blocks
    assert pool.match_prefix(prompt + [99]).blocks == table
    assert pool.match_prefix(prompt[:4]).num_tokens == 0
    assert pool.match_prefix([]).num_tokens == 0


def test_match_is_a_pure_query_and_hashes_chain():
    pool = BlockPool(16, BS)
    prompt = list(range(9))
    table = _prefill(pool, prompt)
    refs = list(pool._refs)
    match = pool.match_prefix(prompt)
    assert pool._refs == refs
    assert match.hashes == hash_blocks(prompt, BS, 0) and match.num_tokens == 8
    assert match.blocks == table[:2]


def test_adapter_id_separates_chains():
    pool = BlockPool(16, BS)
    prompt = list(range(9))
    _prefill(pool, prompt, adapter_id=1)
    assert pool.match_prefix(prompt, adapter_id=2).blocks == []
    assert len(pool.match_prefix(prompt, adapter_id=1).blocks) == 2


def test_same_block_other_parent_is_a_miss():
    pool = BlockPool(16, BS)
    _prefill(pool, [1, 1, 1, 1, 5, 5, 5, 5, 0])
    assert pool.match_prefix([2, 2, 2, 2, 5, 5, 5, 5, 0]).blocks == []


@pytest.mark.parametrize("digest", ["constant", "ignores_parent"])
def test_digest_collision_never_gives_a_false_hit(monkeypatch, digest):
    real = prefix_hash.hash_block

    def colliding(parent, tokens, adapter_id):
        return bytes(32) if digest == "constant" else real(ROOT_HASH, tokens, adapter_id)

    monkeypatch.setattr(prefix_hash, "hash_block", colliding)
    pool = BlockPool(32, BS)
    a = _prefill(pool, [1, 1, 1, 1, 7, 7, 7, 7, 0])
    b = _prefill(pool, [2, 2, 2, 2, 7, 7, 7, 7, 0])
    for prompt in ([1, 1, 1, 1, 7, 7, 7, 7, 0], [2, 2, 2, 2, 7, 7, 7, 7, 0], [3] * 9):
        for j, block in enumerate(pool.match_prefix(prompt).blocks):
            owner = a if block in a else b
            source = [1, 1, 1, 1, 7, 7, 7, 7] if owner is a else [2, 2, 2, 2, 7, 7, 7, 7]
            assert source[:(j + 1) * BS] == prompt[:(j + 1) * BS]
    pool.check_integrity({"a": a, "b": b})


def test_existing_mapping_wins_on_a_duplicate_commit():
    pool = BlockPool(16, BS)
    x, y = pool.allocate(2)
    h = pool.commit_block(x, ROOT_HASH, [1, 2, 3, 4])
    assert pool.commit_block(y, ROOT_HASH, [1, 2, 3, 4]) == h
    pool.release([x, y])
    assert (pool.num_cached, pool.num_free) == (1, 14)
    assert pool.match_prefix([1, 2, 3, 4, 5]).blocks == [x]
    pool.acquire([x])
    with pytest.raises(ValueError, match="final"):
        pool.commit_block(x, ROOT_HASH, [9, 9, 9, 9])


def test_num_free_excludes_cached_and_allocate_evicts_lru():
    pool = BlockPool(7, BS)  # 6 usable
    a = _prefill(pool, list(range(8)))             # 2 blocks, both committed
    b = _prefill(pool, list(range(100, 108)))      # 2 more
    pool.release(a)
    pool.release(b)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (2, 4, 0)
    assert pool.can_allocate(6) and not pool.can_allocate(7)
    # Released a then b, each tail first: a's tail goes first, b's head last.
    got = pool.allocate(4)
    assert got[2:] == [a[1], a[0]]
    assert pool.stats.evictions == 2
    assert pool.match_prefix(list(range(9))).blocks == []
    assert pool.match_prefix(list(range(100, 109))).blocks == b
    assert pool.allocate(1) == [b[1]]  # the tail before the head
    assert pool.match_prefix(list(range(100, 109))).blocks == b[:1]


def test_acquire_takes_a_cached_block_off_the_lru():
    pool = BlockPool(4, BS)
    table = _prefill(pool, list(range(5)))
    pool.release(table)
    match = pool.match_prefix(list(range(5)))
    pool.acquire(match.blocks)
    assert (pool.num_cached, pool.num_used) == (0, 1)
    assert pool.allocate(2) and not pool.can_allocate(1)  # the acquired block is not evictable
    with pytest.raises(ValueError, match="free"):
        BlockPool(4, BS).acquire([1])


def test_reclaim_spares_the_requests_own_prefix():
    pool = BlockPool(9, BS)  # 8 usable
    mine = list(range(12)) + [50]           # 3 full blocks to reuse
    other = list(range(200, 212))
    a = _prefill(pool, mine)                # 4 blocks
    b = _prefill(pool, other)               # 3 blocks
    pool.release(a)                         # a's tail, then its head, sit first in the LRU
    pool.release(b)
    assert (pool.num_free, pool.num_cached) == (2, 6)  # a's partial last block went free
    reclaim = pool.reclaim_prefix_blocks_for(mine, 0, min_blocks=7)
    assert reclaim.target == 4 and reclaim.reused_blocks == a[:3]
    assert pool.num_free == 4 and reclaim.evicted == 2
    assert pool.match_prefix(mine).blocks == a[:3]  # still cached: nothing of it evicted
    pool.check_integrity({})
    # Asking for more than can be evicted: everything else goes, the prefix still stays.
    reclaim = pool.reclaim_prefix_blocks_for(mine, 0, min_blocks=20)
    assert reclaim.target == 17 and pool.num_free == 5 and pool.num_cached == 3
    assert pool.match_prefix(mine).blocks == a[:3]


def test_reclaim_with_nothing_reused_counts_every_block():
    pool = BlockPool(9, BS)
    mine = list(range(12)) + [50]
    a = _prefill(pool, mine)
    pool.release(a)
    reclaim = pool.reclaim_prefix_blocks_for([], 0, min_blocks=8)  # asks for prompt logprobs
    assert reclaim.target == 8 and reclaim.reused_blocks == []
    assert pool.num_free == 8 and pool.match_prefix(mine).blocks == []
    assert pool.reclaim_prefix_blocks_for([], 0, 2) == block_pool.Reclaim(2, 0, [])


def test_usable_predicate_trims_the_match():
    pool = BlockPool(16, BS)
    prompt = list(range(13))
    table = _prefill(pool, prompt)
    hashes = hash_blocks(prompt, BS, 0)
    snapshots = {hashes[0]}  # a hybrid model kept an SSM state only after block 0
    match = pool.match_prefix(prompt, usable=snapshots.__contains__)
    assert match.blocks == table[:1] and match.hashes == hashes[:1]
    assert pool.match_prefix(prompt, usable=lambda h: False).blocks == []
    reclaim = pool.reclaim_prefix_blocks_for(prompt, 0, 4, usable=snapshots.__contains__)
    assert reclaim.target == 3


def test_disabled_prefix_cache():
    pool = BlockPool(8, BS, enable_prefix_cache=False)
    prompt = list(range(9))
    a = _prefill(pool, prompt)
    b = _prefill(pool, prompt)
    assert not set(a) & set(b)
    pool.release(a)
    assert pool.num_cached == 0 and pool.num_free == 4
    assert pool.match_prefix(prompt).blocks == []
    pool.check_integrity({"b": b})


def _corrupt(kind: str) -> tuple[BlockPool, dict]:
    pool = BlockPool(8, BS)
    a = _prefill(pool, list(range(9)))      # blocks 1, 2 committed; 3 not
    b = _prefill(pool, list(range(9)))      # shares 1, 2; owns 4
    c = _prefill(pool, list(range(100, 104)) + [0])
    pool.release(c)                         # 5 cached, 6 free
    tables = {"a": a, "b": b}
    pool.check_integrity(tables)
    if kind == "twice_in_table":
        tables["a"] = a + [a[0]]
    elif kind == "null_in_table":
        tables["a"] = a + [0]
    elif kind == "refcount":
        pool._refs[3] += 1
    elif kind == "shared_uncached":
        tables["b"] = b + [3]
        pool._refs[3] += 1
    elif kind == "free_and_used":
        pool._free.append(3)
    elif kind == "free_and_cached":
        pool._free.append(c[0])
    elif kind == "lost_block":
        pool._free.remove(7)
    elif kind == "lru_with_refs":
        pool._lru[4] = None
    elif kind == "hash_at_free_block":
        h = next(iter(pool._by_hash))
        pool._by_hash[h] = 7
    return pool, tables


@pytest.mark.parametrize("kind, message", [
    ("twice_in_table", "appears twice in one table"),
    ("null_in_table", "null block 0"),
    ("refcount", "refcount 2 but held by 1"),
    ("shared_uncached", "not in the prefix cache"),
    ("free_and_used", "both free and used"),
    ("free_and_cached", "both free and cached"),
    ("lost_block", r"free 1 \+ used 4 \+ cached 1 != 7"),
    ("lru_with_refs", "in the LRU has refcount"),
    ("hash_at_free_block", "points at free block 7"),
])
def test_integrity_check_catches(kind, message):
    pool, tables = _corrupt(kind)
    with pytest.raises(IntegrityError, match=message):
        pool.check_integrity(tables)


class PoolMachine(RuleBasedStateMachine):
    """Random scheduler traffic over a small vocabulary (so prompts share prefixes), checking
    the books after every step and that every prefix hit holds exactly the prompt's KV."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(13, BS)
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.committed: dict[int, int] = {}     # owner -> full blocks committed so far
        self.adapters: dict[int, int] = {}
        self.seen: list[list[int]] = []         # admitted prompts, whose prefixes may be cached
        self.kv: dict[int, tuple[int, ...]] = {}  # block -> the prefix its KV was computed for
        self.next_owner = 0

    prompts = st.lists(st.integers(0, 1), min_size=1, max_size=14)

    @rule(prompt=prompts, adapter=st.integers(0, 1), reuse=st.booleans())
    def admit(self, prompt, adapter, reuse):
        match = self.pool.match_prefix(prompt, adapter) if reuse else None
        matched = match.blocks if match else []
        for j, block in enumerate(matched):
            assert self.kv[block] == (adapter, *prompt[:(j + 1) * BS]), "false prefix hit"
        need = -(-len(prompt) // BS) - len(matched)
        self.pool.acquire(matched)  # first: acquiring takes matched blocks out of the LRU
        if not self.pool.can_allocate(need):
            self.pool.release(matched)
            return
        table = matched + self.pool.allocate(need)
        for j in range(len(matched), len(table)):
            self.kv[table[j]] = (adapter, *prompt[:(j + 1) * BS])
        owner, self.next_owner = self.next_owner, self.next_owner + 1
        self.tables[owner], self.tokens[owner] = table, prompt
        self.committed[owner], self.adapters[owner] = len(matched), adapter
        self.seen.append(prompt)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def commit(self, data):
        owner = data.draw(st.sampled_from(sorted(self.tables)))
        i, prompt = self.committed[owner], self.tokens[owner]
        if (i + 1) * BS > len(prompt):
            return
        adapter = self.adapters[owner]
        parent = hash_blocks(prompt, BS, adapter)[i - 1] if i else ROOT_HASH
        self.pool.commit_block(self.tables[owner][i], parent, prompt[i * BS:(i + 1) * BS],
                               adapter)
        self.committed[owner] = i + 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        owner = data.draw(st.sampled_from(sorted(self.tables)))
        self.pool.release(self.tables.pop(owner))
        del self.tokens[owner], self.committed[owner], self.adapters[owner]

    @rule(data=st.data(), adapter=st.integers(0, 1), min_blocks=st.integers(0, 14))
    def reclaim(self, data, adapter, min_blocks):
        # Often a prompt seen before: only then is there a cached prefix to spare.
        seen = st.sampled_from(self.seen) if self.seen else self.prompts
        prompt = data.draw(st.one_of(seen, self.prompts))
        spared = self.pool.match_prefix(prompt, adapter).blocks
        free_before, cached_before = self.pool.num_free, self.pool.num_cached
        result = self.pool.reclaim_prefix_blocks_for(prompt, adapter, min_blocks)
        assert result.reused_blocks == spared
        assert result.target == max(0, min_blocks - len(spared))
        assert self.pool.match_prefix(prompt, adapter).blocks == spared
        assert self.pool.num_free == free_before + result.evicted
        assert self.pool.num_cached == cached_before - result.evicted
        if self.pool.num_free < result.target:  # stopped early only for want of victims
            assert set(self.pool._lru) <= set(spared)

    @invariant()
    def books_balance(self):
        self.pool.check_integrity(self.tables)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
