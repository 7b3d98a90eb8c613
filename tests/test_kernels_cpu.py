"""The C++ paged-attention custom calls (XLA:CPU, padded and flat-ragged entry points)
against the jnp reference, with float32 and bfloat16 pages (bf16 against the reference on the
same values widened to f32, which is what the kernel computes): ragged prefill chunks and
decode rows, GQA, edge lengths, sliding window, soft cap; and the engine's greedy outputs with
it equal those with the reference, in f32 and with a bf16 model and KV pool."""

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


@pytest.fixture(scope="module", autouse=True)
def library():
    if build.load() is None:
        pytest.fail("the CPU kernel library did not build: see the logged reason")


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
    _check_pages(args, valid, **kw)
    q, k_pages, v_pages, *rest = args
    # bf16 pages: the kernel widens each element exactly, so the f32 reference on the
    # widened pages is the answer to the same tolerance.
    k16, v16 = k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.bfloat16)
    _check_pages((q, k16, v16, *rest), valid,
                 want_args=(q, k16.astype(jnp.float32), v16.astype(jnp.float32), *rest), **kw)


def _check_pages(args, valid, want_args=None, **kw):
    want = reference.paged_attention(*(want_args or args), scale=D ** -0.5, **kw)
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


def _wide_case(rng, contexts, cells, *, heads, kv_heads, width, head_dim=D):
    """Rows of `cells` query cells ending at `contexts`, tables `width` blocks wide."""
    s, q_bucket = len(contexts), max(cells)
    blocks = 1 + s * width
    pages = [jnp.asarray(rng.normal(size=(blocks, kv_heads, BS, head_dim)), jnp.float32)
             for _ in "kv"]
    tables = rng.permutation(np.arange(1, blocks)).reshape(s, width).astype(np.int32)
    positions = np.zeros((s, q_bucket), np.int32)
    valid = np.zeros((s, q_bucket), bool)
    for i, (ctx, n) in enumerate(zip(contexts, cells)):
        positions[i, :n], valid[i, :n] = np.arange(ctx - n, ctx), True
    q = jnp.asarray(rng.normal(size=(s, q_bucket, heads, head_dim)), jnp.float32)
    return (q, *pages, jnp.asarray(tables), jnp.asarray(contexts, jnp.int32),
            jnp.asarray(positions)), valid


def test_a_long_chunk_is_split_across_threads(rng):  # noqa: F811
    # One 100-cell prefill chunk beside decode rows: past 2 x kCellsPerTask (32) cells and
    # kMinParallelWork, so the chunk's cells are cut into tasks the pool threads share.
    contexts, cells = [120] + [90 - i for i in range(6)], [100] + [1] * 6
    heads = 16
    args, valid = _wide_case(rng, contexts, cells, heads=heads, kv_heads=4, width=32)
    assert sum(c * n for c, n in zip(contexts, cells)) * heads * D >= 1 << 20
    _check(args, valid)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_head_dims_of_real_models(rng, head_dim):  # noqa: F811
    # The vector paths: f32 in 8/16-wide runs, bf16 pairs in 32-element runs (64, 128) and
    # the pair loop without them (80). Decode rows beside a prefill chunk.
    _check(*_wide_case(rng, [70, 33, 9, 1], [1, 12, 1, 1], heads=4, kv_heads=2, width=20,
                       head_dim=head_dim))


def test_sliding_window_and_soft_cap(rng):  # noqa: F811
    rows = [(MB * BS - 5, 7), (BS, 1), (2 * BS + 1, 2 * BS + 1)]
    args, valid = _case(rng, rows, heads=4, kv_heads=1, q_bucket=16)
    _check(args, valid, soft_cap=2.0, sliding_window=BS + 2)


def test_padding_rows_give_zeros_not_nan(rng):  # noqa: F811
    args, _ = _case(rng, [(5, 1), (0, 0)], heads=2, kv_heads=2, q_bucket=1)
    out = np.asarray(jax.jit(lambda *a: cpu.paged_attention(*a, scale=1.0))(*args))
    assert np.isfinite(out).all() and not out[1].any()


def _greedy_runs_agree(engine: dict, prompts: list[str], max_tokens: int) -> None:
    """Greedy outputs with the kernels ("auto") equal those on the jnp path ("xla")."""
    from metrale_jax import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runs = {backend: [o.outputs[0].token_ids for o in
                      LLM(**engine, kernel_backend=backend, warmup=False).generate(
                          prompts, greedy)]
            for backend in ("auto", "xla")}
    assert runs["auto"] == runs["xla"]
    assert all(len(t) == max_tokens for t in runs["xla"])


def test_engine_greedy_equals_the_reference():
    engine = dict(max_batch_size=2, max_tokens_per_tick=16, max_seq_len=64, block_size=8,
                  num_kv_blocks=24, seq_buckets=(2,), token_buckets=(16,),
                  query_buckets=(1, 16), block_buckets=(8,))
    prompts = ["To be, or not to be, that is the question: whether tis nobler in the mind",
               "x"]
    _greedy_runs_agree(engine, prompts, 6)


def test_bf16_kv_write_equals_the_reference(rng):  # noqa: F811
    # Tokens into random slots of a bf16 pool, padding tokens into the null block (slot 0),
    # in place: the donated pool comes back as the result; K/V arrive as f32 or bf16.
    blocks, kv_heads = 40, 3
    pool = [jnp.asarray(rng.normal(size=(blocks, kv_heads, BS, D)), jnp.bfloat16)
            for _ in range(2)]
    slots = np.concatenate([rng.permutation(np.arange(BS, blocks * BS))[:37], [0, 0]])
    for dtype in (jnp.float32, jnp.bfloat16):
        k, v = (jnp.asarray(rng.normal(size=(len(slots), kv_heads, D)), dtype) for _ in "kv")
        slot_mapping = jnp.asarray(slots, jnp.int32)
        want = reference.write_kv_pages(*pool, k, v, slot_mapping)
        got = jax.jit(cpu.write_kv_pages, donate_argnums=(0, 1))(
            *(p.copy() for p in pool), k, v, slot_mapping)
        for g, w in zip(got, want):
            assert g.dtype == jnp.bfloat16
            # Block 0 is the null block: two padding tokens race for one slot there.
            np.testing.assert_array_equal(np.asarray(g[1:], np.float32),
                                          np.asarray(w[1:], np.float32))
    with pytest.raises(Exception, match="outside the pool"):
        jax.block_until_ready(cpu.write_kv_pages(*pool, k, v, slot_mapping.at[3].set(
            blocks * BS)))
    with pytest.raises(ValueError, match="bfloat16 pages"):
        cpu.write_kv_pages(pool[0].astype(jnp.float32), pool[1], k, v, slot_mapping)


def test_the_kv_pool_dtype_follows_the_kernels():
    import dataclasses

    from metrale_jax.config import EngineConfig
    from metrale_jax.model.caches import kv_cache_dtype
    from tests.helpers import TINY_LLAMA

    bf16, f32 = (dataclasses.replace(TINY_LLAMA, dtype=dt) for dt in ("bfloat16", "float32"))
    auto, xla = EngineConfig(), EngineConfig(kernel_backend="xla")
    assert kv_cache_dtype(bf16, auto) == "bfloat16"  # the kernel reads bf16 pages
    assert kv_cache_dtype(bf16, xla) == "float32"    # XLA's bf16 mat-vecs are the slow ones
    assert kv_cache_dtype(f32, auto) == "float32"
    assert kv_cache_dtype(bf16, EngineConfig(kv_cache_dtype="float32")) == "float32"


def test_bf16_engine_greedy_equals_the_reference():
    # A bf16 model with a bf16 KV pool: the kernels (bf16 pages, AMX projections where the
    # processor has them) against the jnp path on the same pool dtype.
    engine = dict(max_batch_size=4, max_tokens_per_tick=64, max_seq_len=96, block_size=8,
                  num_kv_blocks=48, seq_buckets=(4,), token_buckets=(64,),
                  query_buckets=(1, 64), block_buckets=(12,), dtype="bfloat16",
                  kv_cache_dtype="bfloat16")
    prompts = ["To be, or not to be, that is the question: whether tis nobler in the mind "
               "to suffer the slings and arrows of outrageous fortune", "x", "Now is the"]
    _greedy_runs_agree(engine, prompts, 8)


def test_loading_the_library_keeps_subnormals():
    # Linked with -ffast-math, gcc's crtfastmath.o would turn on flush-to-zero for the whole
    # process when the library loads, silently changing every other float computation.
    assert build.load() is not None
    tiny = np.finfo(np.float32).smallest_subnormal
    assert np.float32(tiny) * np.float32(1.0) != 0.0


def test_a_failing_compiler_is_reported(tmp_path, monkeypatch):
    # The sources compile side by side; a compiler that fails makes the build raise with its
    # name (load() then logs it and runs the jnp path), and no library is left behind.
    import jax.ffi

    monkeypatch.setenv("CXX", "false")
    out = tmp_path / "lib.so"
    with pytest.raises(RuntimeError, match="false failed"):
        build._compile(out, jax.ffi.include_dir())
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []
