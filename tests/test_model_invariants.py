"""Invariants of the ragged paged step on a tiny hybrid (Mamba2 + attention + MLP) model.

Each compares the step with an independent way of computing the same thing: a full forward,
sequences run alone, an unchunked prefill, another block size or block placement.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk
from tests.helpers import TINY_HYBRID, Forward

ATOL = 2e-5
PREFILL = StepShape(tokens=32, rows=4, query_len=32, max_blocks=16)
DECODE = StepShape(tokens=4, rows=4, query_len=1, max_blocks=16)


@pytest.fixture(scope="module")
def fwd() -> Forward:
    return Forward()


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, TINY_HYBRID.vocab_size, n).tolist()


def _table(seed: int, n: int = 16, num_blocks: int = 64) -> list[int]:
    """A shuffled set of distinct physical blocks (never the null block 0)."""
    return (np.random.default_rng(seed).permutation(num_blocks - 1)[:n] + 1).tolist()


def _chunked(fwd: Forward, tokens: list[int], table: list[int], slot: int,
             cuts: list[int]) -> np.ndarray:
    """Logits at every position, computing the sequence in chunks ending at `cuts`."""
    out, start = [], 0
    for end in cuts + [len(tokens)]:
        if end <= start:
            continue
        shape = DECODE if end - start == 1 else PREFILL
        out.append(fwd.run([RowChunk(tokens[start:end], start, table, slot)], shape)[0])
        start = end
    return np.concatenate(out)


def test_paged_decode_equals_full_forward(fwd):
    tokens = _prompt(1, 20)
    table = _table(1)
    full = fwd.run([RowChunk(tokens, 0, table, 1)], PREFILL)[0]
    # Prefill 5 tokens, then decode the remaining 15 one at a time through the caches.
    stepwise = _chunked(fwd, tokens, table, 2, cuts=[5] + list(range(6, 20)))
    np.testing.assert_allclose(stepwise, full, atol=ATOL)


def test_ragged_batch_equals_sequences_alone(fwd):
    a, b, c = _prompt(2, 13), _prompt(3, 7), _prompt(4, 9)
    ta, tb, tc = _table(2), _table(3), _table(4)
    # Sequences alone: c is a fresh prefill; a and b are first prefilled to a point.
    alone_a = fwd.run([RowChunk(a, 0, ta, 1)], PREFILL)[0]
    alone_b = fwd.run([RowChunk(b, 0, tb, 2)], PREFILL)[0]
    alone_c = fwd.run([RowChunk(c, 0, tc, 3)], PREFILL)[0]
    # Ragged: a prefilled to 10 and b to 6 first, then one step mixing a's 3-token chunk,
    # b's single decode token and c's whole prompt.
    fwd.run([RowChunk(a[:10], 0, ta, 4), RowChunk(b[:6], 0, tb, 5)], PREFILL)
    mixed = fwd.run([RowChunk(a[10:], 10, ta, 4), RowChunk(b[6:], 6, tb, 5),
                     RowChunk(c, 0, tc, 6)], PREFILL)
    np.testing.assert_allclose(mixed[0], alone_a[10:], atol=ATOL)
    np.testing.assert_allclose(mixed[1], alone_b[6:], atol=ATOL)
    np.testing.assert_allclose(mixed[2], alone_c, atol=ATOL)
    # The SSM state a row leaves behind is the state of the sequence run alone.
    for got, want in zip(fwd.ssm_state(4), fwd.ssm_state(1)):
        np.testing.assert_allclose(got, want, atol=ATOL)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, 29), max_size=6).map(lambda c: sorted(set(c))))
def test_chunked_prefill_equals_unchunked(fwd, cuts):
    tokens = _prompt(5, 30)
    table = _table(5)
    whole = fwd.run([RowChunk(tokens, 0, table, 1)], PREFILL)[0]
    whole_state = fwd.ssm_state(1)
    chunked = _chunked(fwd, tokens, table, 2, cuts)
    np.testing.assert_allclose(chunked, whole, atol=ATOL)
    for got, want in zip(fwd.ssm_state(2), whole_state):  # conv and SSM state included
        np.testing.assert_allclose(got, want, atol=ATOL)


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_block_size_and_placement_do_not_matter(fwd, block_size):
    tokens = _prompt(6, 24)
    reference = _chunked(fwd, tokens, _table(6), 1, cuts=[10, 17, 18, 19])
    other = Forward(block_size=block_size, num_blocks=64)
    blocks = -(-24 // block_size)
    for seed in (7, 8):  # two different shuffles of physical blocks
        table = _table(seed, n=blocks)
        shape_p = StepShape(32, 4, 32, 32)
        shape_d = StepShape(4, 4, 1, 32)
        out, start = [], 0
        for end in (10, 17, 18, 19, 24):
            shape = shape_d if end - start == 1 else shape_p
            out.append(other.run([RowChunk(tokens[start:end], start, table, seed - 6)], shape)[0])
            start = end
        np.testing.assert_allclose(np.concatenate(out), reference, atol=ATOL)
