"""jnp reference for ragged paged attention, and the XLA path the engine runs off the GPU.

Queries arrive per sequence in a padded `[S, Q]` layout (Q is the step's query bucket: 1 for a
pure decode step, up to the prefill chunk size otherwise). Keys and values live in head-major
pages `[num_blocks, kv_heads, block_size, head_dim]`; a block table row lists one sequence's
pages. A query at absolute position p of sequence s sees keys at positions `<= p` and
`< context_lens[s]`.

Why a loop over the block table rather than one gather: gathering every row's pages at once
materialises a `[S, width, ...]` copy of the whole context per layer, and XLA:CPU then
transposes it for the dots (measured: 71% of a batch-64 decode step). Walking the table one
block column at a time with an online softmax touches each page once, the per-iteration
gather `[S, kv_heads, block_size, head_dim]` stays in cache, and the head-major page puts the
dot's batch dimensions (row, kv head) first, so nothing is transposed. The loop stops at the
longest context in the batch, so a step costs what its real context needs, not the padded
width of its block-table bucket.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention.common import MASKED, attention_dims, kv_write_dims


def write_kv_pages(
    k_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    v_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    k: Float[Array, "T kv_heads head_dim"],
    v: Float[Array, "T kv_heads head_dim"],
    slot_mapping: Int[Array, "T"],
) -> tuple[Float[Array, "blocks kv_heads block_size head_dim"],
           Float[Array, "blocks kv_heads block_size head_dim"]]:
    """Scatter each token's K/V into flat slot `block * block_size + offset`.

    Padding tokens map into the null block 0, which no valid query ever reads.
    """
    _, _, bs, _, _ = kv_write_dims(k_pages, v_pages, k, v, slot_mapping)
    block, offset = slot_mapping // bs, slot_mapping % bs
    if slot_mapping.shape[0] == 1:
        # XLA rewrites a one-token scatter as a bounds-checked dynamic-update-slice and copies
        # the whole donated pool first (40 ms a layer for a 36 MB pool); a second write into
        # the null block keeps it an in-place scatter (see pallas_kernels/scatter.py).
        block, offset = (jnp.concatenate([x, jnp.zeros((1,), x.dtype)]) for x in (block, offset))
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
    # Advanced indices around a slice: the written cells are [T, kv_heads, head_dim].
    k_pages = k_pages.at[block, :, offset].set(k.astype(k_pages.dtype),
                                               mode="promise_in_bounds")
    v_pages = v_pages.at[block, :, offset].set(v.astype(v_pages.dtype),
                                               mode="promise_in_bounds")
    return k_pages, v_pages


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
) -> Float[Array, "S Q heads head_dim"]:
    """Causal GQA attention of padded per-sequence queries over paged K/V."""
    dims = attention_dims(q, k_pages, v_pages, block_tables, context_lens, q_positions)
    s, nq, kvh, group, hd, bs = (dims.seqs, dims.queries, dims.kv_heads, dims.group,
                                 dims.head_dim, dims.block_size)
    rows = nq * group
    # [S, Q, H, D] -> [S, kvh, Q * group, D]: a KV head's query heads and cells are its rows.
    q_rows = q.astype(jnp.float32).reshape(s, nq, kvh, group, hd).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(s, kvh, rows, hd) * scale
    pos_rows = jnp.repeat(q_positions.astype(jnp.int32), group, axis=1)  # [S, R]
    lens = context_lens.astype(jnp.int32)
    tables = block_tables.astype(jnp.int32)
    offsets = jnp.arange(bs, dtype=jnp.int32)

    def visit(j, carry):
        m, l, acc = carry  # [S, kvh, R], [S, kvh, R], [S, kvh, R, D]
        blocks = jax.lax.dynamic_index_in_dim(tables, j, axis=1, keepdims=False)  # [S]
        k = k_pages[blocks].astype(jnp.float32)  # [S, kvh, bs, D]
        v = v_pages[blocks].astype(jnp.float32)
        scores = jnp.einsum("skrd,skbd->skrb", q_rows, k)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        kv_pos = j * bs + offsets  # [bs]
        visible = (kv_pos[None, None, :] <= pos_rows[:, :, None]) & (
            kv_pos[None, None, :] < lens[:, None, None])  # [S, R, bs]
        if sliding_window is not None:
            visible &= kv_pos[None, None, :] > pos_rows[:, :, None] - sliding_window
        visible = visible[:, None]  # broadcast over kv heads
        scores = jnp.where(visible, scores, MASKED)
        m_next = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.where(visible, jnp.exp(scores - m_next[..., None]), 0.0)
        correction = jnp.exp(m - m_next)
        l_next = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("skrb,skbd->skrd", p, v)
        return m_next, l_next, acc

    # Visit only the columns some row needs: up to the longest context in the batch, from the
    # first block any sliding window still sees. The loop's bounds stay static (so training
    # can differentiate through it) and the columns outside are skipped by a cond.
    end = jnp.minimum((jnp.max(lens) + bs - 1) // bs, dims.max_blocks)
    start = 0
    if sliding_window is not None:
        valid_pos = jnp.where(lens[:, None] > 0, q_positions, jnp.iinfo(jnp.int32).max)
        start = jnp.clip(jnp.min(valid_pos) - sliding_window + 1, 0) // bs

    def maybe_visit(j, carry):
        return jax.lax.cond((j >= start) & (j < end), visit, lambda _, c: c, j, carry)

    init = (jnp.full((s, kvh, rows), MASKED, jnp.float32), jnp.zeros((s, kvh, rows), jnp.float32),
            jnp.zeros((s, kvh, rows, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, dims.max_blocks, maybe_visit, init)
    # A row that sees no key (padding) has l == 0: zeros rather than NaN.
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    out = out.reshape(s, kvh, nq, group, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(s, nq, dims.heads, hd).astype(q.dtype)
