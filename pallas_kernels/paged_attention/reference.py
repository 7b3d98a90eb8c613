"""jnp reference for ragged paged attention.

Queries arrive per sequence in a padded `[S, Q]` layout (Q is the step's query bucket: 1 for a
pure decode step, up to the prefill chunk size otherwise). Keys and values live in pages
`[num_blocks, block_size, kv_heads, head_dim]`; a block table row lists one sequence's pages.
A query at absolute position p of sequence s sees keys at positions `<= p` and `< context_lens[s]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention.common import MASKED, attention_dims, kv_write_dims
from pallas_kernels.scatter import set_rows


def write_kv_pages(
    k_pages: Float[Array, "blocks block_size kv_heads head_dim"],
    v_pages: Float[Array, "blocks block_size kv_heads head_dim"],
    k: Float[Array, "T kv_heads head_dim"],
    v: Float[Array, "T kv_heads head_dim"],
    slot_mapping: Int[Array, "T"],
) -> tuple[Float[Array, "blocks block_size kv_heads head_dim"],
           Float[Array, "blocks block_size kv_heads head_dim"]]:
    """Scatter each token's K/V into flat slot `block * block_size + offset`.

    Padding tokens map into the null block 0, which no valid query ever reads.
    """
    _, nb, bs, kvh, hd = kv_write_dims(k_pages, v_pages, k, v, slot_mapping)
    k_flat = set_rows(k_pages.reshape(nb * bs, kvh, hd), slot_mapping, k)
    v_flat = set_rows(v_pages.reshape(nb * bs, kvh, hd), slot_mapping, v)
    return k_flat.reshape(nb, bs, kvh, hd), v_flat.reshape(nb, bs, kvh, hd)


def paged_attention(
    q: Float[Array, "S Q heads head_dim"],
    k_pages: Float[Array, "blocks block_size kv_heads head_dim"],
    v_pages: Float[Array, "blocks block_size kv_heads head_dim"],
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
    s, nq, nh, hd, kvh, group = (dims.seqs, dims.queries, dims.heads, dims.head_dim,
                                 dims.kv_heads, dims.group)
    # Gather only the pages the bucketed block table names: [S, MB*bs, kvh, hd].
    k = k_pages[block_tables].reshape(s, -1, kvh, hd).astype(jnp.float32)
    v = v_pages[block_tables].reshape(s, -1, kvh, hd).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(s, nq, kvh, group, hd)
    scores = jnp.einsum("sqkgd,slkd->skgql", qg, k) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    visible = (kv_pos[None, None, :] <= q_positions[:, :, None]) & (
        kv_pos[None, None, :] < context_lens[:, None, None])
    if sliding_window is not None:
        visible &= kv_pos[None, None, :] > q_positions[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("skgql,slkd->sqkgd", probs, v)
    return out.reshape(s, nq, nh, hd).astype(q.dtype)
