"""Tests for metrale_jax.runner.sampler (CPU, small vocabularies)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_jax.runner.sampler import (
    RowSampling,
    SamplingArrays,
    bias_and_penalties,
    host_tables,
    logprobs_of,
    make_sampling_arrays,
    needs_filters,
    sample,
)

NUM_TOP = 4


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def sample_fn():
    """One jitted entry per static config; jax caches per (flags, shapes)."""
    return jax.jit(sample, static_argnames=("num_top", "apply_filters", "vocab_size"))


def _uniform_rows(n: int, **kw) -> SamplingArrays:
    """n identical rows with counters 0..n-1 (n independent draws)."""
    rows = [RowSampling(counter=i, **kw) for i in range(n)]
    return make_sampling_arrays(rows, n)


# ---------------------------------------------------------------- greedy / logprobs


def test_greedy_equals_argmax_and_raw_logprobs(sample_fn):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    # Padding rows (beyond the 5 real ones) must be greedy too.
    params = make_sampling_arrays([RowSampling(seed=i) for i in range(5)], 6)
    out = sample_fn(logits, params, num_top=NUM_TOP, apply_filters=False)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))

    ref = _np_log_softmax(logits)
    ref_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :NUM_TOP]
    np.testing.assert_array_equal(np.asarray(out.top_ids), ref_ids)
    np.testing.assert_allclose(
        np.asarray(out.top_logprobs), np.take_along_axis(ref, ref_ids, -1), atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(out.logprobs), ref[np.arange(6), logits.argmax(-1)], atol=1e-5
    )


def test_sampled_logprobs_are_raw_even_with_temperature_and_bias(sample_fn):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 30)).astype(np.float32)
    rows = [RowSampling(temperature=0.3, top_k=5, counter=i, logit_bias={3: 2.0}) for i in range(8)]
    params = make_sampling_arrays(rows, 8)
    out = sample_fn(logits, params, host_tables(rows, 1, 2), num_top=NUM_TOP, apply_filters=True)
    ref = _np_log_softmax(logits)
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(8), tokens], atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-ref, -1)[:, :NUM_TOP], atol=1e-5)


def test_logprobs_of_matches_numpy():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(7, 40)).astype(np.float32) * 2
    targets = np.array([0, 5, 39, -1, 12, 7, 3], dtype=np.int32)
    fn = jax.jit(logprobs_of, static_argnames=("num_top", "vocab_size"))
    lp, ids, top = fn(logits, targets, num_top=NUM_TOP)
    ref = _np_log_softmax(logits)
    ok = targets >= 0
    np.testing.assert_allclose(np.asarray(lp)[ok], ref[np.arange(7), targets][ok], atol=1e-5)
    ref_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :NUM_TOP]
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(top), np.take_along_axis(ref, ref_ids, -1), atol=1e-5)
    assert np.all(np.diff(np.asarray(top), axis=-1) <= 0)


def test_vocab_padding_is_never_chosen(sample_fn):
    logits = np.zeros((64, 16), np.float32)
    logits[:, 12:] = 100.0  # padding columns with huge logits
    params = _uniform_rows(64, temperature=1.0)
    out = sample_fn(logits, params, num_top=2, apply_filters=False, vocab_size=12)
    assert np.asarray(out.tokens).max() < 12
    assert np.asarray(out.top_ids).max() < 12
    np.testing.assert_allclose(np.asarray(out.logprobs), np.log(1 / 12), atol=1e-5)


# ---------------------------------------------------------------- seeds


def test_seeded_draws_reproduce_across_batch_layout(sample_fn):
    rng = np.random.default_rng(3)
    row_logits = rng.normal(size=(1000,)).astype(np.float32)
    target = RowSampling(temperature=1.0, seed=1234, counter=7)
    others = [RowSampling(temperature=1.0, seed=s, counter=s) for s in range(7)]

    def token_at(position: int, rows_around):
        rows = list(rows_around)
        rows.insert(position, target)
        logits = rng.normal(size=(8, 1000)).astype(np.float32)
        logits[position] = row_logits
        params = make_sampling_arrays(rows, 8)
        out = sample_fn(logits, params, num_top=0, apply_filters=False)
        return int(out.tokens[position])

    first = token_at(0, others)
    assert all(token_at(p, others[::-1]) == first for p in (3, 7))
    alone = make_sampling_arrays([target], 8)
    out = sample_fn(np.tile(row_logits, (8, 1)), alone, num_top=0, apply_filters=False)
    assert int(out.tokens[0]) == first

    # Flat-ish distribution over 1000 tokens: 64 counters must not all collide.
    params = _uniform_rows(64, temperature=1.0)
    params = dataclasses.replace(params, seeds=np.full(64, 1234, np.uint32))
    out = sample_fn(np.tile(row_logits, (64, 1)), params, num_top=0, apply_filters=False)
    assert len(set(np.asarray(out.tokens).tolist())) > 20


def test_temperature_change_does_not_recompile():
    traces = []

    def counted(logits, params):
        traces.append(1)
        return sample(logits, params, num_top=2, apply_filters=True)

    fn = jax.jit(counted)
    logits = np.random.default_rng(4).normal(size=(4, 20)).astype(np.float32)
    for temp, k, p in [(0.0, 0, 1.0), (0.7, 3, 0.9), (1.3, 0, 0.5), (0.0, 5, 1.0)]:
        rows = [RowSampling(temperature=temp, top_k=k, top_p=p, seed=9, counter=i) for i in range(3)]
        fn(logits, make_sampling_arrays(rows, 4)).tokens.block_until_ready()
    assert len(traces) == 1


# ---------------------------------------------------------------- distributions


def test_unfiltered_frequencies_match_softmax(sample_fn):
    n = 20000
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5], np.float32)
    params = _uniform_rows(n, temperature=1.0, seed=77)
    out = sample_fn(np.tile(logits, (n, 1)), params, num_top=0, apply_filters=False)
    freq = np.bincount(np.asarray(out.tokens), minlength=8) / n
    probs = np.exp(_np_log_softmax(logits))
    assert 0.5 * np.abs(freq - probs).sum() < 0.015


def test_temperature_sharpens(sample_fn):
    n = 4000
    logits = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    hot = sample_fn(np.tile(logits, (n, 1)), _uniform_rows(n, temperature=5.0), num_top=0, apply_filters=False)
    cold = sample_fn(np.tile(logits, (n, 1)), _uniform_rows(n, temperature=0.2), num_top=0, apply_filters=False)
    p_hot = np.mean(np.asarray(hot.tokens) == 0)
    p_cold = np.mean(np.asarray(cold.tokens) == 0)
    # softmax([5,0,0,0]) ~ 0.98, softmax([.2,0,0,0]) ~ 0.29
    assert p_cold > 0.95 and 0.22 < p_hot < 0.36


N_DRAWS = 2000
FILTER_LOGITS = np.array([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 2.2, 1.8], np.float32)


@pytest.mark.parametrize(
    "kw, allowed",
    [
        (dict(top_k=3), {0, 1, 8}),
        # probs sorted: .33 .20 .15 .12 .10 ... ; mass >= .7 needs 4 tokens
        (dict(top_p=0.7), {0, 1, 8, 2}),
        # keep p >= 0.3 * p_max  <=>  l >= 3 + log(0.3) = 1.796
        (dict(min_p=0.3), {0, 1, 8, 2, 9}),
        # min_p leaves 5, top_k cuts to 4, top_p on the renormalized 4 needs 3
        # (.41 .25 .19 .15); without renormalizing it would need 4
        (dict(min_p=0.3, top_k=4, top_p=0.7), {0, 1, 8}),
    ],
)
def test_filters_never_emit_excluded_tokens(sample_fn, kw, allowed):
    params = _uniform_rows(N_DRAWS, temperature=1.0, seed=5, **kw)
    out = sample_fn(np.tile(FILTER_LOGITS, (N_DRAWS, 1)), params, num_top=0, apply_filters=True)
    seen = set(np.asarray(out.tokens).tolist())
    assert seen == allowed


def _np_allowed(scaled, top_k, top_p, min_p, slack):
    """Superset of tokens the filters may keep; `slack` absorbs float rounding
    at the top_p / min_p boundaries."""
    v = scaled.shape[0]
    order = np.argsort(-scaled, kind="stable")
    srt = scaled[order].astype(np.float64)
    k = v if top_k <= 0 else min(top_k, v)
    keep = np.arange(v) < k
    if min_p > 0:
        keep &= srt >= srt[0] + np.log(min_p) - slack
    masked = np.where(keep, srt, -np.inf)
    probs = np.exp(masked - masked.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    if top_p < 1.0:
        keep &= before < top_p + slack
    keep[0] = True
    thr = srt[keep].min()
    return set(np.nonzero(scaled >= thr - slack)[0].tolist())


HYP_ROWS, HYP_VOCAB = 32, 12


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    logits=st.lists(st.floats(-5, 5, width=32), min_size=HYP_VOCAB, max_size=HYP_VOCAB),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(-1, HYP_VOCAB + 2),
    top_p=st.one_of(st.just(1.0), st.floats(0.0, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**32 - 1),
)
def test_hypothesis_sample_inside_allowed_set(sample_fn, logits, temperature, top_k, top_p, min_p, seed):
    logits = np.asarray(logits, np.float32)
    params = _uniform_rows(HYP_ROWS, temperature=temperature, top_k=top_k, top_p=top_p,
                           min_p=min_p, seed=seed)
    out = sample_fn(np.tile(logits, (HYP_ROWS, 1)), params, num_top=0, apply_filters=True)
    scaled = logits / np.float32(temperature)
    allowed = _np_allowed(scaled, top_k, top_p, min_p, slack=1e-4)
    assert set(np.asarray(out.tokens).tolist()) <= allowed


# ---------------------------------------------------------------- bias / penalties


LOGITS = np.array([[2.0, 1.8, -0.5, -0.4, 0.0, 1.0]], np.float32)


def _greedy(sample_fn, row: RowSampling, history_len=8, bias_len=2, logits=LOGITS):
    params = make_sampling_arrays([row], 1)
    out = sample_fn(logits, params, host_tables([row], history_len, bias_len), num_top=0,
                    apply_filters=needs_filters([row]))
    return int(out.tokens[0])


def test_logit_bias_forces_token(sample_fn):
    assert _greedy(sample_fn, RowSampling()) == 0
    assert _greedy(sample_fn, RowSampling(logit_bias={2: 3.0})) == 2
    assert _greedy(sample_fn, RowSampling(logit_bias={0: -100.0, 1: -100.0})) == 5


def test_presence_penalty_switches_to_runner_up(sample_fn):
    # Token 0 in the prompt only: presence counts output tokens, so no effect.
    assert _greedy(sample_fn, RowSampling(presence_penalty=0.5, prompt_ids=[0])) == 0
    assert _greedy(sample_fn, RowSampling(presence_penalty=0.5, output_ids=[0])) == 1
    # Presence does not scale with count: 0 appears 3x, 1 once -> 2.0-.5 > 1.8-.5.
    row = RowSampling(presence_penalty=0.5, output_ids=[0, 0, 0, 1])
    assert _greedy(sample_fn, row) == 0


def test_frequency_penalty_scales_with_count(sample_fn):
    # 2.0 - 0.1*1 = 1.9 > 1.8 ; 2.0 - 0.1*3 = 1.7 < 1.8
    assert _greedy(sample_fn, RowSampling(frequency_penalty=0.1, output_ids=[0])) == 0
    assert _greedy(sample_fn, RowSampling(frequency_penalty=0.1, output_ids=[0, 0, 0])) == 1


def test_repetition_penalty_matches_numpy(sample_fn):
    # Prompt counts for repetition: 2.0/1.5 = 1.33 < 1.8.
    assert _greedy(sample_fn, RowSampling(repetition_penalty=1.5, prompt_ids=[0])) == 1
    # Negative logits get multiplied: -0.4*3 = -1.2 < -0.5, so token 2 beats 3.
    logits = np.array([[-1.0, -2.0, -0.5, -0.4, -3.0, -0.6]], np.float32)
    assert _greedy(sample_fn, RowSampling(repetition_penalty=3.0, output_ids=[3]), logits=logits) == 2

    # Full processed logits via a peaked bias probe: compare every position.
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(1, 6)).astype(np.float32)
    prompt, output = [1, 4], [4, 2, 2]
    row = RowSampling(repetition_penalty=1.7, presence_penalty=0.3, frequency_penalty=0.2,
                      prompt_ids=prompt, output_ids=output)
    ref = logits[0].astype(np.float64).copy()
    for t in set(prompt + output):
        ref[t] = ref[t] / 1.7 if ref[t] > 0 else ref[t] * 1.7
    for t in set(output):
        ref[t] -= 0.2 * output.count(t) + 0.3
    got = bias_and_penalties(jnp.asarray(logits), make_sampling_arrays([row], 1),
                             host_tables([row], 8, 1))
    np.testing.assert_allclose(np.asarray(got)[0], ref, atol=1e-5)
    assert _greedy(sample_fn, row, logits=logits) == int(np.argmax(ref))


def test_penalties_ignore_padding_and_other_rows(sample_fn):
    rows = [RowSampling(presence_penalty=5.0, output_ids=[0]), RowSampling(), RowSampling(temperature=0.0)]
    params = make_sampling_arrays(rows, 4)
    out = sample_fn(np.tile(LOGITS, (4, 1)), params, host_tables(rows, 8, 1), num_top=0,
                    apply_filters=False)
    np.testing.assert_array_equal(np.asarray(out.tokens), [1, 0, 0, 0])


def test_builder_rejects_overflow():
    with pytest.raises(ValueError):
        host_tables([RowSampling(repetition_penalty=1.2, prompt_ids=[1, 2, 3])], 2, 1)
    with pytest.raises(ValueError):
        host_tables([RowSampling(logit_bias={1: 1.0, 2: 1.0})], 2, 1)
    with pytest.raises(ValueError):
        make_sampling_arrays([RowSampling()] * 3, 2)


def test_first_argmax_is_argmax_with_ties_and_masked_columns():
    from pallas_kernels.reductions import first_argmax

    rng = np.random.default_rng(3)
    x = rng.integers(-3, 3, size=(64, 40)).astype(np.float32)  # many tied maxima
    x[5] = -np.inf  # a row with every column masked: argmax says 0
    x[6, :20] = -np.inf
    got = np.asarray(jax.jit(first_argmax)(x))
    np.testing.assert_array_equal(got, x.argmax(-1))


def test_gumbel_max_draws_what_categorical_draws():
    """The sampled rows' draw keeps every seeded stream: the same token as
    jax.random.categorical for each row's key, on wide rows, coarse (tie-prone) logits,
    masked columns, an all-masked row and a one-hot row."""
    from metrale_jax.runner.sampler import gumbel_max, row_keys

    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(48, 3000)) * 4).astype(np.float32)
    logits[:16] = np.round(logits[:16])  # many tied logits
    logits[20, ::2] = -np.inf
    logits[21] = -np.inf
    logits[22] = -np.inf
    logits[22, 1234] = 0.0
    keys = row_keys(np.arange(48, dtype=np.uint32) * 7919, np.arange(48, dtype=np.int32))
    want = jax.jit(jax.vmap(jax.random.categorical))(keys, logits)
    got = jax.jit(gumbel_max)(keys, logits)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(got[22]) == 1234 and int(got[20]) % 2 == 1


def test_a_batch_without_logprobs_skips_them_and_one_row_asking_gets_all(sample_fn):
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    ref = _np_log_softmax(logits)
    chosen = ref[np.arange(3), logits.argmax(-1)]
    off = make_sampling_arrays([RowSampling(logprobs=False)] * 3, 3)
    out = sample_fn(logits, off, num_top=NUM_TOP, apply_filters=False)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    # Skipped: nobody reads them (a sequence reports logprobs only when it asked).
    np.testing.assert_array_equal(np.asarray(out.top_ids), 0)
    np.testing.assert_array_equal(np.asarray(out.logprobs), 0.0)
    mixed = make_sampling_arrays([RowSampling(logprobs=False), RowSampling(logprobs=True),
                                  RowSampling(logprobs=False)], 3)
    out = sample_fn(logits, mixed, num_top=NUM_TOP, apply_filters=False)
    np.testing.assert_array_equal(np.asarray(out.top_ids),
                                  np.argsort(-ref, axis=-1, kind="stable")[:, :NUM_TOP])
    np.testing.assert_allclose(np.asarray(out.logprobs), chosen, atol=1e-5)
