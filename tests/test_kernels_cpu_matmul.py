"""The matmul custom calls (XLA:CPU) against an f64 numpy product. Small-batch: `x @ w` for
up to 4 rows of bf16 or f32 weights, tile widths and column tails, f32 K slabs with odd row
counts, several independent calls in one program (XLA runs them at once, so all but one find
the crew busy), many calls in a row (the crew's job hand-over). AMX (where the processor has
it): bf16 `x @ w` for any rows, with row, depth and column tails, f32 and bf16 results. And
the routing: a bf16 layer or a large f32 one on a few rows goes through the small kernel, a
bf16 layer on more rows through AMX, anything else stays a dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.backend import CPU, XLA
from pallas_kernels.cpu import amx_matmul as amx, build
from pallas_kernels.cpu.small_matmul import (MAX_ROWS, f32_fast as small_f32_fast, small_matmul,
                                             supports)

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU custom call")


@pytest.fixture(scope="module", autouse=True)
def library():
    if build.load() is None:
        pytest.fail("the CPU kernel library did not build: see the logged reason")


def _exact(x: np.ndarray, w) -> np.ndarray:
    return np.asarray(x, np.float64) @ np.asarray(jnp.asarray(w, jnp.float32), np.float64)


# Widths: whole 256/128/64-column tiles, tails of a few columns, a band split across threads;
# f32 from 2^18 weights on: K slabs, with an odd K and a column tail (1001 x 300).
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m, k, n", [(1, 64, 256), (1, 33, 300), (2, 128, 129), (3, 96, 200),
                                     (4, 512, 1536), (4, 7, 5), (1, 512, 8000),
                                     (3, 1001, 300), (2, 4096, 70)])
def test_small_matmul_equals_the_product(dtype, m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    got = np.asarray(jax.jit(small_matmul)(jnp.asarray(x), w))
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, _exact(x, w), rtol=1e-5, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_independent_calls_in_one_program(dtype):
    # XLA runs independent custom calls concurrently on its pool threads: one gets the crew,
    # the others run alone, and none may wait on a helper that never comes.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((512, 1024)), dtype) for _ in range(8)]
    got = jax.jit(lambda x, ws: [small_matmul(x, w) for w in ws])(x, ws)
    for g, w in zip(got, ws):
        np.testing.assert_allclose(np.asarray(g), _exact(np.asarray(x), w), rtol=1e-5,
                                   atol=1e-3)


def test_a_long_chain_of_calls():
    # Each call's input is the last one's output: hundreds of crew jobs back to back, with
    # helpers joining late or not at all; a lost or doubled task shows in the result.
    rng = np.random.default_rng(2)
    ws = [jnp.asarray(rng.standard_normal((512, 512)) / 24, dt)
          for dt in (jnp.float32, jnp.bfloat16) for _ in range(4)]
    x0 = rng.standard_normal((2, 512)).astype(np.float32)

    def chain(x, ws):
        for _ in range(25):
            for w in ws:
                x = jnp.tanh(small_matmul(x, w))
        return x

    want = x0.astype(np.float64)
    for _ in range(25):
        for w in ws:
            want = np.tanh(_exact(want, w))
    run = jax.jit(chain)
    for _ in range(3):
        np.testing.assert_allclose(np.asarray(run(jnp.asarray(x0), ws)), want, atol=2e-3)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        small_matmul(jnp.zeros((1, 4)), jnp.zeros((5, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="rows"):
        small_matmul(jnp.zeros((MAX_ROWS + 1, 4)), jnp.zeros((4, 3), jnp.bfloat16))
    assert not supports(2, jnp.float16)


needs_amx = pytest.mark.skipif(not amx.available(), reason="this processor has no AMX tiles")


# Rows, depth and columns: whole 32 x 32 tiles, and tails of each (the kernel pads x when
# M or K is not a multiple of 32, and the last 32-column panel of w when N is not).
@needs_amx
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m, k, n", [(5, 33, 17), (32, 64, 64), (100, 200, 77),
                                     (64, 512, 1536), (300, 512, 1000), (513, 96, 300)])
def test_amx_matmul_equals_the_product(out_dtype, m, k, n):
    rng = np.random.default_rng(m + 10 * k + 100 * n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    got = jax.jit(lambda x, w: amx.amx_matmul(x, w, out_dtype))(x, w)
    assert got.shape == (m, n) and got.dtype == out_dtype
    want = _exact(np.asarray(x, np.float32), w)
    if out_dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4 * np.sqrt(k))
    else:  # rounded once from the f32 sum: within one bf16 step (2^-8 relative) of it
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 ** -8,
                                   atol=1e-4 * np.sqrt(k))


@needs_amx
def test_amx_calls_in_one_program_and_in_a_chain():
    # Independent calls XLA may run at once (each packs w into its thread's buffer), then a
    # chain whose every call reads the last one's output.
    rng = np.random.default_rng(3)
    ws = [jnp.asarray(rng.standard_normal((256, 256)) / 16, jnp.bfloat16) for _ in range(6)]
    x0 = jnp.asarray(rng.standard_normal((70, 256)), jnp.bfloat16)
    got = jax.jit(lambda x, ws: [amx.amx_matmul(x, w) for w in ws])(x0, ws)
    for g, w in zip(got, ws):
        np.testing.assert_allclose(np.asarray(g), _exact(np.asarray(x0, np.float32), w),
                                   rtol=1e-5, atol=1e-3)

    def chain(x, ws):
        for _ in range(10):
            for w in ws:
                x = jnp.tanh(amx.amx_matmul(x, w)).astype(jnp.bfloat16)
        return x

    want = x0
    for _ in range(10):  # XLA's bf16 dot, f32 accumulation: the same products, other order
        for w in ws:
            want = jnp.tanh(jnp.dot(want, w, preferred_element_type=jnp.float32)
                            ).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(jax.jit(chain)(x0, ws), np.float32),
                               np.asarray(want, np.float32), atol=0.1)


def test_amx_bad_operands_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        amx.amx_matmul(jnp.zeros((8, 4), jnp.bfloat16), jnp.zeros((5, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 operands"):
        amx.amx_matmul(jnp.zeros((8, 4)), jnp.zeros((4, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        amx.amx_matmul(jnp.zeros((8, 4), jnp.bfloat16), jnp.zeros((4, 3), jnp.bfloat16),
                       jnp.float16)
    assert not amx.takes(jnp.zeros((8, 4)), jnp.zeros((4, 3), jnp.bfloat16))


@pytest.mark.parametrize("rows, dtype, width, routed", [(1, jnp.bfloat16, 80, True),
                                                        (MAX_ROWS, jnp.bfloat16, 80, True),
                                                        (MAX_ROWS + 1, jnp.bfloat16, 80, False),
                                                        (1, jnp.float32, 80, False),
                                                        (2, jnp.float32, 8192, True),
                                                        (MAX_ROWS + 1, jnp.float32, 8192, False)])
def test_routing(rows, dtype, width, routed):
    layer = nnx.Linear(48, width, use_bias=True, dtype=dtype, param_dtype=dtype,
                       preferred_element_type=jnp.float32, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.linspace(-1, 1, width).astype(dtype)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 48)), dtype)
    text = jax.jit(lambda x: CPU.linear(layer, x)).lower(x).as_text()
    # f32 layers only where the library streams them faster than XLA (AVX-512).
    routed = routed and (dtype == jnp.bfloat16 or small_f32_fast())
    assert ("metrale_small_matmul" in text) == routed
    # More rows of a bf16 layer: the AMX kernel, where the processor has it.
    to_amx = not routed and dtype == jnp.bfloat16 and amx.available()
    assert ("metrale_amx_matmul" in text) == to_amx
    got = np.asarray(CPU.linear(layer, x), np.float32)
    want = np.asarray(XLA.linear(layer, x), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
