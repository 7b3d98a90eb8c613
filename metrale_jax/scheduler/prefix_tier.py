"""The prefix tier: cached prefix blocks and SSM snapshots the device evicts, kept in host
RAM and then on disk, and put back on a later prefix hit instead of being recomputed.

The device's prefix cache (`cache/block_pool.BlockPool`) and snapshot pool
(`cache/ssm_snapshots.SnapshotPool`) offer what they evict to this tier while its contents
are still intact: one entry per KV block (its pages in every KV layer, keyed by the block's
chain hash, with its full key kept to compare on a hit as the pool does) and one per SSM
snapshot (the conv/SSM rows at that block boundary). The entries live in a
`cache/tiers.StateTier` (host RAM up to its budget, then the spill store's atomic,
checksummed files up to the disk budget, least recently used first out). vLLM's KV
offloading and SGLang's HiCache keep KV this way; on a hybrid model a KV prefix is only
worth restoring together with the SSM state at its end, so the snapshots travel too.

`Memory.admit` asks `chain` for the prompt's blocks beyond the device's hit, `restore`
takes what it chose out of the tier (every entry is in one place: a restored block is the
device's again, and goes back to the tier when evicted again). An entry found corrupt or
missing is a miss: the request computes from there. Evicting copies the block's pages to
the host at once (a device read ordered after every step already dispatched), so the tier
is off by default, as vLLM's and SGLang's are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from metrale_jax.cache.block_pool import BlockKey
from metrale_jax.cache.prefix_hash import BlockHash
from metrale_jax.cache.tiers import StateTier
from metrale_jax.telemetry import Telemetry
from metrale_jax.types import Runner


@dataclasses.dataclass
class PrefixTierStats:
    """Counters; they only ever grow."""
    blocks_stored: int = 0      # evicted KV blocks copied into the tier
    snapshots_stored: int = 0   # evicted SSM snapshots copied into the tier
    blocks_restored: int = 0    # blocks put back on the device for a hit
    snapshots_restored: int = 0
    hit_tokens: int = 0         # prompt tokens a restore saved computing
    misses: int = 0             # entries found unreadable or gone when wanted


def _block_key(block_hash: BlockHash) -> str:
    return f"b-{block_hash.hex()}"


def _snapshot_key(block_hash: BlockHash) -> str:
    return f"s-{block_hash.hex()}"


class PrefixTier:
    def __init__(self, tier: StateTier, runner: Runner, tel: Telemetry | None = None):
        self.tier, self.runner, self.tel = tier, runner, tel
        self.stats = PrefixTierStats()
        self._blocks: dict[BlockHash, BlockKey] = {}  # stored blocks' full keys
        self._snapshots: set[BlockHash] = set()       # stored snapshots' boundaries
        tier.on_drop = self._dropped

    # ---- queries ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks) + len(self._snapshots)

    def has_block(self, block_hash: BlockHash, key: BlockKey) -> bool:
        return self._blocks.get(block_hash) == key

    def has_snapshot(self, block_hash: BlockHash) -> bool:
        return block_hash in self._snapshots

    # ---- device -> tier -----------------------------------------------------------------

    def store_blocks(self, evicted: Sequence[tuple[int, BlockKey]]) -> None:
        """Copy evicted blocks' pages into the tier, one entry per block (`runner.gather`
        returns every array with one row per block when no slot is asked for)."""
        arrays = self.runner.gather([block for block, _ in evicted], None)
        for row, (_, key) in enumerate(evicted):
            piece = {name: a[row:row + 1].copy() for name, a in arrays.items()}
            if self.tier.put(_block_key(key.block_hash), piece):
                self._blocks[key.block_hash] = key
                self._count("blocks_stored")
            else:
                self._blocks.pop(key.block_hash, None)

    def store_snapshot(self, block_hash: BlockHash, slot: int) -> None:
        """Copy an evicted snapshot's conv/SSM rows (and the empty KV arrays of a gather
        of no blocks, which give a restore of no blocks its layout) into the tier."""
        if self.tier.put(_snapshot_key(block_hash), self.runner.gather([], slot)):
            self._snapshots.add(block_hash)
            self._count("snapshots_stored")
        else:
            self._snapshots.discard(block_hash)

    def _dropped(self, key: str) -> None:
        """The tier's budgets pushed an entry out: forget it."""
        block_hash = bytes.fromhex(key[2:])
        if key.startswith("b-"):
            self._blocks.pop(block_hash, None)
        else:
            self._snapshots.discard(block_hash)

    # ---- tier -> device -----------------------------------------------------------------

    def take_blocks(self, keys: Sequence[BlockKey]) -> list[dict[str, np.ndarray]] | None:
        """The stored blocks' pages, removed from the tier; None (a miss, counted) if any
        is unreadable or gone, and then those already read go back into the tier."""
        pieces: list[dict[str, np.ndarray]] = []
        for key in keys:
            del self._blocks[key.block_hash]
            piece = self.tier.take(_block_key(key.block_hash))
            if piece is None:
                self._count("misses")
                self.put_blocks(keys, pieces)
                return None
            pieces.append(piece)
        return pieces

    def take_snapshot(self, block_hash: BlockHash) -> dict[str, np.ndarray] | None:
        self._snapshots.discard(block_hash)
        arrays = self.tier.take(_snapshot_key(block_hash))
        if arrays is None:
            self._count("misses")
        return arrays

    def put_blocks(self, keys: Sequence[BlockKey], pieces) -> None:
        """Entries taken for a restore that did not happen go back."""
        for key, piece in zip(keys, pieces):
            if self.tier.put(_block_key(key.block_hash), piece):
                self._blocks[key.block_hash] = key

    def put_snapshot(self, block_hash: BlockHash, arrays) -> None:
        if self.tier.put(_snapshot_key(block_hash), arrays):
            self._snapshots.add(block_hash)

    def count_restore(self, blocks: int, snapshot: bool, tokens: int) -> None:
        self._count("blocks_restored", blocks)
        self._count("snapshots_restored", int(snapshot))
        self._count("hit_tokens", tokens)

    def _count(self, name: str, n: int = 1) -> None:
        """Into the stats and the scheduler's telemetry (/metrics: `prefix_tier_<name>`)."""
        setattr(self.stats, name, getattr(self.stats, name) + n)
        if self.tel is not None:
            self.tel.count(f"prefix_tier_{name}", n)

    @staticmethod
    def stack(pieces: Sequence[Mapping[str, np.ndarray]],
              snapshot: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """One scatter's arrays: the blocks' pages in table order, and the snapshot's
        state rows (its empty KV arrays stand in when no block is restored)."""
        if pieces:
            arrays = {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
        else:
            arrays = dict(snapshot)
        if snapshot is not None:
            arrays.update({name: a for name, a in snapshot.items() if name not in arrays})
        return arrays

    # ---- integrity ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The index and the tier hold the same entries; the tier's books balance."""
        want = sorted([_block_key(h) for h in self._blocks]
                      + [_snapshot_key(h) for h in self._snapshots])
        held = sorted(k for k in want if k in self.tier)
        if want != held or len(self.tier) != len(want):
            raise AssertionError(f"prefix tier: index has {len(want)} entries "
                                 f"({len(want) - len(held)} missing), the tier "
                                 f"{len(self.tier)}")
        self.tier.check_integrity()
