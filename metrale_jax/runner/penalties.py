"""Repetition/presence/frequency penalties and logit bias, read on the device from per-slot
tables (`SamplingTables`) through each row's slot.

Neither the history length nor the number of bias entries is a shape of the step: the tables
have fixed widths (the engine's max_seq_len, rounded up to `PENALTY_CHUNK`, and its
`max_logit_bias`), the runner keeps them up to date (runner/slot_tables.py), and the step
applies them under traced conds, so one compiled step serves every mix of requests. The
penalty pass walks the history in chunks up to the longest penalized row, so its cost follows
the real lengths, not the table width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

# History positions per penalty pass; the history table's width is a multiple of it.
PENALTY_CHUNK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTables:
    """Per-slot device tables the sampler reads through each row's slot."""

    history: Int[Array, "M H"]        # [slots, H] each slot's token ids by position
    bias_ids: Int[Array, "M B"]       # [slots, B] logit-bias token ids, -1 padded
    bias_values: Float[Array, "M B"]  # [slots, B] the bias of each entry


def history_width(max_seq_len: int) -> int:
    """Width of the history table: max_seq_len rounded up to whole penalty chunks."""
    chunk = min(PENALTY_CHUNK, max_seq_len)
    return -(-max_seq_len // chunk) * chunk


def _scatter_index(ids: Int[Array, "S N"], vocab: int) -> Int[Array, "S N"]:
    # jnp scatters wrap negative indices even with mode="drop", so route padding
    # (-1) and out-of-vocab ids to index `vocab`, which "drop" then discards.
    return jnp.where((ids >= 0) & (ids < vocab), ids, vocab)


def row_scatter_add(base: Array, ids: Int[Array, "S N"], values: Array) -> Array:
    """base[r, ids[r, j]] += values[r, j]; ids outside [0, V) are dropped."""
    rows = jnp.arange(base.shape[0])[:, None]
    return base.at[rows, _scatter_index(ids, base.shape[1])].add(values, mode="drop")


def uses_penalties(repetition: Float[Array, "S"], presence: Float[Array, "S"],
                   frequency: Float[Array, "S"]) -> Bool[Array, "S"]:
    return (repetition != 1.0) | (presence != 0.0) | (frequency != 0.0)


def apply_slot_bias(logits: Float[Array, "S V"], tables: SamplingTables, slots: Int[Array, "S"],
                    bias_on: Bool[Array, "S"]) -> Float[Array, "S V"]:
    """Add each biased row's table entries (rows without bias read nothing)."""
    ids = jnp.where(bias_on[:, None], tables.bias_ids[slots], -1)
    return row_scatter_add(logits, ids, tables.bias_values[slots].astype(logits.dtype))


def penalty_counts(history: Int[Array, "M H"], slots: Int[Array, "S"], lens: Int[Array, "S"],
                   prompt_lens: Int[Array, "S"], vocab: int,
                   ) -> tuple[Bool[Array, "S V"], Int[Array, "S V"]]:
    """Per row: which tokens occur in history[slot, :len] (prompt and output), and how often
    each occurs in its output part (positions >= prompt_len). Rows with len 0 count nothing.

    The history is read in chunks of PENALTY_CHUNK positions, as many as the longest row
    needs (a traced trip count): a short history costs one chunk whatever the table width."""
    width = history.shape[1]
    chunk = min(PENALTY_CHUNK, width)
    if width % chunk:
        raise ValueError(f"history width {width} is not a multiple of {chunk}")
    zeros = jnp.zeros((slots.shape[0], vocab), jnp.int32)
    ones = jnp.ones((slots.shape[0], chunk), jnp.int32)

    def count(i, counts):
        seen, out = counts
        first = i * chunk
        ids = jax.lax.dynamic_slice_in_dim(history, first, chunk, axis=1)[slots]  # [S, C]
        pos = first + jnp.arange(chunk)[None, :]
        valid = pos < lens[:, None]
        output = valid & (pos >= prompt_lens[:, None])
        return (row_scatter_add(seen, jnp.where(valid, ids, -1), ones),
                row_scatter_add(out, jnp.where(output, ids, -1), ones))

    passes = (jnp.max(lens) + chunk - 1) // chunk
    seen, out = jax.lax.fori_loop(0, passes, count, (zeros, zeros))
    return seen > 0, out


def penalize(logits: Float[Array, "S V"], seen: Bool[Array, "S V"], out_counts: Int[Array, "S V"],
             repetition: Float[Array, "S"], presence: Float[Array, "S"],
             frequency: Float[Array, "S"]) -> Float[Array, "S V"]:
    """Repetition (prompt+output, HF/vLLM) then frequency/presence (output, OpenAI)."""
    counts = out_counts.astype(logits.dtype)
    rep = repetition[:, None].astype(logits.dtype)
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0)
