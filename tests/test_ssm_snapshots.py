"""The SSM snapshot pool's books: LRU eviction keeps every slot free or held exactly once,
and the integrity check catches a slot held twice or lost."""

import pytest

from metrale_jax.cache.ssm_snapshots import SnapshotPool


def test_eviction_keeps_the_books_balanced():
    pool = SnapshotPool([10, 11, 12])
    for i in range(20):  # more boundaries than slots: the least recently used go first
        slot = pool.reserve(bytes([i]))
        assert slot in (10, 11, 12)
        pool.check_integrity()
    assert pool.used == 3
    assert bytes([19]) in pool and bytes([0]) not in pool


def test_reserving_a_known_boundary_reuses_its_slot():
    pool = SnapshotPool([5, 6])
    first = pool.reserve(b"a")
    pool.reserve(b"b")
    assert pool.reserve(b"a") == first and pool.used == 2
    pool.check_integrity()


def test_integrity_check_catches_a_slot_held_twice_or_lost():
    pool = SnapshotPool([1, 2, 3])
    pool.reserve(b"a")
    pool._by_hash[b"b"] = pool._by_hash[b"a"]  # two boundaries in one slot
    with pytest.raises(AssertionError, match="out of balance"):
        pool.check_integrity()
    pool = SnapshotPool([1, 2, 3])
    pool._free.pop()  # a slot neither free nor held
    with pytest.raises(AssertionError, match="out of balance"):
        pool.check_integrity()
