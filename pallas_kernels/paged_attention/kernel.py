"""Pallas (Triton) ragged paged attention and the K/V page write.

One program handles one sequence row, one KV head and a block of `block_q` query cells; the
GQA group's query heads ride along as extra rows of the same tile, so each K/V page is loaded
once per group. The program walks only the pages a query in its block can see (from the
sliding-window start to min(context_len, last position + 1)), `pages_per_step` pages per
iteration, with an online softmax. Prefill chunks and decode tokens share the kernel: a
decode row is a query block whose one valid cell sits at the end of its context.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels._pallas import check_triton_tile, next_pow2, require, round_up, triton_params
from pallas_kernels.paged_attention.common import MASKED, attention_dims, kv_write_dims


def _attention_kernel(q_ref, pos_ref, bt_ref, len_ref, k_ref, v_ref, o_ref, *, scale: float,
                      soft_cap: float | None, window: int | None, pages_per_step: int):
    # q_ref [rows, D] (rows = block_q * group), pos_ref [rows] (-1 = padding),
    # bt_ref [MB], len_ref [1], k_ref/v_ref [blocks, block_size, D] (this KV head).
    rows, d = q_ref.shape
    block_size = k_ref.shape[1]
    block_k = pages_per_step * block_size
    q = q_ref[...]
    pos = pos_ref[...]
    ctx = len_ref[0]
    last = jnp.minimum(ctx, jnp.max(pos) + 1)  # no query here sees a key at or past `last`
    end_step = pl.cdiv(pl.cdiv(last, block_size), pages_per_step)
    start_step = 0
    if window is not None:
        first = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max)) - window + 1
        start_step = jnp.maximum(first, 0) // block_k

    def body(step, carry):
        acc, m_prev, l_prev = carry
        pages = bt_ref[pl.ds(step * pages_per_step, pages_per_step)]
        k = k_ref[pages].reshape(block_k, d)
        v = v_ref[pages].reshape(block_k, d)
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        kv_pos = step * block_k + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        visible = (kv_pos <= pos[:, None]) & (kv_pos < ctx)
        if window is not None:
            visible &= kv_pos > pos[:, None] - window
        scores = jnp.where(visible, scores, MASKED)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(scores - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=-1)
        acc = acc * correction[:, None] + jnp.dot(p.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
        return acc, m_next, l_next

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, _, l_sum = jax.lax.fori_loop(start_step, end_step, body, init)
    # A padding block that visits no page has l == 0: emit zeros rather than NaN.
    o_ref[...] = (acc / jnp.where(l_sum == 0.0, 1.0, l_sum)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "sliding_window", "block_q", "pages_per_step", "num_warps",
    "num_stages", "interpret"))
def paged_attention(
    q: Float[Array, "S Q heads head_dim"],
    k_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    v_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    block_tables: Int[Array, "S max_blocks"],
    context_lens: Int[Array, "S"],
    q_positions: Int[Array, "S Q"],
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_q: int | None = None,
    pages_per_step: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> Float[Array, "S Q heads head_dim"]:
    """Same contract as `reference.paged_attention`; tiling: `block_q` query cells (times the
    GQA group) per program, `pages_per_step` pages per inner iteration."""
    dims = attention_dims(q, k_pages, v_pages, block_tables, context_lens, q_positions)
    s, nq, kvh, d = dims.seqs, dims.queries, dims.kv_heads, dims.head_dim
    # Triton tiles are powers of two: a group of 3 or 6 query heads is padded with zero
    # heads (their rows are computed and dropped).
    g = next_pow2(dims.group)
    if block_q is None:
        # About 64 rows per tile for prefill, and never fewer than the 16 tl.dot needs.
        block_q = max(min(next_pow2(nq), max(64 // g, 1)), max(16 // g, 1))
    require(block_q >= 1 and pages_per_step >= 1,
            f"block_q={block_q}, pages_per_step={pages_per_step}: must be >= 1")
    require(sliding_window is None or sliding_window >= 1,
            f"sliding_window={sliding_window}: must be >= 1")
    check_triton_tile(interpret, "block_q * group", block_q * g)
    check_triton_tile(interpret, "pages_per_step * block_size", pages_per_step * dims.block_size)
    check_triton_tile(interpret, "head_dim", d)

    qp = round_up(nq, block_q)
    mb = round_up(dims.max_blocks, pages_per_step)
    # [S, Q, H, D] -> [S, kvh, Qp * group, D]: a KV head's query heads become tile rows.
    q_rows = q.reshape(s, nq, kvh, dims.group, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, qp - nq), (0, 0), (0, g - dims.group), (0, 0)))
    q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(s, kvh, qp * g, d)
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, qp - nq)), constant_values=-1)
    pos_rows = jnp.repeat(pos, g, axis=1)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, mb - dims.max_blocks)))
    lens = context_lens.astype(jnp.int32).reshape(s, 1)
    rows = block_q * g
    pool = (dims.num_blocks, None, dims.block_size, d)

    out = pl.pallas_call(
        functools.partial(_attention_kernel, scale=scale, soft_cap=soft_cap,
                          window=sliding_window, pages_per_step=pages_per_step),
        grid=(s, kvh, qp // block_q),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, rows), lambda i, h, j: (i, j)),
            pl.BlockSpec((None, mb), lambda i, h, j: (i, 0)),
            pl.BlockSpec((None, 1), lambda i, h, j: (i, 0)),
            pl.BlockSpec(pool, lambda i, h, j: (0, h, 0, 0)),
            pl.BlockSpec(pool, lambda i, h, j: (0, h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, h, j: (i, h, j, 0)),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(q_rows, pos_rows, tables, lens, k_pages, v_pages)
    out = out.reshape(s, kvh, qp, g, d)[:, :, :nq, :dims.group]
    return out.transpose(0, 2, 1, 3, 4).reshape(s, nq, dims.heads, d)


def _write_kernel(slot_ref, k_ref, v_ref, _k_in, _v_in, k_out, v_out):
    # One token per program: its [kv_heads, D] K and V go to flat slot (page, offset).
    slot = slot_ref[pl.program_id(0)]
    block_size = k_out.shape[2]
    page, offset = slot // block_size, slot % block_size
    k_out[page, :, offset] = k_ref[...].astype(k_out.dtype)
    v_out[page, :, offset] = v_ref[...].astype(v_out.dtype)


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def write_kv_pages(
    k_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    v_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    k: Float[Array, "T kv_heads head_dim"],
    v: Float[Array, "T kv_heads head_dim"],
    slot_mapping: Int[Array, "T"],
    *,
    num_warps: int = 1,
    interpret: bool = False,
) -> tuple[Float[Array, "blocks kv_heads block_size head_dim"],
           Float[Array, "blocks kv_heads block_size head_dim"]]:
    """Same contract as `reference.write_kv_pages`; in place when the caller donates the pages.

    Padding tokens all target the null block's slot 0; their racing writes are harmless
    because no valid query reads block 0.
    """
    t, _, _, kvh, d = kv_write_dims(k_pages, v_pages, k, v, slot_mapping)
    check_triton_tile(interpret, "kv_heads * head_dim", kvh * d)
    token = pl.BlockSpec((None, kvh, d), lambda i: (i, 0, 0))
    whole = pl.BlockSpec(k_pages.shape, lambda i: (0, 0, 0, 0))
    return pl.pallas_call(
        _write_kernel,
        grid=(t,),
        in_specs=[pl.BlockSpec((t,), lambda i: (0,)), token, token, whole, whole],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)] * 2,
        input_output_aliases={3: 0, 4: 1},
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="write_kv_pages",
    )(slot_mapping.astype(jnp.int32), k, v, k_pages, v_pages)
