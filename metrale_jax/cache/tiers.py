"""The second tier: state taken off the device kept in host RAM, then on disk (host only).

What goes here is what the device gave up under memory pressure but may be wanted again: a
session's latest turn (its KV pages and SSM/conv state, as `runner.gather` returns them).
Entries live in host RAM up to `host_bytes`, least recently used first out; what leaves
RAM is written to disk through the spill store (atomic, checksummed file sets) up to
`disk_bytes`, least recently used first deleted. `take` hands an entry back and forgets it;
a file found corrupt, truncated or missing is a miss (counted), never an error for the
request, which then computes what it needs. A budget of 0 turns that level off. An entry
the budgets push out of the last level is announced to `on_drop` (its owner's index
forgets it); the entry being `put` is not: `put` returns False for it.

Every entry is in exactly one place: in `_host` (bytes counted in `host_used`) or in
`_disk` (its file set in the store, bytes in `disk_used`); `check_integrity` verifies both
budgets and that the store holds exactly the disk entries' file sets.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np

from metrale_jax.cache.spill import SpillBackend, SpillCorrupt, SpillError, SpillHandle

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TierStats:
    """Counters; they only ever grow."""
    puts: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    to_disk: int = 0       # entries written out of RAM
    dropped: int = 0       # entries that left the last level (budgets) or failed to write
    corrupt: int = 0       # disk entries found unreadable on `take` (a miss)


class StateTier:
    def __init__(self, host_bytes: int, disk_bytes: int, store: SpillBackend | None):
        self.host_bytes, self.disk_bytes = host_bytes, disk_bytes if store else 0
        self.store = store
        self.stats = TierStats()
        self._host: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        self._disk: OrderedDict[str, tuple[SpillHandle, int]] = OrderedDict()
        self.host_used = self.disk_used = 0
        self.on_drop: Callable[[str], None] | None = None

    # ---- queries ------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._host or key in self._disk

    def __len__(self) -> int:
        return len(self._host) + len(self._disk)

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0

    # ---- mutations ----------------------------------------------------------------------

    def put(self, key: str, arrays: Mapping[str, np.ndarray]) -> bool:
        """Keep `arrays` under `key` (replacing an entry of that key); False when no level
        can hold it (too big for both budgets, or the write failed)."""
        self.drop(key)
        self.stats.puts += 1
        arrays = {name: np.asarray(a) for name, a in arrays.items()}
        nbytes = _nbytes(arrays)
        if nbytes <= self.host_bytes:
            self._host[key], self.host_used = arrays, self.host_used + nbytes
            while self.host_used > self.host_bytes:  # the oldest leave RAM for the disk
                old, old_arrays = self._host.popitem(last=False)
                self.host_used -= _nbytes(old_arrays)
                if not self._to_disk(old, old_arrays):
                    self._announce(old)
            return key in self
        return self._to_disk(key, arrays)

    def take(self, key: str) -> dict[str, np.ndarray] | None:
        """The entry's arrays, removed from the tier; None when absent or unreadable."""
        if key in self._host:
            arrays = self._host.pop(key)
            self.host_used -= _nbytes(arrays)
            self.stats.host_hits += 1
            return arrays
        if key not in self._disk:
            return None
        handle, nbytes = self._disk.pop(key)
        self.disk_used -= nbytes
        try:
            arrays, _ = self.store.read(handle)
        except (SpillCorrupt, OSError) as err:
            logger.warning("state tier: %s; a miss, the request computes instead", err)
            self.stats.corrupt += 1
            arrays = None
        else:
            self.stats.disk_hits += 1
        self.store.remove(handle)
        return arrays

    def drop(self, key: str) -> None:
        if key in self._host:
            self.host_used -= _nbytes(self._host.pop(key))
        elif key in self._disk:
            handle, nbytes = self._disk.pop(key)
            self.disk_used -= nbytes
            self.store.remove(handle)

    def clear(self) -> None:
        """Forget every entry and remove its files (the engine is closing: nothing will
        read them)."""
        for key in list(self._host) + list(self._disk):
            self.drop(key)

    def _to_disk(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        nbytes = _nbytes(arrays)
        if nbytes > self.disk_bytes:
            self.stats.dropped += 1
            return False
        while self.disk_used + nbytes > self.disk_bytes:
            old, (handle, size) = self._disk.popitem(last=False)
            self.disk_used -= size
            self.store.remove(handle)
            self.stats.dropped += 1
            self._announce(old)
        try:
            handle = self.store.write(key, arrays, {"tier": True})
        except (SpillError, OSError) as err:
            logger.warning("state tier: could not write %s to disk: %s; dropped", key, err)
            self.stats.dropped += 1
            return False
        self._disk[key], self.disk_used = (handle, nbytes), self.disk_used + nbytes
        self.stats.to_disk += 1
        return True

    def _announce(self, key: str) -> None:
        if self.on_drop is not None:
            self.on_drop(key)

    # ---- integrity ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        host = sum(_nbytes(a) for a in self._host.values())
        disk = sum(n for _, n in self._disk.values())
        if host != self.host_used or host > self.host_bytes:
            raise AssertionError(f"state tier: host holds {host} bytes, books say "
                                 f"{self.host_used}, budget {self.host_bytes}")
        if disk != self.disk_used or disk > self.disk_bytes:
            raise AssertionError(f"state tier: disk holds {disk} bytes, books say "
                                 f"{self.disk_used}, budget {self.disk_bytes}")
        if set(self._host) & set(self._disk):
            raise AssertionError("state tier: an entry is both in RAM and on disk")
        if self.store is not None and sorted(self.store.keys()) != sorted(self._disk):
            raise AssertionError(f"state tier: files {sorted(self.store.keys())} != disk "
                                 f"entries {sorted(self._disk)}")


def _nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())
