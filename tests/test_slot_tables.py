"""Penalties and logit bias read from the per-slot device tables equal a numpy reference
computed from the row's own prompt and output ids, whichever way the sequence reached its
slot: steps that ran every token there, a prefix-cache hit (prompt positions never run in
the slot), a swap-in (a new slot, nothing replayed), a slot left behind by another sequence,
an anonymous row, and a bias that changes (min_tokens running out) or goes away."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import build_step_batch
from metrale_jax.runner.penalties import PENALTY_CHUNK
from metrale_jax.runner.sampler import bias_and_penalties, make_sampling_arrays
from metrale_jax.runner.slot_tables import (SlotBook, allocate_slot_tables, record_tokens,
                                            write_bias, write_history)
from metrale_jax.types import RowSampling, ScheduledRow

VOCAB, SEQ_SLOTS, BIAS = 40, 5, 4
SHAPE = StepShape(tokens=16, rows=4, query_len=16, max_blocks=4)
BLOCK = 4  # 4 blocks of 4 cover 16 positions


@functools.partial(jax.jit, donate_argnums=(0,))
def _step(tables, batch, params, logits):
    """The part of the engine's step that touches the tables: record, then process."""
    sampling = dataclasses.replace(tables.sampling,
                                   history=record_tokens(tables.sampling.history, batch))
    return dataclasses.replace(tables, sampling=sampling), bias_and_penalties(
        logits, params, sampling)


class Harness:
    """A SlotBook and its tables, driven as the runner drives them."""

    def __init__(self, history_len: int = 16):
        self.book = SlotBook(SEQ_SLOTS, history_len, BIAS)
        self.tables = allocate_slot_tables(SEQ_SLOTS, SEQ_SLOTS, history_len, BIAS)
        self.host_writes = 0

    def run(self, rows: list[ScheduledRow], logits: np.ndarray) -> np.ndarray:
        for w in self.book.plan(rows):
            self.host_writes += 1
            if w.history is not None:
                self.tables = write_history(self.tables, np.int32(w.slot), w.history)
            if w.bias_ids is not None:
                self.tables = write_bias(self.tables, np.int32(w.slot), w.bias_ids,
                                         w.bias_values)
        batch = build_step_batch(rows, SHAPE, BLOCK)
        params = make_sampling_arrays([r.sampling for r in rows], SHAPE.rows,
                                      slots=[r.ssm_slot for r in rows],
                                      history_lens=[r.end for r in rows])
        self.tables, out = _step(self.tables, batch, params, logits)
        return np.asarray(out)[:len(rows)]


def reference(logits: np.ndarray, s: RowSampling) -> np.ndarray:
    """Bias, then repetition over prompt + output, then frequency/presence over output."""
    x = logits.astype(np.float32).copy()
    for t, b in s.logit_bias.items():
        x[t] += np.float32(b)
    for t in set(s.prompt_ids) | set(s.output_ids):
        x[t] = x[t] / np.float32(s.repetition_penalty) if x[t] > 0 else \
            x[t] * np.float32(s.repetition_penalty)
    for t in set(s.output_ids):
        x[t] -= np.float32(s.frequency_penalty) * s.output_ids.count(t)
        x[t] -= np.float32(s.presence_penalty)
    return x


PENALTIES = dict(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3)


def row(seq_id: int, slot: int, prompt: list[int], output: list[int], start: int,
        bias=None, **penalties) -> ScheduledRow:
    """The chunk from `start` to the end of the known ids (the sampling row of a step)."""
    ids = prompt + output
    return ScheduledRow(ids[start:], start, list(range(1, 5)), slot,
                        RowSampling(prompt_ids=prompt, output_ids=output,
                                    logit_bias=bias or {}, **(penalties or PENALTIES)),
                        seq_id=seq_id)


def check(h: Harness, rows: list[ScheduledRow], seed: int) -> None:
    logits = np.random.default_rng(seed).normal(size=(SHAPE.rows, VOCAB)).astype(np.float32)
    got = h.run(rows, logits)
    for i, r in enumerate(rows):
        np.testing.assert_allclose(got[i], reference(logits[i], r.sampling), rtol=1e-6,
                                   atol=1e-6, err_msg=f"row {i}")


def test_history_follows_every_way_into_a_slot():
    h = Harness()
    a_prompt, a_out = [5, 6, 7, 5], [9, 3]
    check(h, [row(1, 1, a_prompt, [], 0)], seed=0)                # A prefills in slot 1
    check(h, [row(1, 1, a_prompt, a_out[:1], 4)], seed=1)         # A decodes
    assert h.host_writes == 0                                     # the steps wrote it all
    # B hits A's cached prefix: positions 0..3 never ran in slot 2.
    b_prompt = [5, 6, 7, 5, 8, 8]
    check(h, [row(2, 2, b_prompt, [], 4), row(1, 1, a_prompt, a_out, 5)], seed=2)
    assert h.host_writes == 1
    # A is swapped out and back into slot 3: nothing replayed there.
    check(h, [row(1, 3, a_prompt, a_out + [3], 6), row(2, 2, b_prompt, [11], 6)], seed=3)
    assert h.host_writes == 2
    # C takes A's old slot 1 with a prefix hit on other tokens: A's ids there are stale.
    c_prompt = [1, 2, 3, 4, 7]
    check(h, [row(3, 1, c_prompt, [], 4)], seed=4)
    assert h.host_writes == 3
    # A preempted and recomputed in slot 3 again: its own tokens, nothing to write.
    check(h, [row(1, 3, a_prompt, a_out + [3, 3], 0)], seed=5)
    assert h.host_writes == 3
    # An anonymous row (seq_id 0) is never trusted: written whenever it starts past 0.
    check(h, [row(0, 4, [2, 2], [2], 2)], seed=6)
    check(h, [row(0, 4, [2, 2], [2, 5], 3)], seed=7)
    assert h.host_writes == 5


def test_rows_without_penalties_are_untouched_by_what_their_slot_holds():
    h = Harness()
    check(h, [row(1, 1, [4, 4, 4], [4], 0)], seed=0)
    off = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    check(h, [row(2, 1, [9, 9], [9], 2, **off), row(3, 2, [4], [], 0)], seed=1)
    assert h.host_writes == 0  # no penalties: no history to fix up


def test_bias_is_written_when_it_changes_and_ignored_when_gone():
    h = Harness()
    banned = {3: -1e9, 8: 2.5}
    check(h, [row(1, 1, [4, 5], [], 0, bias=banned)], seed=0)
    check(h, [row(1, 1, [4, 5], [6], 2, bias=banned)], seed=1)
    assert h.host_writes == 1                       # same entries: written once
    check(h, [row(1, 1, [4, 5], [6, 6], 3, bias={8: 2.5})], seed=2)   # min_tokens reached
    assert h.host_writes == 2
    check(h, [row(2, 1, [4], [], 0), row(1, 2, [4, 5], [6, 6, 1], 0, bias={8: 2.5})], seed=3)
    assert h.host_writes == 3                       # slot 1's table is ignored, slot 2 written


def test_long_histories_are_read_in_chunks():
    # A table several chunks wide; rows of very different lengths in one step.
    width = 3 * PENALTY_CHUNK
    h = Harness(history_len=width)
    rng = np.random.default_rng(9)
    long_prompt = rng.integers(0, VOCAB, size=width - 40).tolist()
    long_out = rng.integers(0, VOCAB, size=30).tolist()
    rows = [row(1, 1, long_prompt, long_out, width - 70 - 4), row(2, 2, [1, 2], [3], 0)]
    # SHAPE holds 16 tokens: start the long row near its end (a prefix hit, then a write).
    rows[0] = dataclasses.replace(rows[0], tokens=rows[0].tokens[-4:],
                                  start=len(long_prompt) + len(long_out) - 4,
                                  block_table=list(range(1, 1 + width // BLOCK)))
    h_shape = StepShape(16, 4, 16, width // BLOCK)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    for w in h.book.plan(rows):
        h.tables = write_history(h.tables, np.int32(w.slot), w.history)
    batch = build_step_batch(rows, h_shape, BLOCK)
    params = make_sampling_arrays([r.sampling for r in rows], 4, slots=[1, 2],
                                  history_lens=[r.end for r in rows])
    _, out = _step(h.tables, batch, params, logits)
    for i, r in enumerate(rows):
        np.testing.assert_allclose(np.asarray(out)[i], reference(logits[i], r.sampling),
                                   rtol=1e-6, atol=1e-6)


def test_book_refuses_what_the_tables_cannot_hold():
    book = SlotBook(SEQ_SLOTS, 8, 2)
    with pytest.raises(ValueError, match="history 9 > 8"):
        book.plan([row(1, 1, list(range(9)), [], 0)])
    with pytest.raises(ValueError, match="max_logit_bias"):
        book.plan([row(1, 1, [1], [], 0, bias={1: 1.0, 2: 1.0, 3: 1.0})])
    with pytest.raises(ValueError, match="sequence slot"):
        book.plan([row(1, 0, [1], [], 0)])
