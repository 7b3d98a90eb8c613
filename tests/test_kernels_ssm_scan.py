"""Mamba2 SSD kernels against a token-by-token recurrence and the chunked jnp reference.

Fresh random inputs every run (the seed is printed on failure); ragged rows end in dt = 0
padding, heads share B/C in groups, chunk sizes sweep across and past the row length.
Every test runs interpreted on the CPU; the "compiled" variant runs the same body on a GPU.
"""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ssm_scan import kernel, reference

MODES = [pytest.param(True, id="interpret"),
         pytest.param(False, id="compiled", marks=pytest.mark.skipif(
             jax.default_backend() != "gpu",
             reason="no CUDA GPU: compiled path runs in benchmarks/gpu_check.sh"))]
S, H, P, G, N = 3, 4, 16, 2, 16
TOL = dict(rtol=2e-4, atol=2e-4)


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def _inputs(rng, q: int, lens: list[int] | None = None):
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    dt = jnp.asarray(rng.uniform(0.01, 0.5, size=(S, q, H)), jnp.float32)
    if lens is not None:  # ragged rows: the model zeroes dt past each row's length
        dt = jnp.where(jnp.arange(q)[None, :, None] < jnp.asarray(lens)[:, None, None], dt, 0.0)
    a = -jnp.asarray(rng.uniform(0.5, 4.0, size=(H,)), jnp.float32)
    return f(S, q, H, P), dt, a, f(S, q, G, N), f(S, q, G, N), f(S, H, P, N)


def _token_loop(x, dt, a, b, c, state):
    """The recurrence written out position by position with numpy."""
    x, dt, a, b, c, state = map(np.asarray, (x, dt, a, b, c, state))
    rep = x.shape[2] // b.shape[2]
    b, c = np.repeat(b, rep, axis=2), np.repeat(c, rep, axis=2)
    ys, states = [], []
    for t in range(x.shape[1]):
        decay = np.exp(dt[:, t] * a)[:, :, None, None]
        state = state * decay + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append(np.einsum("shpn,shn->shp", state, c[:, t]))
        states.append(state)
    return np.stack(ys, 1), np.stack(states, 1)


@pytest.mark.parametrize("chunk", [1, 3, 4, 16, 64])
def test_reference_chunk_scan_equals_token_loop(rng, chunk):
    args = _inputs(rng, 13)
    y, final = reference.ssd_chunk_scan(*args, chunk_size=chunk)
    want_y, want_states = _token_loop(*args)
    np.testing.assert_allclose(y, want_y, **TOL)
    np.testing.assert_allclose(final, want_states[:, -1], **TOL)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("chunk", [3, 8, 16])
def test_chunk_scan_kernel_across_chunk_sizes(rng, interpret, chunk):
    if not interpret and chunk < 16:
        pytest.skip("Triton tiles are powers of two >= 16")
    q, lens = 13, [13, 5, 1]
    args = _inputs(rng, q, lens)
    y, final = kernel.ssd_chunk_scan(*args, chunk_size=chunk, interpret=interpret)
    want_y, want_states = _token_loop(*args)
    for i, n in enumerate(lens):  # padding (dt = 0) leaves the state where the row ended
        np.testing.assert_allclose(y[i, :n], want_y[i, :n], **TOL)
        np.testing.assert_allclose(final[i], want_states[i, n - 1], **TOL)
    ref_y, ref_final = reference.ssd_chunk_scan(*args, chunk_size=chunk)
    np.testing.assert_allclose(final, ref_final, **TOL)


@pytest.mark.parametrize("interpret", MODES)
def test_chunked_prefill_continues_from_the_state(rng, interpret):
    """Two chunks fed one after the other equal one pass over both."""
    x, dt, a, b, c, s0 = _inputs(rng, 12)
    chunk = 4 if interpret else 16
    whole_y, whole = kernel.ssd_chunk_scan(x, dt, a, b, c, s0, chunk_size=chunk,
                                           interpret=interpret)
    cut = lambda t, sl: t[:, sl]
    y1, mid = kernel.ssd_chunk_scan(*(cut(t, slice(0, 7)) for t in (x, dt)), a,
                                    *(cut(t, slice(0, 7)) for t in (b, c)), s0,
                                    chunk_size=chunk, interpret=interpret)
    y2, end = kernel.ssd_chunk_scan(*(cut(t, slice(7, 12)) for t in (x, dt)), a,
                                    *(cut(t, slice(7, 12)) for t in (b, c)), mid,
                                    chunk_size=chunk, interpret=interpret)
    np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), whole_y, **TOL)
    np.testing.assert_allclose(end, whole, **TOL)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("block_h", [1, 2, 4])
def test_decode_step(rng, interpret, block_h):
    x, dt, a, b, c, s0 = _inputs(rng, 1)
    args = (x[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], s0)
    y, state = kernel.ssm_decode_step(*args, block_h=block_h, interpret=interpret)
    want_y, want_state = reference.ssm_decode_step(*args)
    np.testing.assert_allclose(y, want_y, **TOL)
    np.testing.assert_allclose(state, want_state, **TOL)


@pytest.mark.parametrize("interpret", MODES)
def test_scan_states_keeps_every_position(rng, interpret):
    """What MTP verification needs: the state after each verified token."""
    args = _inputs(rng, 5)
    y, states = kernel.ssd_scan_states(*args, interpret=interpret)
    want_y, want_states = _token_loop(*args)
    np.testing.assert_allclose(y, want_y, **TOL)
    np.testing.assert_allclose(states, want_states, **TOL)
    ref_y, ref_states = reference.ssd_scan_states(*args)
    np.testing.assert_allclose(ref_states, want_states, **TOL)


def test_bad_shapes_raise_clear_errors(rng):
    x, dt, a, b, c, s0 = _inputs(rng, 4)
    with pytest.raises(ValueError, match="dt: expected"):
        kernel.ssd_chunk_scan(x, dt[:, :2], a, b, c, s0, chunk_size=4, interpret=True)
    with pytest.raises(ValueError, match="groups do not divide"):
        kernel.ssd_chunk_scan(x, dt, a, jnp.tile(b, (1, 1, 3, 1))[:, :, :3],
                              jnp.tile(c, (1, 1, 3, 1))[:, :, :3], s0, chunk_size=4,
                              interpret=True)
    with pytest.raises(ValueError, match="block_h=3"):
        kernel.ssm_decode_step(x[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], s0, block_h=3,
                               interpret=True)
    with pytest.raises(ValueError, match="chunk_size=8: a compiled"):
        kernel.ssd_chunk_scan(x, dt, a, b, c, s0, chunk_size=8, interpret=False)
