"""Host side of the step contract: pack scheduled chunks into one padded `StepBatch`.

Everything here is numpy; the result goes to the device as one pytree. Padding follows the
rules of `metrale_jax.model.batch`: padding tokens write into the null block, padding rows
use the null SSM slot and have no context.
"""

from __future__ import annotations

import dataclasses
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
    # Penalty and prompt-logprob bookkeeping stay with the caller; the batch only needs where
    # each row ends.

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def build_step_batch(rows: Sequence[RowChunk], shape: StepShape, block_size: int,
                     ) -> StepBatch:
    """Lay `rows` out flat and padded into `shape` (the bucket the caller picked)."""
    t, s, q, mb = shape.tokens, shape.rows, shape.query_len, shape.max_blocks
    token_ids = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slot_mapping = np.zeros(t, np.int32)
    token_row = np.zeros(t, np.int32)
    token_col = np.zeros(t, np.int32)
    gather_index = np.zeros((s, q), np.int32)
    gather_valid = np.zeros((s, q), bool)
    context_lens = np.zeros(s, np.int32)
    block_tables = np.zeros((s, mb), np.int32)
    ssm_slots = np.zeros(s, np.int32)
    ssm_fresh = np.zeros(s, bool)
    sample_index = np.zeros(s, np.int32)

    cursor = 0
    for r, row in enumerate(rows):
        n = len(row.tokens)
        if n == 0 or n > q:
            raise ValueError(f"row {r}: chunk of {n} tokens does not fit query bucket {q}")
        needed = -(-row.end // block_size)
        if needed > len(row.block_table) or needed > mb:
            raise ValueError(f"row {r}: {row.end} tokens need {needed} blocks, table has "
                             f"{len(row.block_table)}, bucket {mb}")
        span = slice(cursor, cursor + n)
        pos = np.arange(row.start, row.end, dtype=np.int32)
        table = np.asarray(row.block_table, np.int32)
        token_ids[span] = row.tokens
        positions[span] = pos
        slot_mapping[span] = table[pos // block_size] * block_size + pos % block_size
        token_row[span] = r
        token_col[span] = np.arange(n)
        gather_index[r, :n] = np.arange(cursor, cursor + n)
        gather_valid[r, :n] = True
        context_lens[r] = row.end
        block_tables[r, :min(len(table), mb)] = table[:mb]
        ssm_slots[r] = row.ssm_slot
        ssm_fresh[r] = row.start == 0
        sample_index[r] = cursor + n - 1
        cursor += n
    if cursor > t or len(rows) > s:
        raise ValueError(f"{cursor} tokens in {len(rows)} rows exceed bucket {shape}")
    return StepBatch(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                     token_row=token_row, token_col=token_col, gather_index=gather_index,
                     gather_valid=gather_valid, context_lens=context_lens,
                     block_tables=block_tables, ssm_slots=ssm_slots, ssm_fresh=ssm_fresh,
                     sample_index=sample_index)
