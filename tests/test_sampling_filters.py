"""The sort-free sampling filters against the sort-based definition, and the sampled
distribution against the exact renormalized one (chi-squared)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_jax.runner.sampler import (
    RowSampling,
    _filter_thresholds,
    filter_logits,
    filter_logits_reference,
    make_sampling_arrays,
    row_keys,
    sample,
)

_fast = jax.jit(filter_logits, static_argnames=("candidates",))
_reference = jax.jit(filter_logits_reference)
_thresholds = jax.jit(_filter_thresholds, static_argnames=("candidates",))


def _params(rows):
    k, p, m = zip(*rows)
    return (np.asarray(k, np.int32), np.asarray(p, np.float32), np.asarray(m, np.float32))


def _min_p_top_k_set(scaled: np.ndarray, top_k: int, min_p: float):
    """float64, descending: the values, which survive min_p and top_k, their renormalized
    weights."""
    v = scaled.size
    srt = np.sort(scaled.astype(np.float64))[::-1]
    keep = np.arange(v) < (v if top_k <= 0 else min(top_k, v))
    keep &= srt >= srt[0] + (np.log(min_p) if min_p > 0 else -np.inf)
    w = np.where(keep, np.exp(srt - srt[0]), 0.0)
    return srt, keep, w / w.sum()


def _mass_above(scaled: np.ndarray, top_k: int, min_p: float, values: np.ndarray) -> np.ndarray:
    """float64 mass, within the renormalized min_p/top_k set, strictly above each value."""
    srt, _, w = _min_p_top_k_set(scaled, top_k, min_p)
    return np.array([w[srt > x].sum() for x in values])


def _assert_same(logits, rows, candidates):
    """Masked logits equal the sort-based reference's, bit for bit. The one allowed
    difference: where top_p sits on a cumulative mass to within the float32 rounding of a
    V-term sum (e.g. top_p = 0.99999994), the reference's sorted-order cumsum and the
    full-row sums here are both roundings of the same definition and may cut one token
    apart; every differing token must then be such a boundary token."""
    k, p, m = _params(rows)
    got = np.asarray(_fast(logits, k, p, m, candidates=candidates))
    want = np.asarray(_reference(logits, k, p, m))
    tol = logits.shape[1] * 2.0**-23
    for r in np.nonzero((got != want).any(-1))[0]:
        differ = logits[r][np.isfinite(got[r]) != np.isfinite(want[r])]
        mass = _mass_above(logits[r], rows[r][0], rows[r][2], differ)
        assert differ.size and np.all(np.abs(mass - rows[r][1]) <= tol), (
            f"row {r} params {rows[r]} logits {logits[r].tolist()}"
            f" got {got[r].tolist()} want {want[r].tolist()}")
    thr, _, ids, inside = _thresholds(logits, k, p, m, candidates=candidates)
    # A row flagged "inside" has every kept token among its candidate ids.
    for r in np.nonzero(np.asarray(inside))[0]:
        assert set(np.nonzero(np.isfinite(got[r]))[0]) <= set(np.asarray(ids[r]).tolist())
    return int((got != want).any(-1).sum())


# ---------------------------------------------------------------- exact kept set

H_ROWS, H_VOCAB, H_CAND = 16, 24, 4  # candidates << vocab: every path gets exercised

_value = st.one_of(
    st.integers(-4, 4).map(lambda i: i * 0.5),  # ties
    st.floats(-8, 8, width=32),
    st.just(-math.inf),  # masked vocabulary padding / a -inf bias
)
_row_params = st.tuples(
    st.one_of(st.just(0), st.just(-1), st.integers(1, H_VOCAB + 2)),
    st.one_of(
        st.just(1.0),
        st.floats(0.0, 1.0, width=32),
        st.sampled_from([0.9, 0.99, 0.999, 0.99999994, 1e-7]),
    ),
    st.one_of(st.just(0.0), st.floats(0.0, 1.0, width=32), st.sampled_from([1e-3, 0.05])),
)
_row_logits = st.one_of(
    st.lists(_value, min_size=H_VOCAB, max_size=H_VOCAB),
    # flat and near-flat rows: the nucleus is wider than the candidates
    st.tuples(st.floats(-3, 3, width=32), st.integers(0, 3)).map(
        lambda a: [a[0] + 1e-3 * ((i * 7) % (a[1] + 1)) for i in range(H_VOCAB)]
    ),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    logits=st.lists(_row_logits, min_size=H_ROWS, max_size=H_ROWS),
    rows=st.lists(_row_params, min_size=H_ROWS, max_size=H_ROWS),
)
def test_hypothesis_kept_set_equals_sort_reference(logits, rows):
    logits = np.asarray(logits, np.float32)
    logits[:, 0] = np.where(np.isfinite(logits[:, 0]), logits[:, 0], 0.0)  # no all -inf row
    assert _assert_same(logits, rows, H_CAND) == 0


def _mixed_rows(rng, n, vocab):
    """Peaked (LM-like) and flat rows with random filter mixes, ties included."""
    scale = rng.choice([0.05, 0.5, 3.0], size=(n, 1))
    logits = (rng.standard_normal((n, vocab)) * scale).astype(np.float32)
    logits[::5] = np.round(logits[::5] * 4) / 4  # ties
    rows = []
    for _ in range(n):
        k = int(rng.choice([0, 0, 5, 50, 200, vocab - 1, vocab + 3]))
        p = float(rng.choice([1.0, 0.5, 0.9, 0.95, 0.999, 0.99999994]))
        m = float(rng.choice([0.0, 0.0, 1e-4, 0.05, 0.3]))
        rows.append((k, p, m))
    return logits, rows


@pytest.mark.parametrize("vocab, candidates", [(300, 16), (300, 64), (1000, 64)])
def test_random_mixes_equal_sort_reference(vocab, candidates):
    rng = np.random.default_rng(vocab + candidates)
    logits, rows = _mixed_rows(rng, 128, vocab)
    # Only rows at top_p = 0.99999994 may sit on a rounding boundary; most match exactly.
    assert _assert_same(logits, rows, candidates) <= 4


def test_production_shape_equals_sort_reference():
    """Batch 64 at vocab 8192 with the default candidate cap, incl. top_p alone on flat rows."""
    rng = np.random.default_rng(8192)
    logits, rows = _mixed_rows(rng, 64, 8192)
    rows[:8] = [(0, 0.9, 0.0)] * 8  # top_p alone; rows 0, 3, 6 are flat-ish (scale 0.05)
    logits[:8:3] *= 0.02
    assert _assert_same(logits, rows, 64) <= 4


# ---------------------------------------------------------------- sampled distribution

N_DRAWS = 20000
ALPHA = 1e-3
_Z_ALPHA = 3.0902  # upper 1e-3 quantile of N(0, 1)


def _chi2_critical(df: int) -> float:
    """Wilson-Hilferty: chi2_{df}(1 - ALPHA) ~ df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3
    (within ~1% of the exact quantile for df >= 3)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + _Z_ALPHA * math.sqrt(a)) ** 3


def _chi2_ok(tokens: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson chi-squared goodness of fit at ALPHA; any draw of a zero-probability
    token fails outright."""
    counts = np.bincount(tokens, minlength=probs.size)
    if counts[probs == 0].any():
        return False
    support = probs > 0
    expected = N_DRAWS * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return df == 0 or stat < _chi2_critical(max(df, 1))


def _exact_probs(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The definition, in float64 numpy: min_p, top_k, top_p on the renormalized rest,
    ties with the last kept value kept; softmax over the kept set."""
    srt, keep, w = _min_p_top_k_set(scaled, top_k, min_p)
    keep &= (np.cumsum(w) - w < top_p) | (top_p >= 1.0)
    keep[0] = True
    thr = srt[keep].min()
    out = np.where(scaled >= thr, np.exp(scaled.astype(np.float64) - srt[0]), 0.0)
    return out / out.sum()


TEMP = 0.8
SMALL = np.array([2.0, 1.6, 1.2, 1.2, 0.9, 0.9, 0.3, -0.2, -0.5, -1.0, 1.9, -2.0], np.float32)
WIDE = np.linspace(0.0, 1.5, 96).astype(np.float32)  # 96 tokens: wider than 64 candidates
CASES = [
    (SMALL, dict(top_k=4)),  # the 4th and 5th values tie (1.2): 5 kept
    (SMALL, dict(top_p=0.8)),
    (SMALL, dict(min_p=0.2)),
    (SMALL, dict(min_p=0.05, top_k=8, top_p=0.9)),
    (WIDE, dict(top_p=0.97)),  # nucleus > candidates: bisection and the full draw
    (WIDE, dict(top_k=70, top_p=0.99)),  # candidates < top_k < vocab
]


@pytest.fixture(scope="module")
def sample_fn():
    return jax.jit(sample, static_argnames=("num_top", "apply_filters", "vocab_size"))


def _draw_tokens(sample_fn, logits, kw):
    rows = [RowSampling(temperature=TEMP, seed=11, counter=i, **kw) for i in range(N_DRAWS)]
    params = make_sampling_arrays(rows, N_DRAWS)
    out = sample_fn(np.tile(logits, (N_DRAWS, 1)), params, num_top=0, apply_filters=True)
    return np.asarray(out.tokens)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sampled_frequencies_match_exact_distribution(sample_fn, case):
    logits, kw = CASES[case]
    scaled = logits / np.float32(TEMP)
    probs = _exact_probs(scaled, kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    assert _chi2_ok(_draw_tokens(sample_fn, logits, kw), probs)


def _categorical_draws(masked: np.ndarray) -> np.ndarray:
    keys = row_keys(jnp.full((N_DRAWS,), 11, jnp.uint32), jnp.arange(N_DRAWS, dtype=jnp.int32))
    draw = jax.jit(jax.vmap(jax.random.categorical))
    return np.asarray(draw(keys, jnp.tile(jnp.asarray(masked), (N_DRAWS, 1))))


def test_broken_filters_fail_the_same_test():
    """The chi-squared check has teeth: a filter without the tie rule, and one that keeps
    one token too many, are both rejected against the exact distribution."""
    scaled = SMALL / np.float32(TEMP)
    probs = _exact_probs(scaled, 4, 1.0, 0.0)
    assert (probs > 0).sum() == 5
    order = np.argsort(-scaled, kind="stable")
    no_ties = np.full_like(scaled, -np.inf)
    no_ties[order[:4]] = scaled[order[:4]]  # positional top-4: drops the tied 5th token
    one_extra = np.where(probs > 0, scaled, -np.inf)
    one_extra[order[5]] = scaled[order[5]]  # keeps the 6th value too
    correct = np.where(probs > 0, scaled, -np.inf)
    assert _chi2_ok(_categorical_draws(correct), probs)
    assert not _chi2_ok(_categorical_draws(no_ties), probs)
    assert not _chi2_ok(_categorical_draws(one_extra), probs)
