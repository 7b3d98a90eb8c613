"""Memory: the KV block pool, the SSM state slots and the SSM snapshot pool, and what a
sequence does with them (reuse a cached prefix, grow its table, commit full blocks to the
prefix cache, snapshot its SSM state at a block boundary, give everything back).

Host bookkeeping only: the device effects, copying SSM state between slots and (with a
prefix tier) moving evicted blocks and snapshots off the device and back, go through the
runner (ordered after every step already dispatched).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import Protocol

from metrale_jax.cache.block_pool import BlockKey, BlockPool, PrefixMatch, SlotPool
from metrale_jax.cache.prefix_hash import ROOT_HASH, hash_block
from metrale_jax.cache.ssm_snapshots import SnapshotPool
from metrale_jax.scheduler.prefix_tier import PrefixTier
from metrale_jax.sequence import Sequence


class Pins(Protocol):
    """Holders of blocks besides running sequences (the scheduler's sessions)."""

    @property
    def pinned_blocks(self) -> int: ...

    def give_back(self) -> bool:
        """Release the least recently used holder; False when none can go."""

    def take_tail(self, seq: Sequence) -> object | None:
        """At admission: hand a kept state to `seq` (via `adopt_tail`), or None."""

    def tables(self) -> dict: ...

    def owners(self) -> list: ...


class Memory:
    def __init__(self, *, num_blocks: int, block_size: int, num_seq_slots: int,
                 snapshot_slots: Seq[int], has_ssm: bool,
                 copy_slots: Callable[[Seq[int], Seq[int]], None]):
        self.block_size, self.has_ssm, self._copy_slots = block_size, has_ssm, copy_slots
        self.pool = BlockPool(num_blocks, block_size)
        self.slots = SlotPool(num_seq_slots)        # SSM state slot + future-token cell
        self.snapshots = SnapshotPool(snapshot_slots)
        self.has_kv = num_blocks > 1                # a pure-SSM model has no KV pool
        self._copies: list[tuple[int, int]] = []   # (src, dst) snapshot copies queued
        # What holds blocks besides sequences and gives them back under pressure (the
        # scheduler's `Sessions`); None: nothing does.
        self.pins: Pins | None = None
        # Where evicted prefix blocks and snapshots go, and come back from (None: gone).
        self.prefix_tier: PrefixTier | None = None

    def attach_tier(self, tier: PrefixTier) -> None:
        """Evicted cached blocks and SSM snapshots are copied into `tier` from now on."""
        self.prefix_tier = tier
        self.pool.on_evict = tier.store_blocks
        if self.has_ssm:
            self.snapshots.on_evict = self._store_snapshot

    def _store_snapshot(self, block_hash: bytes, slot: int) -> None:
        self.flush_copies()  # a copy queued into this slot lands before it is read
        self.prefix_tier.store_snapshot(block_hash, slot)

    # ---- queries ------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prompt_blocks(self, seq: Sequence) -> int:
        """Blocks a prompt needs, counting the first generated token's."""
        return len(seq.prompt_ids) // self.block_size + 1

    @property
    def reclaimable(self) -> int:
        """Free blocks plus unreferenced cached ones (evicted on demand) plus what pins
        give back under pressure."""
        pinned = self.pins.pinned_blocks if self.pins is not None else 0
        return self.pool.num_free + self.pool.num_cached + pinned

    def make_room(self, num_blocks: int) -> bool:
        """Whether `num_blocks` can be allocated, pins giving way (least recent first)."""
        while not self.pool.can_allocate(num_blocks):
            if self.pins is None or not self.pins.give_back():
                return False
        return True

    def _snapshot_usable(self):
        # On a hybrid model a cached KV prefix is only reusable with the SSM state there.
        return (lambda h: h in self.snapshots) if self.has_ssm else None

    # ---- a sequence's lifetime ------------------------------------------------------------

    def admit(self, seq: Sequence, reuse_prefix: bool) -> None:
        """A slot for a starting prefill and, when allowed, the cached prefix it can reuse
        (`pins.take_tail`: a session's last turn first)."""
        seq.slot = self.slots.allocate()
        if not reuse_prefix or (self.pins is not None and self.pins.take_tail(seq)):
            return
        self._reuse_prefix(seq)
        if self.has_ssm:
            cached = len(self.pool.peek_prefix(seq.prompt_ids, seq.adapter_id).blocks)
            if cached * self.block_size > seq.num_computed:
                seq.snapshot_cut = cached * self.block_size

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start `seq` on the longest cached prefix (device, then the prefix tier)."""
        match = self.pool.match_prefix(seq.prompt_ids, seq.adapter_id, self._snapshot_usable())
        if self.prefix_tier is not None and len(self.prefix_tier) and \
                self._admit_from_tier(seq, match):
            return
        if not match.blocks:
            return
        self.pool.acquire(match.blocks)
        seq.block_table = list(match.blocks)
        seq.block_hashes = list(match.hashes)
        seq.num_computed = match.num_tokens
        if self.has_ssm:
            self._copy_slots([self.snapshots.lookup(match.hashes[-1])], [seq.slot])

    # ---- the prefix tier -----------------------------------------------------------------

    def _admit_from_tier(self, seq: Sequence, match: PrefixMatch) -> bool:
        """Extend the device's prefix hit with blocks (and, on a hybrid, the snapshot at
        its end) from the prefix tier; False when the tier adds nothing or no room can be
        made (the device's hit is then used as it is). An entry found unreadable is gone
        from the tier: the walk is redone without it."""
        while True:
            chain = self._tier_chain(seq)
            end = self._restorable(chain)
            if end * self.block_size <= match.num_tokens:
                return False
            done = self._restore(seq, chain[:end], match.num_tokens)
            if done is not None:
                return done

    def _tier_chain(self, seq: Sequence) -> list[tuple[BlockKey, int | None]]:
        """The prompt's full blocks (one token is always left to compute) found on the
        device (the block id) or in the tier (None), in order, up to the first in neither."""
        bs, tokens, parent = self.block_size, seq.prompt_ids, ROOT_HASH
        chain: list[tuple[BlockKey, int | None]] = []
        for start in range(0, max(len(tokens) - 1, 0) // bs * bs, bs):
            chunk = tuple(int(t) for t in tokens[start:start + bs])
            key = BlockKey(hash_block(parent, chunk, seq.adapter_id), parent, chunk,
                           seq.adapter_id)
            block = self.pool.cached_block(key.block_hash, key)
            if block is None and not self.prefix_tier.has_block(key.block_hash, key):
                break
            chain.append((key, block))
            parent = key.block_hash
        return chain

    def _restorable(self, chain: list[tuple[BlockKey, int | None]]) -> int:
        """How many blocks of `chain` a restore can use: all of them, or on a hybrid up to
        the last one with an SSM snapshot (on the device or in the tier)."""
        if not self.has_ssm:
            return len(chain)
        for end in range(len(chain), 0, -1):
            block_hash = chain[end - 1][0].block_hash
            if block_hash in self.snapshots or self.prefix_tier.has_snapshot(block_hash):
                return end
        return 0

    def _restore(self, seq: Sequence, chain: list[tuple[BlockKey, int | None]],
                 device_hit: int) -> bool | None:
        """Admit `seq` on `chain`: its device blocks shared, its stored ones scattered into
        fresh blocks and committed again, the SSM state at its end copied into the
        sequence's slot. None: an entry was unreadable (walk again); False: no room."""
        tier, end_hash = self.prefix_tier, chain[-1][0].block_hash
        on_device = [block for _, block in chain if block is not None]
        stored = [key for key, block in chain if block is None]
        self.pool.acquire(on_device)  # so making room below cannot evict them
        snapshot = None
        if self.has_ssm and end_hash not in self.snapshots:
            snapshot = tier.take_snapshot(end_hash)
            if snapshot is None:
                self.pool.release(on_device)
                return None
        pieces = tier.take_blocks(stored) if stored else []
        if pieces is None or not self.make_room(len(stored)):
            if snapshot is not None:
                tier.put_snapshot(end_hash, snapshot)
            if pieces:
                tier.put_blocks(stored, pieces)
            self.pool.release(on_device)
            return None if pieces is None else False
        fresh = self.pool.allocate(len(stored))
        if fresh or snapshot is not None:
            tier.runner.scatter(PrefixTier.stack(pieces, snapshot), fresh,
                                seq.slot if snapshot is not None else None)
        table, taken = [], iter(fresh)
        for key, block in chain:
            if block is None:
                block = next(taken)
                self.pool.commit_block(block, key.parent_hash, key.tokens, key.adapter_id)
            table.append(block)
        if self.has_ssm:
            if snapshot is None:
                self._copy_slots([self.snapshots.lookup(end_hash)], [seq.slot])
            else:  # the state is the device's again: keep it matchable there
                slot = self.snapshots.reserve(end_hash)
                if slot is not None:
                    self._copy_slots([seq.slot], [slot])
        seq.block_table, seq.block_hashes = table, [key.block_hash for key, _ in chain]
        seq.num_computed = len(chain) * self.block_size
        tier.count_restore(len(stored), snapshot is not None,
                           seq.num_computed - device_hit)
        self.pool.stats.prefix_hit_tokens += seq.num_computed - device_hit
        return True

    def adopt_tail(self, seq: Sequence, tail, owner) -> None:
        """Admission from a session's tail: the sequence takes over its block references
        and starts from its state (copied out of the slot the session held, which is freed:
        the copy is ordered before any later write to it)."""
        seq.block_table, seq.block_hashes = tail.blocks, tail.hashes
        seq.num_computed = len(tail.tokens)
        if self.has_ssm:
            self._copy_slots([self.snapshots.held_slot(owner)], [seq.slot])
            self.snapshots.drop_held(owner)

    def pin_tail(self, seq: Sequence, tail, owner) -> bool:
        """Keep a finishing sequence's blocks and state for its session (before `release`);
        False when no snapshot slot can be had."""
        if self.has_ssm:
            slot = self.snapshots.hold(owner, len(tail.tokens))
            if slot is None:
                return False
            self._copy_slots([seq.slot], [slot])
        self.pool.acquire(tail.blocks)
        return True

    def unpin_tail(self, tail, owner) -> None:
        self.pool.release(tail.blocks)
        self.snapshots.drop_held(owner)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Append blocks so the table covers `num_tokens` (tables only ever grow)."""
        extra = self.blocks_for(num_tokens) - len(seq.block_table)
        if extra <= 0:
            return True
        if not self.make_room(extra):
            return False
        seq.block_table.extend(self.pool.allocate(extra))
        return True

    def commit_blocks(self, seq: Sequence) -> int:
        """Offer the sequence's newly full blocks to the prefix cache: only blocks whose KV
        is computed and whose tokens are all read back."""
        known = min(seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids))
        bs, ids, added = self.block_size, None, 0
        while (len(seq.block_hashes) + 1) * bs <= known:
            ids = ids or seq.all_ids
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(self.pool.commit_block(
                seq.block_table[i], parent if parent is not None else ROOT_HASH,
                ids[i * bs:(i + 1) * bs], seq.adapter_id))
            added += 1
        return added

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past what the sequence's tokens need (a speculative row
        took blocks for drafts that were rejected) and a row still in flight may write;
        committed blocks are never trimmed."""
        reach = seq.ahead_reach if seq.inflight else 0  # a row packed ahead writes there
        keep = max(self.blocks_for(seq.virtual_len + reach), len(seq.block_hashes))
        if len(seq.block_table) > keep:
            tail, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
            self.pool.release(tail)

    def snapshot_boundary(self, seq: Sequence) -> None:
        """After a step that ended `seq` exactly on a block boundary, keep the SSM state
        there: keyed at once when the block's hash is known, else staged until the token
        that filled it is read back (`publish_staged`). The copy is queued and runs, with
        the step's other copies, at `flush_copies`, before any later step."""
        end, bs = seq.num_computed, self.block_size
        if not self.has_ssm or end == 0 or end % bs:
            return
        if len(seq.block_hashes) * bs >= end:
            block_hash = seq.block_hashes[end // bs - 1]
            if block_hash in self.snapshots:
                self.snapshots.lookup(block_hash)  # the same state, kept already
                return
            slot = self.snapshots.reserve(block_hash)
            if slot is not None:
                self._copies.append((seq.slot, slot))
                self._kept(seq, block_hash, end)
        else:
            slot = self.snapshots.hold(seq.uid, end)
            if slot is not None:
                self._copies.append((seq.slot, slot))

    def publish_staged(self, seq: Sequence) -> None:
        """Key the sequence's staged snapshot once its block's hash is committed."""
        end = self.snapshots.held_at(seq.uid)
        if end is None or len(seq.block_hashes) * self.block_size < end:
            return
        block_hash = seq.block_hashes[end // self.block_size - 1]
        if self.snapshots.publish(seq.uid, block_hash):
            self._kept(seq, block_hash, end)

    def _kept(self, seq: Sequence, block_hash: bytes, end: int) -> None:
        """Decode-time snapshots are capped at one per sequence: the newest replaces the
        one before (prompt boundaries are kept: they are what shared prefixes hit)."""
        if end <= len(seq.prompt_ids):
            return
        if seq.decode_snapshot is not None:
            self.snapshots.discard(seq.decode_snapshot)
        seq.decode_snapshot = block_hash

    def flush_copies(self) -> None:
        """Dispatch the queued snapshot copies as one batch (sources are sequence slots,
        destinations snapshot slots; a slot evicted and retaken gets the later copy)."""
        if not self._copies:
            return
        by_dst = {dst: src for src, dst in self._copies}
        self._copies.clear()
        self._copy_slots(list(by_dst.values()), list(by_dst))

    def reclaim_for(self, seq: Sequence) -> int:
        """Evict cached prefix blocks for an admitted prompt, never the prefix it will reuse
        (a prompt-logprobs request reuses nothing); returns the free-block target."""
        reused = [] if seq.params.prompt_logprobs is not None else seq.prompt_ids
        while True:
            target = self.pool.reclaim_prefix_blocks_for(
                reused, seq.adapter_id, self.prompt_blocks(seq), self._snapshot_usable()).target
            if self.pool.num_free >= target or self.pins is None or not self.pins.give_back():
                return target

    def release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.release(seq.block_table)
            seq.block_table = []
        if seq.slot:
            self.slots.free(seq.slot)
            seq.slot = 0
        # A held (staged) snapshot's token was never read back; the last kept one stays
        # cached.
        self.snapshots.drop_held(seq.uid)
        seq.decode_snapshot = None

    def forget_device_state(self) -> None:
        """The device caches were re-allocated empty: cached prefix blocks and SSM snapshots
        no longer hold what their hashes say. Call once no sequence holds blocks."""
        self.pool.forget_cached()
        self.snapshots.clear()

    # ---- books ----------------------------------------------------------------------------

    def check_integrity(self, live: Seq[Sequence]) -> None:
        """No block owned twice, pool books balanced, every held slot accounted for (the
        pins' blocks and staged states included)."""
        tables = {id(s): s.block_table for s in live}
        owners = [s.uid for s in live]
        if self.pins is not None:
            tables.update(self.pins.tables())
            owners += self.pins.owners()
        self.pool.check_integrity(tables)
        held = [s.slot for s in live if s.slot]
        if len(set(held)) != len(held) or self.slots.num_free + len(held) != \
                self.slots.num_slots - 1:
            raise AssertionError(f"SSM slots out of balance: held {sorted(held)}, "
                                 f"{self.slots.num_free} free of {self.slots.num_slots - 1}")
        self.snapshots.check_integrity(owners)
        if self.prefix_tier is not None:
            self.prefix_tier.check_integrity()
        if self._copies:
            raise AssertionError(f"snapshot copies queued and never run: {self._copies}")
