"""Phase 8: the lanes StartPrefills, ContinuePrefills and Decode, packed into one ragged
batch under the tick's token budget (prefill chunks and decode tokens side by side).

Decodes are packed first: one token each, so a long prompt never stalls running sequences;
prefill chunks fill the rest of the budget in admission order. Packing only reads the
running lists and grows block tables: when a decode finds no free block it stops and says
so (`Packing.needs_room`), and the core decides how to make room, then packs again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

from metrale_jax.grammar.masks import grammar_masks
from metrale_jax.scheduler.levers import LeverValues
from metrale_jax.scheduler.memory import Memory
from metrale_jax.sequence import Sequence, Status
from metrale_jax.types import ScheduledRow


@dataclasses.dataclass
class PackedRow:
    """A row in flight, with what the host needs to apply its result."""

    seq: Sequence
    epoch: int          # results for an older epoch (the sequence was preempted) are dropped
    samples: bool       # the chunk reaches the sequence's end: its sampled token counts
    row: ScheduledRow


@dataclasses.dataclass
class Packing:
    rows: list[PackedRow]
    # A decode that found no free block: the core makes room (spill or preempt another
    # sequence, never one already in `rows`) and packs again.
    needs_room: Sequence | None = None
    # Every prefill is starved of blocks and nothing else runs: the newest should give
    # its blocks back so the others can progress.
    starved: Sequence | None = None


def _prefill_chunk(memory: Memory, levers: LeverValues, seq: Sequence,
                   budget: int) -> list[int]:
    size = min(budget, levers.prefill_chunk_size)
    chunk = seq.next_chunk(size)
    end = seq.num_computed + len(chunk)
    # On a hybrid model with prefix caching, a prefill chunk stops on the prompt's last full
    # block boundary it crosses, so the SSM state there can be snapshotted for reuse (a
    # chunk that ran on to the prompt's end would leave no snapshot for short prompts), or
    # first where its cached KV ended without a snapshot (`Sequence.snapshot_cut`).
    if memory.has_ssm and levers.prefix_cache_enabled:
        bs = memory.block_size
        boundary = min(end, len(seq.prompt_ids)) // bs * bs
        if seq.num_computed < seq.snapshot_cut < boundary:
            boundary = seq.snapshot_cut  # where a shared prefix ends: snapshot it
        if seq.num_computed < boundary < end:
            chunk = chunk[:boundary - seq.num_computed]
    # Shrink to the blocks that can still be had rather than wait for all of them.
    room = (len(seq.block_table) + memory.reclaimable) * memory.block_size - seq.num_computed
    return chunk[:max(room, 0)]


def _samples(seq: Sequence, chunk: list[int]) -> bool:
    """The chunk reaches the sequence's end: the row samples its next token."""
    return seq.num_computed + len(chunk) == seq.virtual_len


def _row(seq: Sequence, chunk: list[int], drafts: list[int] = (), spec_depth: int = 0,
         masks: np.ndarray | None = None) -> PackedRow:
    start = seq.num_computed
    targets = ()
    if seq.prompt_logprobs is not None and start < len(seq.prompt_ids):
        targets = seq.prompt_targets(start, len(chunk))
    samples = _samples(seq, chunk)
    end = start + len(chunk)
    # A speculative step's MTP modules read the known tokens past a chunk that stops short.
    follow = seq.all_ids[end:end + spec_depth] if spec_depth and not samples else ()
    scheduled = ScheduledRow(chunk + list(drafts), start, seq.block_table, seq.slot,
                             seq.row_sampling(), targets, seq.uid, num_drafts=len(drafts),
                             follow=follow, token_mask=masks,
                             adapter_slot=seq.adapter_slot)
    return PackedRow(seq, seq.epoch, samples, scheduled)


def _ahead_row(seq: Sequence, spec_depth: int) -> PackedRow:
    """A decode row packed before the speculative step ahead is read back: its last token
    and drafts are that step's outputs, still on the device (placeholders here), and it
    starts as many positions later as that step accepted drafts. Its blocks cover the
    most that step could have accepted."""
    seq.ahead_reach = spec_depth
    scheduled = ScheduledRow([-seq.slot] * (spec_depth + 1), seq.num_computed,
                             seq.block_table, seq.slot, seq.row_sampling(), (), seq.uid,
                             num_drafts=spec_depth, adapter_slot=seq.adapter_slot, ahead=True)
    return PackedRow(seq, seq.epoch, True, scheduled)


def pack_lanes(active: list[Sequence], prefilling: list[Sequence], memory: Memory,
               levers: LeverValues, skip: Collection[int] = (), spec_depth: int = 0,
               ahead: bool = False) -> Packing:
    """One batch from the running lists; `skip` holds ids of decodes that found no room.
    `spec_depth` > 0: a speculative tick, where decodes carry their drafts (the budget
    counts them) and prefill chunks the tokens after them. `ahead`: the speculative step
    ahead is not read back yet, and every decode can run ahead of it (the core checked
    `Sequence.can_run_ahead`): each gets a row the device completes (`_ahead_row`)."""
    budget = levers.max_tokens_per_tick
    packed: list[PackedRow] = []

    for seq in active:  # Decode
        if budget == 0 or seq.status is not Status.RUNNING or not seq.may_sample_more() \
                or id(seq) in skip:
            continue
        if ahead:
            if budget < spec_depth + 1:
                continue
            if not memory.grow(seq, seq.num_computed + 2 * spec_depth + 1):
                return Packing(packed, needs_room=seq)
            packed.append(_ahead_row(seq, spec_depth))
            budget -= spec_depth + 1
            continue
        chunk = seq.next_chunk(budget)
        drafts = seq.drafts_to_verify(spec_depth, budget) if spec_depth else []
        # A constrained row's drafts are checked against its grammar here, before they
        # take blocks: one mask per position the row samples.
        drafts, masks = grammar_masks(seq, _samples(seq, chunk), drafts)
        if not memory.grow(seq, seq.num_computed + len(chunk) + len(drafts)):
            return Packing(packed, needs_room=seq)
        packed.append(_row(seq, chunk, drafts, spec_depth, masks))
        budget -= len(chunk) + len(drafts)

    for seq in prefilling:  # ContinuePrefills, then StartPrefills (admission order)
        if budget == 0 or seq.status is not Status.PREFILLING:
            continue
        chunk = _prefill_chunk(memory, levers, seq, budget)
        if chunk and memory.grow(seq, seq.num_computed + len(chunk)):
            packed.append(_row(seq, chunk, spec_depth=spec_depth,
                               masks=grammar_masks(seq, _samples(seq, chunk))[1]))
            budget -= len(chunk)

    starved = None
    if not packed and prefilling and len(prefilling) + len(active) > 1:
        starved = max(prefilling, key=lambda s: s.order)
    return Packing(packed, starved=starved)


def mark_dispatched(packed: list[PackedRow], memory: Memory) -> list[Sequence]:
    """Host bookkeeping that does not wait for the device: computed counts, in-flight
    tokens, known blocks into the prefix cache, SSM snapshots at block boundaries (staged
    when the token that ends the block is still on the device).
    Returns the prefills that reached their end (they decode from now on)."""
    done_prefilling = []
    for p in packed:
        seq = p.seq
        # Drafts count as computed only once verified (`commit_step`), so a row with drafts
        # commits no block here: the device state then is not that of `num_computed`.
        seq.num_computed += len(p.row.tokens) - p.row.num_drafts
        if p.samples:
            seq.inflight += 1
            if seq.status is Status.PREFILLING:
                seq.status = Status.RUNNING
                done_prefilling.append(seq)
        if not p.row.num_drafts:
            # Every row that ends on a block boundary keeps its SSM state there, prefill
            # chunk or decode token; one batch of copies for the whole step.
            memory.commit_blocks(seq)
            memory.snapshot_boundary(seq)
    memory.flush_copies()
    return done_prefilling
