"""Phase 8: the lanes StartPrefills, ContinuePrefills and Decode, packed into one ragged
batch under the tick's token budget (prefill chunks and decode tokens side by side).

Decodes are packed first: one token each, so a long prompt never stalls running sequences;
prefill chunks fill the rest of the budget in admission order.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from metrale_jax.runner.inputs import RowChunk
from metrale_jax.runner.model_runner import ScheduledRow
from metrale_jax.sequence import Sequence, Status

if TYPE_CHECKING:
    from metrale_jax.scheduler.core import SchedulerCore


@dataclasses.dataclass
class PackedRow:
    seq: Sequence
    epoch: int          # results for an older epoch (the sequence was preempted) are dropped
    samples: bool       # the chunk reaches the sequence's end: its sampled token counts
    row: ScheduledRow


def start_prefills(core: "SchedulerCore", new: list[Sequence]) -> None:
    """Give each admitted sequence a slot and whatever cached prefix it may reuse."""
    levers = core.levers_now
    for seq in new:
        seq.slot = core.slots.allocate()
        seq.status = Status.PREFILLING
        core.prefilling.append(seq)
        if not levers.prefix_cache_enabled or seq.params.prompt_logprobs is not None:
            continue  # a prompt-logprobs request needs every position scored: it reuses nothing
        usable = (lambda h: h in core.snapshots) if core.runner.has_ssm else None
        match = core.pool.match_prefix(seq.prompt_ids, seq.adapter_id, usable)
        if not match.blocks:
            continue
        core.pool.acquire(match.blocks)
        seq.block_table = list(match.blocks)
        seq.block_hashes = list(match.hashes)
        seq.num_computed = match.num_tokens
        if core.runner.has_ssm:
            core.runner.copy_slots([core.snapshots.lookup(match.hashes[-1])], [seq.slot])


def _grow(core: "SchedulerCore", seq: Sequence, num_tokens: int) -> bool:
    """Append blocks so the table covers `num_tokens` (tables only ever grow)."""
    extra = -(-num_tokens // core.block_size) - len(seq.block_table)
    if extra <= 0:
        return True
    if not core.pool.can_allocate(extra):
        return False
    seq.block_table.extend(core.pool.allocate(extra))
    return True


def _prefill_chunk(core: "SchedulerCore", seq: Sequence, budget: int) -> list[int]:
    size = min(budget, core.levers_now.prefill_chunk_size)
    chunk = seq.next_chunk(size)
    end = seq.num_computed + len(chunk)
    # On a hybrid model with prefix caching, a prefill chunk stops on the prompt's last full
    # block boundary it crosses, so the SSM state there can be snapshotted for reuse (a
    # chunk that ran on to the prompt's end would leave no snapshot for short prompts).
    if core.runner.has_ssm and core.levers_now.prefix_cache_enabled:
        bs = core.block_size
        boundary = min(end, len(seq.prompt_ids)) // bs * bs
        if seq.num_computed < boundary < end:
            chunk = chunk[:boundary - seq.num_computed]
    # Shrink to the blocks that can still be had rather than wait for all of them.
    room = (len(seq.block_table) + core.pool.num_free + core.pool.num_cached) \
        * core.block_size - seq.num_computed
    return chunk[:max(room, 0)]


def _row(seq: Sequence, chunk: list[int]) -> PackedRow:
    start = seq.num_computed
    targets = ()
    if seq.prompt_logprobs is not None and start < len(seq.prompt_ids):
        targets = seq.prompt_targets(start, len(chunk))
    scheduled = ScheduledRow(RowChunk(chunk, start, seq.block_table, seq.slot),
                             seq.row_sampling(), targets)
    return PackedRow(seq, seq.epoch, start + len(chunk) == seq.virtual_len, scheduled)


def pack_lanes(core: "SchedulerCore") -> list[PackedRow]:
    budget = core.levers_now.max_tokens_per_tick
    packed: list[PackedRow] = []
    in_batch: set[int] = set()

    for seq in list(core.active):  # Decode
        if budget == 0 or seq.status is not Status.RUNNING or not seq.may_sample_more():
            continue
        chunk = seq.next_chunk(budget)
        while not _grow(core, seq, seq.num_computed + len(chunk)):
            if not core.make_room(seq, in_batch):
                chunk = []
                break
        if chunk:
            packed.append(_row(seq, chunk))
            in_batch.add(id(seq))
            budget -= len(chunk)

    for seq in list(core.prefilling):  # ContinuePrefills, then StartPrefills (admission order)
        if budget == 0 or seq.status is not Status.PREFILLING:
            continue
        chunk = _prefill_chunk(core, seq, budget)
        if chunk and _grow(core, seq, seq.num_computed + len(chunk)):
            packed.append(_row(seq, chunk))
            in_batch.add(id(seq))
            budget -= len(chunk)

    if not packed and core.prefilling and len(core.prefilling) + len(core.active) > 1:
        # Every prefill is starved of blocks: free the newest so the others can progress.
        core.preempt(max(core.prefilling, key=lambda s: s.order))
    return packed


def mark_dispatched(core: "SchedulerCore", packed: list[PackedRow]) -> None:
    """Host bookkeeping that does not wait for the device: computed counts, in-flight
    tokens, prompt blocks into the prefix cache, SSM snapshots at block boundaries."""
    for p in packed:
        seq = p.seq
        seq.num_computed += len(p.row.chunk.tokens)
        if p.samples:
            seq.inflight += 1
            if seq.status is Status.PREFILLING:
                seq.status = Status.RUNNING
                core.prefilling.remove(seq)
                core.active.append(seq)
        committed = core.commit_blocks(seq)
        if committed and core.runner.has_ssm and seq.num_computed == \
                len(seq.block_hashes) * core.block_size:
            slot = core.snapshots.reserve(seq.block_hashes[-1])
            if slot is not None:  # the copy runs after this step on the device
                core.runner.copy_slots([seq.slot], [slot])
