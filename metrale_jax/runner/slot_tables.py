"""Per-slot device state beside the caches, and the host's book of what it holds.

Each running sequence has a slot (`ScheduledRow.ssm_slot`; slot 0 is the null slot). Next to
its SSM state the device keeps, per slot:
  future   — the latest token sampled in that slot (the async pipeline's hand-off);
  drafts, advance — after a speculative step, the slot's next drafts and how many drafts
             it accepted: a row dispatched before that step is read back starts from them
             (`spec_step.place_ahead_rows`);
  history  — the slot's token ids by position, which the penalties read;
  bias     — the slot's logit-bias entries.
Every step writes each of its tokens into history[slot, position], so a decoding sequence's
history grows on the device with no transfer. Positions a step never ran in that slot (a
prefix-cache hit skips prompt tokens, a swap-in restores KV without replaying them) are
written from the host, once, when a row that uses penalties finds its slot's history short;
a row's bias entries are written when they differ from what its slot holds. Both writes are
one fixed-shape jitted call each, so nothing compiles after warm-up. `SlotBook` is the host's
record that decides which writes a step needs: per slot, whose tokens the history holds and
up to which position, and which bias entries.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from metrale_jax.model.batch import StepBatch
from metrale_jax.runner.penalties import SamplingTables
from metrale_jax.types import ScheduledRow


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotTables:
    future: Int[Array, "N"]     # [slots] each slot's latest sampled token
    sampling: SamplingTables    # [seq slots, ...] history and logit bias per sequence slot
    drafts: Int[Array, "N K"]   # [slots, k] the last speculative step's drafts (k = 0: none)
    advance: Int[Array, "N"]    # [slots] drafts that step accepted


def allocate_slot_tables(num_slots: int, num_seq_slots: int, history_len: int,
                         bias_len: int, depth: int = 0) -> SlotTables:
    """`depth`: the speculative steps' drafts per row (0: no speculation)."""
    return SlotTables(
        future=jnp.zeros((num_slots,), jnp.int32),
        drafts=jnp.zeros((num_slots, depth), jnp.int32),
        advance=jnp.zeros((num_slots,), jnp.int32),
        sampling=SamplingTables(
            history=jnp.full((num_seq_slots, history_len), -1, jnp.int32),
            bias_ids=jnp.full((num_seq_slots, bias_len), -1, jnp.int32),
            bias_values=jnp.zeros((num_seq_slots, bias_len), jnp.float32)))


def record_tokens(history: Int[Array, "M H"], batch: StepBatch) -> Int[Array, "M H"]:
    """Inside the step: every real token of the batch into history[its row's slot, its
    position]. Real tokens come first in the flat layout; padding is dropped."""
    real = jnp.arange(batch.num_tokens) < jnp.sum(batch.gather_valid)
    slot = jnp.where(real, batch.ssm_slots[batch.token_row], history.shape[0])
    return history.at[slot, batch.positions].set(batch.token_ids, mode="drop")


def write_history(tables: SlotTables, slot: Int[Array, ""], ids: Int[Array, "H"],
                  ) -> SlotTables:
    """One slot's whole history row from the host (jitted with `tables` donated)."""
    s = tables.sampling
    return dataclasses.replace(tables, sampling=dataclasses.replace(
        s, history=s.history.at[slot].set(ids)))


def write_bias(tables: SlotTables, slot: Int[Array, ""], ids: Int[Array, "B"],
               values: Float[Array, "B"]) -> SlotTables:
    """One slot's logit-bias entries (-1 padded) from the host (jitted, donated)."""
    s = tables.sampling
    return dataclasses.replace(tables, sampling=dataclasses.replace(
        s, bias_ids=s.bias_ids.at[slot].set(ids), bias_values=s.bias_values.at[slot].set(values)))


@dataclasses.dataclass
class SlotWrite:
    """A host write a step needs first: a history row and/or bias entries of one slot."""

    slot: int
    history: np.ndarray | None = None  # [H] int32, -1 past the known tokens
    bias_ids: np.ndarray | None = None  # [B] int32, -1 padded
    bias_values: np.ndarray | None = None  # [B] float32


@dataclasses.dataclass
class _Slot:
    owner: int = 0    # seq_id whose tokens the history row holds (0: anonymous, never trusted)
    valid: int = 0    # history[0:valid] holds the owner's tokens
    bias: Mapping[int, float] = dataclasses.field(default_factory=dict)  # what the device holds


class SlotBook:
    """The host's record of the slot tables; `plan` says what a step must write first."""

    def __init__(self, num_seq_slots: int, history_len: int, bias_len: int):
        self.history_len, self.bias_len = history_len, bias_len
        self._slots = [_Slot() for _ in range(num_seq_slots)]

    def plan(self, rows: Sequence[ScheduledRow]) -> list[SlotWrite]:
        """The writes `rows` need before their step, with the book advanced past both (the
        caller runs the writes, then the step, in that order)."""
        for i, r in enumerate(rows):
            self._check(i, r)
        writes = []
        for r in rows:
            write = self._history_write(r)
            bias = self._bias_write(r)
            if bias is not None:
                write = write or SlotWrite(r.ssm_slot)
                write.bias_ids, write.bias_values = bias
            if write is not None:
                writes.append(write)
        return writes

    def _check(self, i: int, r: ScheduledRow) -> None:
        s = r.sampling
        if not (s.uses_penalties or s.logit_bias):
            return
        if not 0 < r.ssm_slot < len(self._slots):
            raise ValueError(f"row {i}: penalties and logit bias need a sequence slot in "
                             f"1..{len(self._slots) - 1}, got {r.ssm_slot}")
        if r.end > self.history_len:
            raise ValueError(f"row {i}: history {r.end} > {self.history_len}")
        if len(s.logit_bias) > self.bias_len:
            raise ValueError(f"row {i}: {len(s.logit_bias)} logit-bias entries > "
                             f"max_logit_bias ({self.bias_len})")

    def _history_write(self, r: ScheduledRow) -> SlotWrite | None:
        """Advance the slot's record by the step's tokens [start, end); when a penalized row
        finds [0, start) not known there, write the known ids (prompt + output) first."""
        if not 0 <= r.ssm_slot < len(self._slots):
            return None  # not a sequence slot: the step's writes there are dropped
        slot = self._slots[r.ssm_slot]
        if slot.owner != r.seq_id or r.seq_id == 0:
            slot.owner, slot.valid = r.seq_id, 0
        write = None
        if r.sampling.uses_penalties and slot.valid < r.start:
            known = len(r.sampling.prompt_ids) + len(r.sampling.output_ids)
            if known < r.start:
                raise ValueError(f"row in slot {r.ssm_slot}: {known} known token ids do not "
                                 f"cover the {r.start} already computed")
            ids = np.full(self.history_len, -1, np.int32)
            ids[:known] = np.fromiter(itertools.chain(r.sampling.prompt_ids,
                                                      r.sampling.output_ids), np.int32, known)
            write, slot.valid = SlotWrite(r.ssm_slot, history=ids), known
        if slot.valid >= r.start:  # drafts are not the sequence's tokens until verified
            slot.valid = max(slot.valid, r.verified_end)
        return write

    def _bias_write(self, r: ScheduledRow) -> tuple[np.ndarray, np.ndarray] | None:
        bias = r.sampling.logit_bias
        slot = self._slots[r.ssm_slot]
        if not bias or bias == slot.bias:
            return None
        ids = np.full(self.bias_len, -1, np.int32)
        values = np.zeros(self.bias_len, np.float32)
        ids[:len(bias)] = list(bias.keys())
        values[:len(bias)] = list(bias.values())
        slot.bias = dict(bias)
        return ids, values
