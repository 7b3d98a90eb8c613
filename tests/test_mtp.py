"""MTP modules: drafting at every position through their own paged K/V is chunk-invariant,
and depth 0 really reads both the hidden state and the next token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.model import HybridLM, allocate_caches
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch
from tests.helpers import TINY_HYBRID

SHAPE = StepShape(tokens=16, rows=2, query_len=16, max_blocks=8)


@pytest.fixture(scope="module")
def draft():
    model = HybridLM(TINY_HYBRID, nnx.Rngs(3))
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def run(state, batch, next_ids, caches):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(batch, caches)
        _, normed, caches = m.mtp_forward(0, hidden, next_ids, batch, caches)
        return m.logits(normed), caches

    def call(rows, next_ids, caches):
        batch = jax.tree.map(jnp.asarray, build_step_batch(rows, SHAPE, 4))
        ids = np.zeros(SHAPE.tokens, np.int32)
        ids[:len(next_ids)] = next_ids
        return run(state, batch, jnp.asarray(ids), caches)

    return call


def _caches():
    return allocate_caches(TINY_HYBRID, 32, 4, 4, with_mtp=True)


def test_mtp_chunked_equals_whole(draft):
    tokens = np.random.default_rng(0).integers(0, TINY_HYBRID.vocab_size, 13).tolist()
    nxt = tokens[1:] + [0]
    table = [9, 3, 14, 6]
    whole, _ = draft([RowChunk(tokens, 0, table, 1)], nxt, _caches())
    caches = _caches()
    first, caches = draft([RowChunk(tokens[:6], 0, table, 1)], nxt[:6], caches)
    rest, _ = draft([RowChunk(tokens[6:], 6, table, 1)], nxt[6:], caches)
    np.testing.assert_allclose(np.concatenate([first[:6], rest[:7]]), whole[:13], atol=2e-5)


def test_mtp_depends_on_next_token(draft):
    tokens = [5, 6, 7, 8]
    a, _ = draft([RowChunk(tokens, 0, [1, 2], 1)], [6, 7, 8, 9], _caches())
    b, _ = draft([RowChunk(tokens, 0, [1, 2], 1)], [6, 7, 8, 10], _caches())
    np.testing.assert_allclose(a[:3], b[:3], atol=1e-6)  # causal: earlier drafts unchanged
    assert np.abs(a[3] - b[3]).max() > 1e-4
