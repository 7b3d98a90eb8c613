"""The packed matmul custom call (XLA:CPU) against an f64 numpy product: `x @ w` with `w`
packed in column blocks, f32 and bf16, for 1-4 rows and more (a pass per 4 rows), with
column tails (N not a multiple of 32), an odd count of k pairs, calls split across the crew;
with a block's RMSNorm folded in, against the norm then the product. Then the model side: `pack_linears` gives packed copies to the layers that qualify, the
routing sends a few rows in the layer's dtype through them and anything else to the old
paths, and a step of a model with packed layers equals one without."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.model import allocate_caches
from metrale_jax.model.layers import RMSNorm
from metrale_jax.model.packing import PackedKernel, pack_linears
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch
from pallas_kernels.backend import CPU, XLA
from pallas_kernels.cpu import amx_matmul as amx, build, packed_matmul as pm
from tests.helpers import random_model

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU custom call")


@pytest.fixture(scope="module", autouse=True)
def library():
    if build.load() is None:
        pytest.fail("the CPU kernel library did not build: see the logged reason")


def _exact(x, w) -> np.ndarray:
    return (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
            @ np.asarray(jnp.asarray(w, jnp.float32), np.float64))


def test_pack_layout():
    w = jnp.arange(6 * 40, dtype=jnp.float32).reshape(6, 40)
    f32 = np.asarray(pm.pack(w))
    assert f32.shape == (2, 6, 32)  # 40 columns: two blocks, the second padded with zeros
    assert f32[1, 4, 3] == w[4, 35] and f32[1, 4, 8] == 0
    b16 = np.asarray(pm.pack(w.astype(jnp.bfloat16)), np.float32)
    assert b16.shape == (2, 3, 64)
    assert b16[1, 2, 2 * 3 + 1] == float(jnp.bfloat16(w[5, 35]))
    assert b16[0, 1, 2 * 7] == float(jnp.bfloat16(w[2, 7]))


# Rows 1-8 (one pass over a block) and more (passes of 8, the last one short); widths with
# a tail block; K with an odd number of pairs (bf16); wide layers the crew splits.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m, k, n", [(1, 64, 256), (2, 6, 40), (3, 130, 300), (4, 512, 1536),
                                     (1, 1536, 512), (5, 96, 64), (9, 258, 33), (17, 96, 64),
                                     (64, 512, 300),
                                     (2, 512, 8000)])
def test_packed_matmul_equals_the_product(dtype, m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    got = np.asarray(jax.jit(pm.packed_matmul, static_argnums=2)(x, pm.pack(w), n))
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, _exact(x, w), rtol=1e-5, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m, k, n", [(1, 512, 1536), (3, 130, 300), (9, 64, 40)])
def test_the_norm_folded_in_is_the_norm_then_the_product(dtype, m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)) * 4, dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, dtype)
    norm = RMSNorm(k, 1e-5, dtype)
    norm.scale[...] = jnp.asarray(rng.standard_normal(k) + 1, dtype)
    got = jax.jit(lambda x, s, p: pm.packed_norm_matmul(x, s, norm.eps, p, n))(
        x, norm.scale[...], pm.pack(w))
    want = _exact(norm(x), w)  # the model's own norm (XLA), then an f64 product
    assert got.shape == (m, n) and got.dtype == np.float32
    # bf16: the normed rows are rounded alike but for a rare last-bit tie; f32: to ~1 ulp.
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="scale"):
        pm.packed_norm_matmul(x, norm.scale[...].astype(jnp.float16), 1e-5, pm.pack(w), n)


def test_a_decode_step_folds_each_pre_norm_into_its_first_projection():
    model = random_model(PACKED_LLAMA)
    model.use_ops(CPU)
    pack_linears(model.blocks, model.lm_head)
    graphdef, state = nnx.split(model)
    caches = allocate_caches(model.cfg, num_blocks=20, block_size=4, num_slots=2)

    def program(rows, shape):
        batch = jax.tree.map(jnp.asarray, build_step_batch(rows, shape, 4))
        return jax.jit(lambda st, b, c: nnx.merge(graphdef, st)(b, c)).lower(
            state, batch, caches).as_text()

    decode = program([RowChunk([5], 3, [1], 1)], StepShape(1, 1, 1, 4))
    # Four blocks (attention, MLP, attention, MLP): each one's norm runs in its q/k/v or
    # gate/up call; prefill rows (more than the packed matmul takes) keep XLA's norm.
    assert decode.count("metrale_packed_norm_matmul") == 4
    many = pm.MAX_ROWS + 1
    prefill = program([RowChunk(list(range(1, many + 1)), 0, list(range(1, 18)), 1)],
                      StepShape(many, 1, many, 17))
    assert "metrale_packed_norm_matmul" not in prefill


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_rows_sums_are_the_same_in_any_batch(dtype):
    # The engine's exactness rests on this: a decode row's product may not depend on how
    # many rows share the step, whichever tiling (rows a pass, columns a pass) ran it.
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((64, 320)), dtype)
    packed = pm.pack(jnp.asarray(rng.standard_normal((320, 200)), dtype))
    call = jax.jit(pm.packed_matmul, static_argnums=2)
    full = np.asarray(call(x, packed, 200))
    for m in (1, 2, 3, 5, 6, 7, 13, 63):
        np.testing.assert_array_equal(np.asarray(call(x[-m:], packed, 200)), full[-m:])


def test_odd_k_in_f32():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 257)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((257, 100)), jnp.float32)
    got = np.asarray(pm.packed_matmul(x, pm.pack(w), 100))
    np.testing.assert_allclose(got, _exact(x, w), rtol=1e-5, atol=2e-3)


def test_a_chain_of_calls_and_independent_ones():
    # Each call reads the last one's output (crew jobs back to back), and a program of
    # independent calls (XLA runs them at once: all but one find the crew busy).
    rng = np.random.default_rng(2)
    ws = [jnp.asarray(rng.standard_normal((512, 512)) / 24, jnp.float32) for _ in range(4)]
    packed = [pm.pack(w) for w in ws]
    x0 = rng.standard_normal((2, 512)).astype(np.float32)

    def chain(x, packed):
        for _ in range(10):
            for p in packed:
                x = jnp.tanh(pm.packed_matmul(x, p, 512))
        return x

    want = x0.astype(np.float64)
    for _ in range(10):
        for w in ws:
            want = np.tanh(_exact(want, w))
    np.testing.assert_allclose(np.asarray(jax.jit(chain)(jnp.asarray(x0), packed)), want,
                               atol=1e-3)
    apart = jax.jit(lambda x, ps: [pm.packed_matmul(x, p, 512) for p in ps])(x0, packed)
    for got, w in zip(apart, ws):
        np.testing.assert_allclose(np.asarray(got), _exact(x0, w), rtol=1e-5, atol=1e-3)


def test_bad_operands_are_refused():
    packed = pm.pack(jnp.zeros((8, 40)))
    with pytest.raises(ValueError, match="do not fit"):
        pm.packed_matmul(jnp.zeros((1, 6)), packed, 40)
    with pytest.raises(ValueError, match="one dtype"):
        pm.packed_matmul(jnp.zeros((1, 8), jnp.bfloat16), packed, 40)
    assert not pm.packs(jnp.zeros((7, 1 << 14), jnp.bfloat16))  # odd K: no pairs
    assert not pm.packs(jnp.zeros((8, 8), jnp.float32))  # small: stays in cache anyway
    assert not pm.packs(jnp.zeros((256, 256), jnp.float16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pack_linears_and_routing(dtype):
    class Two(nnx.Module):
        def __init__(self):
            kw = dict(dtype=dtype, param_dtype=dtype, preferred_element_type=jnp.float32,
                      rngs=nnx.Rngs(0))
            self.big = nnx.Linear(256, 300, use_bias=True, **kw)
            self.small = nnx.Linear(16, 16, **kw)

    two = Two()
    two.big.bias[...] = jnp.linspace(-1, 1, 300).astype(dtype)
    added = pack_linears(two)
    assert isinstance(two.big.packed, PackedKernel) and not hasattr(two.small, "packed")
    assert added == two.big.packed[...].nbytes == 10 * 256 * 32 * jnp.dtype(dtype).itemsize
    rng = np.random.default_rng(0)
    for rows, routed in ((1, True), (4, True),
                         (pm.MAX_ROWS, not (amx.available() and dtype == jnp.bfloat16)),
                         (pm.MAX_ROWS + 1, False)):
        x = jnp.asarray(rng.standard_normal((rows, 256)), dtype)
        text = jax.jit(lambda x: CPU.linear(two.big, x)).lower(x).as_text()
        assert ("metrale_packed_matmul" in text) == routed
        got = np.asarray(CPU.linear(two.big, x), np.float32)
        want = np.asarray(XLA.linear(two.big, x), np.float32)
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # A budget the copies exceed: none is made.
    again = Two()
    assert pack_linears(again, budget=added - 1) == 0 and not hasattr(again.big, "packed")
    # An f32 row is not rounded to meet a bf16 copy: it keeps the old path.
    if dtype == jnp.bfloat16:
        x = jnp.ones((1, 256), jnp.float32)
        assert "metrale_packed_matmul" not in jax.jit(
            lambda x: CPU.linear(two.big, x)).lower(x).as_text()


# Big enough that every projection and the head get packed copies (>= 2^16 weights).
PACKED_LLAMA = ModelConfig(
    vocab_size=1024, hidden_size=256, layer_pattern="AFAF", num_heads=4, num_kv_heads=2,
    head_dim=64, intermediate_size=512, max_position_embeddings=128)


def _stepper(model):
    """The model's forward over one step, jitted, with its own caches."""
    graphdef, state = nnx.split(model)
    caches = [allocate_caches(model.cfg, num_blocks=8, block_size=4, num_slots=2)]

    @jax.jit
    def forward(state, batch, caches):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(batch, caches)
        return m.logits(hidden), caches

    def run(rows, shape):
        batch = jax.tree.map(jnp.asarray, build_step_batch(rows, shape, 4))
        logits, caches[0] = forward(state, batch, caches[0])
        return np.asarray(logits)[:len(rows[0].tokens)]

    return run


def test_a_group_is_one_call_that_equals_its_layers():
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, preferred_element_type=jnp.float32)

    class Group(nnx.Module):
        PACK_GROUPS = {"abc_packed": ("a", "b", "c")}

        def __init__(self):
            rngs = nnx.Rngs(1)
            self.a = nnx.Linear(256, 256, use_bias=True, rngs=rngs, **kw)
            self.b = nnx.Linear(256, 100, use_bias=True, rngs=rngs, **kw)  # not whole blocks
            self.c = nnx.Linear(256, 64, rngs=rngs, **kw)

    group = Group()
    for layer in (group.a, group.b):
        layer.bias[...] = jnp.linspace(-1, 1, layer.bias.shape[0])
    assert pack_linears(group) == 256 * 448 * 4  # one copy: 420 columns in 14 blocks
    assert not any(hasattr(layer, "packed") for layer in (group.a, group.b, group.c))
    layers = (group.a, group.b, group.c)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 256)), jnp.float32)
    fn = jax.jit(lambda x: CPU.linear_group(layers, x, group.abc_packed))
    assert fn.lower(x).as_text().count("metrale_packed_matmul") == 1
    for got, layer in zip(fn(x), layers):
        np.testing.assert_allclose(np.asarray(got), np.asarray(XLA.linear(layer, x)),
                                   rtol=1e-5, atol=1e-5)
    # Rows the packed matmul does not take: each layer on its own path.
    many = jnp.ones((pm.MAX_ROWS + 1, 256), jnp.float32)
    assert [y.shape for y in CPU.linear_group(layers, many, group.abc_packed)] == [
        (pm.MAX_ROWS + 1, n) for n in (256, 100, 64)]


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_with_packed_layers_steps_like_one_without(tied):
    cfg = dataclasses.replace(PACKED_LLAMA, tie_word_embeddings=tied)
    plain, packed = random_model(cfg), random_model(cfg)
    for model in (plain, packed):
        model.use_ops(CPU)
    heads = [] if tied else [packed.lm_head]
    assert pack_linears(packed.blocks, *heads, tied_head=packed if tied else None) > 0
    # q/k/v and gate/up are one copy each; the tied head reads the embedding's.
    attention, mlp = packed.blocks[0].mixer, packed.blocks[1].mixer
    assert isinstance(attention.qkv_packed, PackedKernel) and not hasattr(
        attention.q_proj, "packed")
    assert isinstance(mlp.gate_up_packed, PackedKernel) and hasattr(mlp.down_proj, "packed")
    assert tied == hasattr(packed, "logits_packed")
    plain, packed = _stepper(plain), _stepper(packed)
    prompt, table = list(range(1, 12)), [1, 2, 3, 4]
    shape = StepShape(tokens=16, rows=1, query_len=16, max_blocks=4)
    # Prefill (11 rows: no packed reads) and three decode steps (one row: packed reads).
    np.testing.assert_allclose(packed([RowChunk(prompt, 0, table, 1)], shape),
                               plain([RowChunk(prompt, 0, table, 1)], shape), atol=1e-5)
    decode = StepShape(tokens=1, rows=1, query_len=1, max_blocks=4)
    for s, token in enumerate((5, 9, 2)):
        row = [RowChunk([token], len(prompt) + s, table, 1)]
        got, want = packed(row, decode), plain(row, decode)
        assert np.abs(want).max() > 0.1  # logits that say something
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
