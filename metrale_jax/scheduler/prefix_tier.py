"""The prefix tier: cached prefix blocks and SSM snapshots the device evicts, kept in host
RAM and then on disk, and put back on a later prefix hit instead of being recomputed.

The device's prefix cache (`cache/block_pool.BlockPool`) and snapshot pool
(`cache/ssm_snapshots.SnapshotPool`) offer what they evict to this tier while its contents
are still intact: one entry per *run* of blocks evicted together (their pages in every KV
layer, a row per block; each block indexed by its chain hash, with its full key kept to
compare on a hit as the pool does) and one per SSM snapshot (the conv/SSM rows at that
block boundary). A restore takes whole runs and puts their other rows back as a new run. The entries live in a
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


def _run_key(run_id: int) -> str:
    return f"r-{run_id}"


def _snapshot_key(block_hash: BlockHash) -> str:
    return f"s-{block_hash.hex()}"


@dataclasses.dataclass
class _Run:
    """Blocks evicted together, stored as one tier entry (one row per block): a restore
    reads a few file sets rather than one per block."""
    keys: list[BlockKey]     # the rows, in order
    live: set[BlockHash]     # rows still indexed here (a row restored or stored again
                             # elsewhere is not); the entry goes once none is


class PrefixTier:
    def __init__(self, tier: StateTier, runner: Runner, tel: Telemetry | None = None):
        self.tier, self.runner, self.tel = tier, runner, tel
        self.stats = PrefixTierStats()
        self._blocks: dict[BlockHash, tuple[BlockKey, int]] = {}  # stored block -> run
        self._runs: dict[int, _Run] = {}
        self._snapshots: set[BlockHash] = set()  # stored snapshots' boundaries
        self._next_run = 0
        tier.on_drop = self._dropped

    # ---- queries ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks) + len(self._snapshots)

    def has_block(self, block_hash: BlockHash, key: BlockKey) -> bool:
        stored = self._blocks.get(block_hash)
        return stored is not None and stored[0] == key

    def has_snapshot(self, block_hash: BlockHash) -> bool:
        return block_hash in self._snapshots

    # ---- device -> tier -----------------------------------------------------------------

    def store_blocks(self, evicted: Sequence[tuple[int, BlockKey]]) -> None:
        """Copy evicted blocks' pages into the tier as one run (`runner.gather` returns
        every array with one row per block when no slot is asked for)."""
        arrays = self.runner.gather([block for block, _ in evicted], None)
        keys = [key for _, key in evicted]
        # A run is at most an eighth of the larger level, so that budgets keep several.
        row_bytes = max(1, sum(a.nbytes for a in arrays.values()) // len(keys))
        per_run = max(1, max(self.tier.host_bytes, self.tier.disk_bytes) // 8 // row_bytes)
        stored = 0
        for start in range(0, len(keys), per_run):
            rows = slice(start, start + per_run)
            stored += self._put_run(keys[rows], {n: a[rows] for n, a in arrays.items()})
        self._count("blocks_stored", stored)

    def _put_run(self, keys: Sequence[BlockKey], arrays: Mapping[str, np.ndarray]) -> int:
        """Store `arrays` (a row per key) as a new run; returns the blocks stored (0 when
        no level could hold it: rows stored before under another run stay there)."""
        run_id, self._next_run = self._next_run, self._next_run + 1
        if not keys or not self.tier.put(_run_key(run_id), arrays):
            return 0
        for key in keys:
            old = self._blocks.get(key.block_hash)
            if old is not None:
                self._forget_row(old[1], key.block_hash)
            self._blocks[key.block_hash] = (key, run_id)
        self._runs[run_id] = _Run(list(keys), {key.block_hash for key in keys})
        return len(keys)

    def _forget_row(self, run_id: int, block_hash: BlockHash) -> None:
        run = self._runs[run_id]
        run.live.discard(block_hash)
        if not run.live:
            del self._runs[run_id]
            self.tier.drop(_run_key(run_id))

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
        if key.startswith("r-"):
            for block_hash in self._runs.pop(int(key[2:])).live:
                del self._blocks[block_hash]
        else:
            self._snapshots.discard(bytes.fromhex(key[2:]))

    # ---- tier -> device -----------------------------------------------------------------

    def take_blocks(self, keys: Sequence[BlockKey]) -> list[dict[str, np.ndarray]] | None:
        """The stored blocks' pages (one row each), removed from the tier; the other live
        rows of the runs read go back as a new run. None (a miss, counted) if a run is
        unreadable or gone: its blocks are forgotten, the runs already read go back."""
        wanted = {key.block_hash for key in keys}
        read: dict[int, tuple[list[BlockKey], dict[str, np.ndarray]]] = {}
        for run_id in dict.fromkeys(self._blocks[key.block_hash][1] for key in keys):
            run = self._runs.pop(run_id)
            arrays = self.tier.take(_run_key(run_id))
            for block_hash in run.live:
                del self._blocks[block_hash]
            if arrays is None:
                self._count("misses")
                for rows, got in read.values():
                    self._put_run(rows, got)
                return None
            rows = [k for k in run.keys if k.block_hash in run.live]
            picked = [i for i, k in enumerate(run.keys) if k.block_hash in run.live]
            read[run_id] = (rows, {name: a[picked] for name, a in arrays.items()})
        pieces: dict[BlockHash, dict[str, np.ndarray]] = {}
        for rows, arrays in read.values():
            keep = [i for i, k in enumerate(rows) if k.block_hash not in wanted]
            self._put_run([rows[i] for i in keep], {n: a[keep] for n, a in arrays.items()})
            for i, k in enumerate(rows):
                if k.block_hash in wanted:
                    pieces[k.block_hash] = {n: a[i:i + 1] for n, a in arrays.items()}
        return [pieces[key.block_hash] for key in keys]

    def take_snapshot(self, block_hash: BlockHash) -> dict[str, np.ndarray] | None:
        self._snapshots.discard(block_hash)
        arrays = self.tier.take(_snapshot_key(block_hash))
        if arrays is None:
            self._count("misses")
        return arrays

    def put_blocks(self, keys: Sequence[BlockKey], pieces) -> None:
        """Blocks taken for a restore that did not happen go back (as one run)."""
        if pieces:
            self._put_run(keys, PrefixTier.stack(pieces, None))

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
        """Every indexed block is a live row of its run, every run and snapshot is a tier
        entry and the tier holds nothing else; the tier's books balance."""
        for block_hash, (key, run_id) in self._blocks.items():
            run = self._runs.get(run_id)
            if key.block_hash != block_hash or run is None or block_hash not in run.live:
                raise AssertionError(f"prefix tier: block {block_hash.hex()[:12]} indexed "
                                     f"in run {run_id}, which does not hold it")
        if sum(len(r.live) for r in self._runs.values()) != len(self._blocks) or \
                any(not r.live for r in self._runs.values()):
            raise AssertionError("prefix tier: runs hold rows the index does not know")
        want = sorted([_run_key(i) for i in self._runs]
                      + [_snapshot_key(h) for h in self._snapshots])
        held = sorted(k for k in want if k in self.tier)
        if want != held or len(self.tier) != len(want):
            raise AssertionError(f"prefix tier: {len(want)} runs and snapshots indexed "
                                 f"({len(want) - len(held)} missing), the tier holds "
                                 f"{len(self.tier)}")
        self.tier.check_integrity()
