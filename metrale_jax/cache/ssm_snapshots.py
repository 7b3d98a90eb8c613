"""SSM snapshot slots: a hybrid model's recurrent state at prefix-cache block boundaries.

A KV prefix hit alone cannot skip a Mamba2 layer's work: its state after the prefix is
needed too. When a step ends a sequence exactly on a full block (a prefill chunk cut there,
or a decode token that fills a block), its conv/SSM state is copied into a snapshot slot; a
later request whose cached prefix ends at the same block copies it back instead of
recomputing. The pool is small and evicts least-recently-used snapshots (peers found dense
snapshots crowding out the pool).

Every slot is in exactly one of these states:
  free    -- on the free list;
  held    -- owned by one owner, not matchable, never evicted; at most one per owner.
             A sequence holds its state at a boundary whose block hash is not known yet (a
             pipelined decode: the token that filled the block is still on the device) until
             `publish` keys it; a session holds its latest turn's state at its last token
             (off the block grid) for its next turn. `drop_held` frees it.
  cached  -- keyed by a block hash, in the LRU; taking a slot evicts the least recent one.
Queries (`__contains__`, `held_at`, `held_slot`, counts) never change state; `lookup` only
refreshes the LRU order. A cached snapshot evicted to free its slot is first offered to
`on_evict` (the prefix tier copies it off the device), while the slot still holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence


class SnapshotPool:
    def __init__(self, device_slots: Sequence[int]):
        self._slots = frozenset(device_slots)
        self._free = list(device_slots)[::-1]
        self.total = len(device_slots)
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # cached, LRU order
        self._held: dict[Hashable, tuple[int, int]] = {}         # owner -> (slot, position)
        self.evictions = 0
        # Called with (block hash, slot) of an evicted snapshot before the slot is reused.
        self.on_evict: Callable[[bytes, int], None] | None = None

    # ---- queries ------------------------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def held_at(self, owner: Hashable) -> int | None:
        """The token position of the state `owner` holds, if it holds one."""
        held = self._held.get(owner)
        return held[1] if held is not None else None

    def held_slot(self, owner: Hashable) -> int:
        return self._held[owner][0]

    @property
    def used(self) -> int:
        """Slots holding a state (held or cached)."""
        return self.total - len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ---- mutations ----------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to copy the state at `block_hash` into (None when snapshots are off or
        every slot is held); an existing snapshot of the same boundary is overwritten with
        identical state."""
        if block_hash in self._by_hash:
            return self.lookup(block_hash)
        slot = self._take()
        if slot is not None:
            self._by_hash[block_hash] = slot
        return slot

    def hold(self, owner: Hashable, position: int) -> int | None:
        """A slot for `owner`'s state at `position`. None when the owner holds one already
        (a sequence's is published first) or no slot can be had."""
        if owner in self._held:
            return None
        slot = self._take()
        if slot is not None:
            self._held[owner] = (slot, position)
        return slot

    def publish(self, owner: Hashable, block_hash: bytes) -> bool:
        """Key the state `owner` holds by the hash now known; True when it became a new
        cached snapshot (False: another slot already holds this boundary, the held copy
        is freed)."""
        slot, _ = self._held.pop(owner)
        if block_hash in self._by_hash:
            self._free.append(slot)
            return False
        self._by_hash[block_hash] = slot
        return True

    def drop_held(self, owner: Hashable) -> None:
        held = self._held.pop(owner, None)
        if held is not None:
            self._free.append(held[0])

    def discard(self, block_hash: bytes) -> bool:
        """Free a cached snapshot (a sequence's older decode-time one)."""
        if block_hash not in self._by_hash:
            return False
        self._free.append(self._by_hash.pop(block_hash))
        return True

    def clear(self) -> None:
        """Forget every snapshot (the device state behind them is gone). Held ones must
        have been dropped first."""
        if self._held:
            raise ValueError("clear: states are still held")
        self._free.extend(self._by_hash.values())
        self._by_hash.clear()

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._by_hash:
            return None
        self.evictions += 1
        block_hash, slot = self._by_hash.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(block_hash, slot)
        return slot

    # ---- integrity ----------------------------------------------------------------------

    def check_integrity(self, owners: Sequence[Hashable] | None = None) -> None:
        """Every device slot is free, held once or keyed once; with `owners` (the live
        sequences' and sessions' keys), no held state outlives its owner."""
        held = list(self._by_hash.values()) + [slot for slot, _ in self._held.values()]
        if (len(set(held)) != len(held) or set(held) & set(self._free)
                or set(held) | set(self._free) != self._slots
                or len(held) + len(self._free) != self.total):
            raise AssertionError(f"SSM snapshot slots out of balance: held {sorted(held)}, "
                                 f"free {sorted(self._free)} of {sorted(self._slots)}")
        if owners is not None and set(self._held) - set(owners):
            raise AssertionError(f"SSM states held for owners gone: "
                                 f"{sorted(map(str, set(self._held) - set(owners)))}")
