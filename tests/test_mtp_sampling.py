"""Sampled speculative decoding keeps the sampling distribution (rejection sampling).

`accept_drafts` verifies greedy (one-hot) drafts against the target distribution of each
position: the first emitted token must be distributed as the plain step's distribution at
that position (temperature, top-k, top-p applied), whatever the draft; and when the first
draft is accepted the second token must follow the next position's distribution. A
chi-squared test at alpha = 1e-3 checks both over many independent seeds, and rejects a
deliberately broken verifier that accepts drafts without rejection sampling."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from metrale_jax.runner.sampler import host_tables, make_sampling_arrays, target_logits
from metrale_jax.runner.spec_step import accept_drafts
from metrale_jax.types import RowSampling
from pallas_kernels.backend import XLA
from pallas_kernels.mtp.common import finish

ALPHA = 1e-3
N = 20000
V = 8
# Target logits at the row's two positions (the drafts are the tokens 3 and 0).
LOGITS = np.array([[1.0, 0.2, -0.5, 1.4, 0.0, -1.0, 0.7, 0.3],
                   [0.1, 1.1, 0.4, -0.3, 0.9, 0.0, -2.0, 0.5]], np.float32)
DRAFT = 3
SETTINGS = [RowSampling(temperature=1.0), RowSampling(temperature=0.7, top_k=5),
            RowSampling(temperature=1.3, top_p=0.8)]


class _AcceptEverything:
    """A broken verifier: every draft accepted, as if q were the target."""

    @staticmethod
    def mtp_accept(target, drafts, draft_probs, keys, temperatures):
        s, k1, _ = target.shape
        bonus = jnp.argmax(target[:, -1], axis=-1).astype(jnp.int32)
        accept = jnp.ones((s, k1), jnp.int32)
        candidate = jnp.broadcast_to(bonus[:, None], (s, k1)).reshape(-1)
        return finish(accept.reshape(-1), candidate, drafts)


def _run(setting: RowSampling, ops) -> tuple[np.ndarray, np.ndarray]:
    rows = [dataclasses.replace(setting, seed=seed) for seed in range(N)]
    sampling = make_sampling_arrays(rows, N)
    tables = host_tables(rows[:1], 8, 4)  # no penalties or bias: only the shapes matter
    sampling = dataclasses.replace(sampling, slots=np.ones(N, np.int32))
    logits = jnp.asarray(np.tile(LOGITS, (N, 1)))
    drafts = jnp.full((N, 1), DRAFT, jnp.int32)
    accepted, tokens = jax.jit(lambda l, d, s, t: accept_drafts(l, d, s, t, ops=ops))(
        logits, drafts, sampling, tables)
    return np.asarray(accepted), np.asarray(tokens)


def _expected(setting: RowSampling, position: int) -> np.ndarray:
    params = make_sampling_arrays([setting], 1)
    tables = host_tables([setting], 8, 4)
    target = target_logits(jnp.asarray(LOGITS[position:position + 1]), params, tables)
    return np.asarray(jax.nn.softmax(target, axis=-1))[0]


def _fits(observed_tokens: np.ndarray, p: np.ndarray) -> bool:
    counts = np.bincount(observed_tokens, minlength=V)
    support = p > 0
    if np.any(counts[~support]):
        return False  # a token the filters exclude was emitted
    kept = p[support].astype(np.float64)
    expected = kept / kept.sum() * len(observed_tokens)
    return chisquare(counts[support], expected).pvalue > ALPHA


@pytest.mark.parametrize("setting", SETTINGS, ids=["t1", "topk", "topp"])
def test_emitted_tokens_follow_the_target_distribution(setting):
    accepted, tokens = _run(setting, XLA)
    assert _fits(tokens[:, 0], _expected(setting, 0))
    # The first draft was accepted exactly when the first token is it; then the second
    # token is the next position's sample.
    took = tokens[:, 0] == DRAFT
    np.testing.assert_array_equal(accepted >= 1, took)
    assert 0 < took.mean() < 1
    assert _fits(tokens[took, 1], _expected(setting, 1))


def test_a_verifier_without_rejection_sampling_is_caught():
    setting = SETTINGS[0]
    _, tokens = _run(setting, _AcceptEverything())
    assert not _fits(tokens[:, 0], _expected(setting, 0))


def test_greedy_rows_accept_only_the_argmax():
    accepted, tokens = _run(RowSampling(temperature=0.0), XLA)
    assert np.all(accepted == 1) and np.all(tokens[:, 0] == DRAFT)  # 3 is the argmax
    assert np.all(tokens[:, 1] == int(np.argmax(LOGITS[1])))
