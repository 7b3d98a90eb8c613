"""The CPU paged-attention custom call: same contract as the jnp reference (float32 pages)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention.common import attention_dims


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
    """Causal GQA attention over paged K/V by the compiled kernel (`build.load()` first)."""
    attention_dims(q, k_pages, v_pages, block_tables, context_lens, q_positions)
    if k_pages.dtype != jnp.float32:
        raise ValueError(f"k_pages: the CPU kernel reads float32 pages, got {k_pages.dtype}")
    call = jax.ffi.ffi_call("metrale_paged_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
               context_lens.astype(jnp.int32), q_positions.astype(jnp.int32),
               scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0),
               window=np.int32(sliding_window or 0))
    return out.astype(q.dtype)
