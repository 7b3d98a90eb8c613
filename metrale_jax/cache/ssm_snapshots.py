"""SSM snapshot slots: a hybrid model's recurrent state at prefix-cache block boundaries.

A KV prefix hit alone cannot skip a Mamba2 layer's work: its state after the prefix is
needed too. When a step ends a sequence exactly on a full block (a prefill chunk cut there,
or a decode token that fills a block), its conv/SSM state is copied into a snapshot slot; a
later request whose cached prefix ends at the same block copies it back instead of
recomputing. The pool is small and evicts least-recently-used snapshots (peers found dense
snapshots crowding out the pool).

Every slot is in exactly one of these states:
  free    -- on the free list;
  staged  -- holds one sequence's state at a boundary whose block hash is not known yet (a
             pipelined decode: the token that filled the block is still on the device). Not
             matchable; `publish` keys it once the token is read back, `drop_staged` frees
             it. At most one per sequence.
  cached  -- keyed by a block hash, in the LRU; `reserve` evicts the least recent one.
  pinned  -- keyed, and held by one or more pins (a session's latest turn): never evicted
             until the last pin is released, when it becomes cached again.
Queries (`__contains__`, `staged_at`, counts) never change state; `lookup` only refreshes
the LRU order.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence


class SnapshotPool:
    def __init__(self, device_slots: Sequence[int]):
        self._slots = frozenset(device_slots)
        self._free = list(device_slots)[::-1]
        self.total = len(device_slots)
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # cached + pinned, LRU order
        self._pins: Counter[bytes] = Counter()
        self._staged: dict[Hashable, tuple[int, int]] = {}       # owner -> (slot, position)
        self.evictions = 0

    # ---- queries ------------------------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def staged_at(self, owner: Hashable) -> int | None:
        """The token position of `owner`'s staged snapshot, if it has one."""
        staged = self._staged.get(owner)
        return staged[1] if staged is not None else None

    def staged_slot(self, owner: Hashable) -> int:
        return self._staged[owner][0]

    @property
    def used(self) -> int:
        """Slots holding a state (staged, cached or pinned)."""
        return self.total - len(self._free)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def _can_take(self) -> bool:
        return bool(self._free) or len(self._by_hash) > len(self._pins)

    # ---- mutations ----------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to copy the state at `block_hash` into (None when snapshots are off or
        every slot is pinned or staged); an existing snapshot of the same boundary is
        overwritten with identical state."""
        if block_hash in self._by_hash:
            return self.lookup(block_hash)
        slot = self._take()
        if slot is not None:
            self._by_hash[block_hash] = slot
        return slot

    def stage(self, owner: Hashable, position: int) -> int | None:
        """A slot for `owner`'s state at `position`, keyed later by `publish`. None when
        the owner already has one staged (it is published first) or no slot can be had."""
        if owner in self._staged:
            return None
        slot = self._take()
        if slot is not None:
            self._staged[owner] = (slot, position)
        return slot

    def publish(self, owner: Hashable, block_hash: bytes) -> bool:
        """Key `owner`'s staged snapshot by the hash now known; True when it became a new
        cached snapshot (False: another slot already holds this boundary, the staged copy
        is freed)."""
        slot, _ = self._staged.pop(owner)
        if block_hash in self._by_hash:
            self._free.append(slot)
            return False
        self._by_hash[block_hash] = slot
        return True

    def drop_staged(self, owner: Hashable) -> None:
        staged = self._staged.pop(owner, None)
        if staged is not None:
            self._free.append(staged[0])

    def discard(self, block_hash: bytes) -> bool:
        """Free a cached snapshot (a sequence's older decode-time one); a pinned one stays."""
        if block_hash not in self._by_hash or self._pins[block_hash]:
            return False
        self._free.append(self._by_hash.pop(block_hash))
        return True

    def pin(self, block_hash: bytes) -> bool:
        """Hold a snapshot against eviction; False when there is none at that boundary."""
        if block_hash not in self._by_hash:
            return False
        self._pins[block_hash] += 1
        return True

    def unpin(self, block_hash: bytes) -> None:
        if self._pins[block_hash] <= 0:
            raise ValueError(f"unpin: snapshot {block_hash.hex()[:12]} is not pinned")
        self._pins[block_hash] -= 1
        if not self._pins[block_hash]:
            del self._pins[block_hash]

    def clear(self) -> None:
        """Forget every snapshot (the device state behind them is gone). Pins and staged
        snapshots must have been released first."""
        if self._pins or self._staged:
            raise ValueError("clear: snapshots are still pinned or staged")
        self._free.extend(self._by_hash.values())
        self._by_hash.clear()

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((h for h in self._by_hash if not self._pins[h]), None)
        if victim is None:
            return None
        self.evictions += 1
        return self._by_hash.pop(victim)

    # ---- integrity ----------------------------------------------------------------------

    def check_integrity(self, owners: Sequence[Hashable] | None = None) -> None:
        """Every device slot is free, staged once or keyed once; pins name kept snapshots;
        with `owners` (the live sequences' ids), no staged snapshot outlives its owner."""
        held = list(self._by_hash.values()) + [slot for slot, _ in self._staged.values()]
        if (len(set(held)) != len(held) or set(held) & set(self._free)
                or set(held) | set(self._free) != self._slots
                or len(held) + len(self._free) != self.total):
            raise AssertionError(f"SSM snapshot slots out of balance: held {sorted(held)}, "
                                 f"free {sorted(self._free)} of {sorted(self._slots)}")
        lost = [h.hex()[:12] for h in self._pins if h not in self._by_hash or
                self._pins[h] <= 0]
        if lost:
            raise AssertionError(f"SSM snapshot pins without a snapshot: {lost}")
        if owners is not None and set(self._staged) - set(owners):
            raise AssertionError(f"staged SSM snapshots of finished sequences: "
                                 f"{sorted(map(str, set(self._staged) - set(owners)))}")
