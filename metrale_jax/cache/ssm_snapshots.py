"""SSM snapshot slots: a hybrid model's recurrent state at prefix-cache block boundaries.

A KV prefix hit alone cannot skip a Mamba2 layer's work: its state after the prefix is
needed too. When a prefill chunk ends on a full block, the sequence's conv/SSM state is
copied into a snapshot slot keyed by that block's chain hash; a later request whose cached
prefix ends at the same block copies it back instead of recomputing. The pool is small and
evicts least-recently-used snapshots (peers found dense snapshots crowding out the pool).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SnapshotPool:
    def __init__(self, device_slots: Sequence[int]):
        self._slots = frozenset(device_slots)
        self._free = list(device_slots)[::-1]
        self.total = len(device_slots)
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hash: bytes) -> int | None:
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to copy the state at `block_hash` into (None when snapshots are off);
        an existing snapshot of the same boundary is overwritten with identical state."""
        if not self.total:
            return None
        if block_hash in self._by_hash:
            return self.lookup(block_hash)
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._by_hash.popitem(last=False)
        self._by_hash[block_hash] = slot
        return slot

    def clear(self) -> None:
        """Forget every snapshot (the device state behind them is gone)."""
        self._free.extend(self._by_hash.values())
        self._by_hash.clear()

    @property
    def used(self) -> int:
        return len(self._by_hash)

    def check_integrity(self) -> None:
        """Every device slot is either free or holds exactly one boundary's snapshot."""
        held = list(self._by_hash.values())
        if (len(set(held)) != len(held) or set(held) & set(self._free)
                or set(held) | set(self._free) != self._slots):
            raise AssertionError(f"SSM snapshot slots out of balance: held {sorted(held)}, "
                                 f"free {sorted(self._free)} of {sorted(self._slots)}")
