"""The C++ paged-attention custom calls (XLA:CPU, padded and flat-ragged entry points)
against the jnp reference: ragged prefill chunks and decode rows, GQA, edge lengths, sliding window, soft cap; and the engine's greedy
outputs with it equal those with the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import CPU, XLA, resolve
from pallas_kernels.cpu import build, paged_attention as cpu
from pallas_kernels.paged_attention import reference
from tests.test_kernels_paged_attention import BS, MB, D, _case, rng  # noqa: F401

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU custom call")


def _flat(args, valid, pad_tokens: int = 3):
    """The padded case laid out as a ragged step: each row's valid cells as one run of
    flat tokens, then `pad_tokens` tokens no row owns."""
    q, k_pages, v_pages, tables, lens, positions = args
    counts = valid.sum(axis=1).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    t = int(counts.sum()) + pad_tokens
    q_flat = np.zeros((t,) + q.shape[2:], np.float32)
    q_flat[:t - pad_tokens] = np.asarray(q)[valid]
    q_flat[t - pad_tokens:] = 1.0  # padding tokens carry garbage; their output must be 0
    pos_flat = np.zeros(t, np.int32)
    pos_flat[:t - pad_tokens] = np.asarray(positions)[valid]
    return (jnp.asarray(q_flat), k_pages, v_pages, tables, lens, jnp.asarray(pos_flat),
            jnp.asarray(starts), jnp.asarray(counts))


def _check(args, valid, **kw):
    want = reference.paged_attention(*args, scale=D ** -0.5, **kw)
    got = jax.jit(lambda *a: cpu.paged_attention(*a, scale=D ** -0.5, **kw))(*args)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid],
                               rtol=2e-5, atol=2e-5)
    # The ragged entry point, on the same rows as flat tokens.
    flat = _flat(args, valid)
    got = np.asarray(jax.jit(
        lambda *a: cpu.ragged_paged_attention(*a, scale=D ** -0.5, **kw))(*flat))
    n = int(valid.sum())
    np.testing.assert_allclose(got[:n], np.asarray(want)[valid], rtol=2e-5, atol=2e-5)
    assert not got[n:].any()


def test_the_library_builds_and_auto_uses_it_on_the_cpu():
    assert build.load() is not None
    assert resolve("auto", "cpu") is CPU and resolve("xla", "cpu") is XLA


def test_decode_edge_lengths(rng):  # noqa: F811
    lens = [1, BS - 1, BS, BS + 1, MB * BS - 3]
    args, valid = _case(rng, [(n, 1) for n in lens], heads=8, kv_heads=2, q_bucket=1)
    _check(args, valid)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_ragged_prefill_and_decode(rng, group):  # noqa: F811
    kv_heads = 2 if group < 8 else 1
    rows = [(MB * BS - 2, 6), (BS + 1, BS + 1), (BS - 1, 1), (0, 0)]
    args, valid = _case(rng, rows, heads=group * kv_heads, kv_heads=kv_heads, q_bucket=8)
    _check(args, valid)


def test_a_large_batch_spreads_over_the_thread_pool(rng):  # noqa: F811
    # 32 rows x ~30 keys x 16 query cells x 8 heads x D 16: ~2M products, past the
    # kernel's kMinParallelWork (1M), so the rows are split between pool threads; every
    # smaller case above runs on the calling thread.
    rows = [(MB * BS - 1 - (i % 5), 1 + (i % 16)) for i in range(32)]
    assert sum(c for c, _ in rows) * 16 * 8 * D >= 1 << 20
    args, valid = _case(rng, rows, heads=8, kv_heads=2, q_bucket=16)
    _check(args, valid)


def test_a_long_chunk_is_split_across_threads(rng):  # noqa: F811
    # One 100-cell prefill chunk beside decode rows: past 2 x kCellsPerTask (32) cells and
    # kMinParallelWork, so the chunk's cells are cut into tasks the pool threads share.
    width = 32  # blocks per row: 128 keys
    contexts, cells = [120] + [90 - i for i in range(6)], [100] + [1] * 6
    s, q_bucket, heads, kv_heads = len(contexts), 100, 16, 4
    blocks = 1 + s * width
    k_pages = jnp.asarray(rng.normal(size=(blocks, kv_heads, BS, D)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(blocks, kv_heads, BS, D)), jnp.float32)
    tables = rng.permutation(np.arange(1, blocks)).reshape(s, width).astype(np.int32)
    positions = np.zeros((s, q_bucket), np.int32)
    valid = np.zeros((s, q_bucket), bool)
    for i, (ctx, n) in enumerate(zip(contexts, cells)):
        positions[i, :n], valid[i, :n] = np.arange(ctx - n, ctx), True
    q = jnp.asarray(rng.normal(size=(s, q_bucket, heads, D)), jnp.float32)
    args = (q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(contexts, jnp.int32),
            jnp.asarray(positions))
    assert sum(c * n for c, n in zip(contexts, cells)) * heads * D >= 1 << 20
    _check(args, valid)


def test_sliding_window_and_soft_cap(rng):  # noqa: F811
    rows = [(MB * BS - 5, 7), (BS, 1), (2 * BS + 1, 2 * BS + 1)]
    args, valid = _case(rng, rows, heads=4, kv_heads=1, q_bucket=16)
    _check(args, valid, soft_cap=2.0, sliding_window=BS + 2)


def test_padding_rows_give_zeros_not_nan(rng):  # noqa: F811
    args, _ = _case(rng, [(5, 1), (0, 0)], heads=2, kv_heads=2, q_bucket=1)
    out = np.asarray(jax.jit(lambda *a: cpu.paged_attention(*a, scale=1.0))(*args))
    assert np.isfinite(out).all() and not out[1].any()


def test_engine_greedy_equals_the_reference():
    from metrale_jax import LLM, SamplingParams

    engine = dict(max_batch_size=2, max_tokens_per_tick=16, max_seq_len=64, block_size=8,
                  num_kv_blocks=24, seq_buckets=(2,), token_buckets=(16,),
                  query_buckets=(1, 16), block_buckets=(8,))
    prompts = ["To be, or not to be, that is the question: whether tis nobler in the mind",
               "x"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {backend: [o.outputs[0].token_ids for o in
                      LLM(**engine, kernel_backend=backend, warmup=False).generate(
                          prompts, greedy)]
            for backend in ("auto", "xla")}
    assert runs["auto"] == runs["xla"] and all(len(t) == 6 for t in runs["xla"])


def test_loading_the_library_keeps_subnormals():
    # Linked with -ffast-math, gcc's crtfastmath.o would turn on flush-to-zero for the whole
    # process when the library loads, silently changing every other float computation.
    assert build.load() is not None
    tiny = np.finfo(np.float32).smallest_subnormal
    assert np.float32(tiny) * np.float32(1.0) != 0.0
