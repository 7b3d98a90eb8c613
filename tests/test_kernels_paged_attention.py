"""Ragged paged attention and the K/V page write: Pallas kernel against the jnp reference.

Fresh random inputs every run (the seed is printed on failure): randomly permuted block
tables, edge context lengths, empty cached context, GQA ratios 1/4/8, a sweep of tilings.
Every test runs interpreted on the CPU; the "compiled" variant runs the same body on a GPU.
"""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import kernel, reference

MODES = [pytest.param(True, id="interpret"),
         pytest.param(False, id="compiled", marks=pytest.mark.skipif(
             jax.default_backend() != "gpu",
             reason="no CUDA GPU: compiled path runs in benchmarks/gpu_check.sh"))]
BS, D, MB = 4, 16, 8  # block size, head dim, block-table width (32 tokens)


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def _case(rng, rows: list[tuple[int, int]], heads: int, kv_heads: int, q_bucket: int):
    """rows: (context_len after this step, query count) per sequence; (0, 0) is padding."""
    s = len(rows)
    num_blocks = 1 + s * MB
    k_pages = jnp.asarray(rng.normal(size=(num_blocks, kv_heads, BS, D)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(num_blocks, kv_heads, BS, D)), jnp.float32)
    tables = rng.permutation(np.arange(1, num_blocks)).reshape(s, MB).astype(np.int32)
    positions = np.zeros((s, q_bucket), np.int32)  # padding cells hold 0, as the engine does
    valid = np.zeros((s, q_bucket), bool)
    for i, (ctx, n) in enumerate(rows):
        positions[i, :n] = np.arange(ctx - n, ctx)
        valid[i, :n] = True
        tables[i, -(-ctx // BS):] = 0  # unused table entries point at the null block
    q = jnp.asarray(rng.normal(size=(s, q_bucket, heads, D)), jnp.float32)
    lens = jnp.asarray([ctx for ctx, _ in rows], jnp.int32)
    return (q, k_pages, v_pages, jnp.asarray(tables), lens, jnp.asarray(positions)), valid


def _check(args, valid, interpret, **kw):
    want = reference.paged_attention(*args, scale=D ** -0.5, **{
        k: v for k, v in kw.items() if k in ("soft_cap", "sliding_window")})
    got = kernel.paged_attention(*args, scale=D ** -0.5, interpret=interpret, **kw)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid],
                               rtol=2e-5, atol=2e-5)


def _tiling_fits(interpret, block_q, pages, group):
    return interpret or (block_q * group >= 16 and pages * BS >= 16)


@pytest.mark.parametrize("interpret", MODES)
def test_decode_edge_lengths(rng, interpret):
    lens = [1, BS - 1, BS, BS + 1, MB * BS - 3]
    args, valid = _case(rng, [(n, 1) for n in lens], heads=8, kv_heads=2, q_bucket=1)
    _check(args, valid, interpret, pages_per_step=1 if interpret else 4)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])  # 3: padded to a power of two
@pytest.mark.parametrize("block_q,pages", [(None, 4), (2, 1), (4, 8)])
def test_ragged_prefill_and_decode(rng, interpret, group, block_q, pages):
    if not _tiling_fits(interpret, block_q or 16, pages, 1 << (group - 1).bit_length()):
        pytest.skip("tile too small for Triton")
    kv_heads = 2 if group < 8 else 1
    rows = [(MB * BS - 2, 6),   # a prefill chunk on a long cached context
            (BS + 1, BS + 1),   # a first chunk: empty cached context
            (BS - 1, 1),        # a decode token
            (0, 0)]             # a padding row
    args, valid = _case(rng, rows, heads=group * kv_heads, kv_heads=kv_heads, q_bucket=8)
    _check(args, valid, interpret, block_q=block_q, pages_per_step=pages)


@pytest.mark.parametrize("interpret", MODES)
def test_sliding_window_and_soft_cap(rng, interpret):
    rows = [(MB * BS - 5, 7), (BS, 1), (2 * BS + 1, 2 * BS + 1)]
    args, valid = _case(rng, rows, heads=4, kv_heads=1, q_bucket=16)
    _check(args, valid, interpret, soft_cap=2.0, sliding_window=BS + 2, block_q=4,
           pages_per_step=4)


@pytest.mark.parametrize("interpret", MODES)
def test_write_kv_pages(rng, interpret):
    num_blocks, kv_heads, t = 6, 2, 9
    k_pages = jnp.asarray(rng.normal(size=(num_blocks, kv_heads, BS, D)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(num_blocks, kv_heads, BS, D)), jnp.float32)
    slots = rng.permutation(np.arange(BS, num_blocks * BS))[:t].astype(np.int32)
    slots[-2:] = 0  # padding tokens go to the null block
    k = jnp.asarray(rng.normal(size=(t, kv_heads, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(t, kv_heads, D)), jnp.float32)
    want = reference.write_kv_pages(k_pages, v_pages, k, v, jnp.asarray(slots))
    got = kernel.write_kv_pages(k_pages, v_pages, k, v, jnp.asarray(slots), interpret=interpret)
    for g, w in zip(got, want):  # block 0 holds racing padding writes: not compared
        np.testing.assert_array_equal(np.asarray(g)[1:], np.asarray(w)[1:])


def test_bad_shapes_raise_clear_errors(rng):
    args, _ = _case(rng, [(5, 1)], heads=4, kv_heads=2, q_bucket=1)
    q, k_pages, v_pages, tables, lens, pos = args
    with pytest.raises(ValueError, match="3 heads are not a multiple of the 2 kv heads"):
        kernel.paged_attention(q[:, :, :3], k_pages, v_pages, tables, lens, pos, scale=1.0,
                               interpret=True)
    with pytest.raises(ValueError, match="context_lens"):
        kernel.paged_attention(q, k_pages, v_pages, tables, lens[:0], pos, scale=1.0,
                               interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        kernel.paged_attention(q, k_pages, v_pages, tables, lens, pos, scale=1.0, block_q=1,
                               interpret=False)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernel.write_kv_pages(k_pages, v_pages, q[0, :, :2], q[0, :, :2],
                              jnp.zeros((1, 1), jnp.int32), interpret=True)
