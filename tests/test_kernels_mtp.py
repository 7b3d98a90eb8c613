"""Fused MTP acceptance: greedy exactness, kernel == reference, and the sampled output
distribution equal to the target's (chi-squared over many draws).

Fresh random inputs every run (the seed is printed on failure). Every test runs interpreted
on the CPU; the "compiled" variant runs the same body on a GPU.
"""

from __future__ import annotations

import math
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mtp import kernel, reference

MODES = [pytest.param(True, id="interpret"),
         pytest.param(False, id="compiled", marks=pytest.mark.skipif(
             jax.default_backend() != "gpu",
             reason="no CUDA GPU: compiled path runs in benchmarks/gpu_check.sh"))]


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def _kernel(interpret, block_rows=8, block_v=16):
    return lambda *args: kernel.mtp_accept(*args, block_rows=block_rows, block_v=block_v,
                                           interpret=interpret)


def _chi2_critical(df: int, z: float = 4.26) -> float:
    # Wilson-Hilferty; z = 4.26 is a one-sided 1e-5 tail: a false alarm once in 1e5 runs.
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    expected = len(tokens) * probs
    return float(np.sum((counts - expected) ** 2 / expected))


@pytest.mark.parametrize("interpret", MODES)
def test_greedy_is_exact(rng, interpret):
    s, k, v = 6, 3, 40
    logits = rng.normal(size=(s, k + 1, v)).astype(np.float32)
    best = logits.argmax(-1)
    agree = rng.integers(0, k + 1, size=s)  # drafts match the argmax for this many positions
    agree[:2] = [0, k]
    drafts = best[:, :k].copy()
    for i in range(s):
        drafts[i, agree[i]:] = (best[i, agree[i]:k] + 1 + rng.integers(0, v - 1)) % v
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(s, k, v)), jnp.float32), -1)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), s)
    temps = jnp.zeros((s,), jnp.float32)
    for fn in (reference.mtp_accept, _kernel(interpret)):
        accepted, tokens = fn(jnp.asarray(logits), jnp.asarray(drafts), probs, keys, temps)
        np.testing.assert_array_equal(accepted, agree)
        for i, n in enumerate(agree):
            np.testing.assert_array_equal(tokens[i, :n + 1], best[i, :n + 1])
            assert (np.asarray(tokens[i, n + 1:]) == -1).all()


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("block_rows,block_v", [(1, 16), (4, 64), (16, 128)])
def test_kernel_equals_reference(rng, interpret, block_rows, block_v):
    s, k, v = 7, 2, 100  # v is not a multiple of block_v: the padded tail must never win
    logits = jnp.asarray(rng.normal(size=(s, k + 1, v)) * 2, jnp.float32)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(s, k, v)) * 2, jnp.float32), -1)
    drafts = jnp.asarray(rng.integers(0, v, size=(s, k)), jnp.int32)
    temps = jnp.asarray([0.0, 1.0, 0.3, 2.0, 0.0, 1.0, 0.7], jnp.float32)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), s)
    want = reference.mtp_accept(logits, drafts, probs, keys, temps)
    got = _kernel(interpret, block_rows, block_v)(logits, drafts, probs, keys, temps)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("impl", ["reference", "interpret", "compiled"])
def test_sampled_output_distribution_equals_target(rng, impl):
    if impl == "compiled" and jax.default_backend() != "gpu":
        pytest.skip("no CUDA GPU: compiled path runs in benchmarks/gpu_check.sh")
    n, k, v, temp = 3000, 2, 6, 0.8
    logits = rng.normal(size=(k + 1, v)).astype(np.float32) * 1.5
    target = np.asarray(jax.nn.softmax(jnp.asarray(logits) / temp, -1), np.float64)
    draft = np.asarray(jax.nn.softmax(jnp.asarray(rng.normal(size=(k, v)) * 1.5), -1), np.float64)
    draft = draft / draft.sum(-1, keepdims=True)
    # Every request drafts its tokens from q, independently, as a drafter would.
    drafts = np.stack([rng.choice(v, size=n, p=draft[i]) for i in range(k)], 1)
    fn = {"reference": reference.mtp_accept,
          "interpret": _kernel(True, block_rows=1024, block_v=8),
          "compiled": _kernel(False, block_rows=64, block_v=16)}[impl]
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), n)
    accepted, tokens = fn(jnp.broadcast_to(jnp.asarray(logits), (n, k + 1, v)),
                          jnp.asarray(drafts, jnp.int32),
                          jnp.broadcast_to(jnp.asarray(draft, jnp.float32), (n, k, v)),
                          keys, jnp.full((n,), temp, jnp.float32))
    accepted, tokens = np.asarray(accepted), np.asarray(tokens)
    assert 0.02 < np.mean(accepted > 0) < 0.98  # both branches (accept, residual) are taken
    # Here each position's target does not depend on the prefix, so the token emitted at
    # position i (whenever one is) must follow target[i] exactly.
    for i in range(k):
        emitted = tokens[accepted >= i, i]
        assert _chi2(emitted, target[i]) < _chi2_critical(v - 1), f"position {i}"
    # The test can tell distributions apart: the drafts themselves fail it.
    assert _chi2(drafts[:, 0], target[0]) > _chi2_critical(v - 1) or np.allclose(
        draft[0], target[0], atol=0.03)


def test_bad_shapes_raise_clear_errors(rng):
    logits = jnp.zeros((2, 3, 10), jnp.float32)
    probs = jnp.full((2, 2, 10), 0.1, jnp.float32)
    drafts = jnp.zeros((2, 2), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 2)
    temps = jnp.ones((2,), jnp.float32)
    with pytest.raises(ValueError, match="draft_tokens: expected"):
        kernel.mtp_accept(logits, drafts[:, :1], probs, keys, temps, interpret=True)
    with pytest.raises(ValueError, match="temperatures"):
        kernel.mtp_accept(logits, drafts, probs, keys, temps[:1], interpret=True)
    with pytest.raises(ValueError, match="keys"):
        kernel.mtp_accept(logits, drafts, probs, keys[:1], temps, interpret=True)
