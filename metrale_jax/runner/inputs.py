"""Host side of the step contract: pack scheduled chunks into one padded `StepBatch`.

Everything here is numpy; the result goes to the device as one pytree. Padding follows the
rules of `metrale_jax.model.batch`: padding tokens write into the null block, padding rows
use the null SSM slot and have no context.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from metrale_jax.model.batch import StepBatch
from metrale_jax.runner.buckets import StepShape


@dataclasses.dataclass(frozen=True)
class RowChunk:
    """One sequence's share of a step: `tokens` at positions `start .. start+len-1`."""

    tokens: Sequence[int]
    start: int                  # tokens of this sequence already in the caches
    block_table: Sequence[int]  # physical blocks covering at least start + len(tokens)
    ssm_slot: int = 0
    adapter_slot: int = 0       # LoRA device slot (0: the base model)
    # Penalty and prompt-logprob bookkeeping stay with the caller; the batch only needs where
    # each row ends.

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def reach(self) -> int:
        """The positions the row may write (a speculative row's may lie past `end`)."""
        return self.end


def build_step_batch(rows: Sequence[RowChunk], shape: StepShape, block_size: int,
                     ) -> StepBatch:
    """Lay `rows` out flat and padded into `shape` (the bucket the caller picked).

    Vectorised over rows: at batch 64 this runs every tick on the host's critical path.
    """
    t, s, q, mb = shape.tokens, shape.rows, shape.query_len, shape.max_blocks
    r = len(rows)
    lens = np.fromiter((len(row.tokens) for row in rows), np.int32, r)
    starts = np.fromiter((row.start for row in rows), np.int32, r)
    n = int(lens.sum())
    if r > s or n > t:
        raise ValueError(f"{n} tokens in {r} rows exceed bucket {shape}")
    bad = np.flatnonzero((lens == 0) | (lens > q))
    if bad.size:
        raise ValueError(f"row {bad[0]}: chunk of {lens[bad[0]]} tokens does not fit query "
                         f"bucket {q}")
    block_tables = np.zeros((s, mb), np.int32)
    for i, row in enumerate(rows):
        table = row.block_table
        width = min(len(table), mb)
        needed = -(-row.reach // block_size)
        if needed > width:
            raise ValueError(f"row {i}: {row.reach} tokens need {needed} blocks, "
                             f"table has {len(table)}, bucket {mb}")
        block_tables[i, :width] = table[:width]

    cursor = np.zeros(r + 1, np.int32)
    np.cumsum(lens, out=cursor[1:])
    row_of = np.repeat(np.arange(r, dtype=np.int32), lens)
    col_of = np.arange(n, dtype=np.int32) - cursor[:-1][row_of]
    pos = starts[row_of] + col_of

    token_ids = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slot_mapping = np.zeros(t, np.int32)
    token_row = np.zeros(t, np.int32)
    token_col = np.zeros(t, np.int32)
    token_ids[:n] = np.fromiter(itertools.chain.from_iterable(row.tokens for row in rows),
                                np.int32, n)
    positions[:n] = pos
    slot_mapping[:n] = block_tables[row_of, pos // block_size] * block_size + pos % block_size
    token_row[:n] = row_of
    token_col[:n] = col_of

    cols = np.arange(q, dtype=np.int32)
    gather_valid = np.zeros((s, q), bool)
    gather_valid[:r] = cols[None, :] < lens[:, None]
    gather_index = np.zeros((s, q), np.int32)
    gather_index[:r] = np.where(gather_valid[:r], cursor[:-1, None] + cols[None, :], 0)
    context_lens = np.zeros(s, np.int32)
    context_lens[:r] = starts + lens
    ssm_slots = np.zeros(s, np.int32)
    ssm_slots[:r] = np.fromiter((row.ssm_slot for row in rows), np.int32, r)
    ssm_fresh = np.zeros(s, bool)
    ssm_fresh[:r] = starts == 0
    adapter_slots = np.zeros(s, np.int32)
    adapter_slots[:r] = np.fromiter((row.adapter_slot for row in rows), np.int32, r)
    sample_index = np.zeros(s, np.int32)
    sample_index[:r] = cursor[1:] - 1
    return StepBatch(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                     token_row=token_row, token_col=token_col, gather_index=gather_index,
                     gather_valid=gather_valid, context_lens=context_lens,
                     block_tables=block_tables, ssm_slots=ssm_slots, ssm_fresh=ssm_fresh,
                     sample_index=sample_index, adapter_slots=adapter_slots)
