"""The CPU paged-attention custom calls (float32 or bfloat16 pages; float32 arithmetic, so a
bf16 pool only halves the bytes read): `paged_attention` has the jnp
reference's padded contract; `ragged_paged_attention` reads and writes the step's flat token
layout directly, so a step that mixes prefill chunks with decode rows pays neither the
`[S, Q]` padding copies nor attention over padding cells."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention.common import attention_dims

# The custom call per page dtype (`build.TARGETS`), padded and ragged.
_PADDED = {jnp.dtype(jnp.float32): "metrale_paged_attention",
           jnp.dtype(jnp.bfloat16): "metrale_paged_attention_bf16"}
_RAGGED = {jnp.dtype(jnp.float32): "metrale_ragged_paged_attention",
           jnp.dtype(jnp.bfloat16): "metrale_ragged_paged_attention_bf16"}


def supports(k_pages) -> bool:
    """Whether the kernel reads these pages: float32, or bfloat16 with an even head_dim (read
    in pairs of elements)."""
    dtype, head_dim = jnp.dtype(k_pages.dtype), k_pages.shape[-1]
    return dtype in _PADDED and (dtype == jnp.float32 or head_dim % 2 == 0)


def _check_pages(k_pages, v_pages) -> None:
    if not supports(k_pages) or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"pages: the CPU kernel reads float32 pages, or bfloat16 pages with an "
                         f"even head_dim, of one dtype; got {k_pages.dtype} and "
                         f"{v_pages.dtype}, head_dim {k_pages.shape[-1]}")


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
    _check_pages(k_pages, v_pages)
    call = jax.ffi.ffi_call(_PADDED[k_pages.dtype],
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
               context_lens.astype(jnp.int32), q_positions.astype(jnp.int32),
               scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0),
               window=np.int32(sliding_window or 0))
    return out.astype(q.dtype)


def ragged_paged_attention(
    q: Float[Array, "T heads head_dim"],
    k_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    v_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    block_tables: Int[Array, "S max_blocks"],
    context_lens: Int[Array, "S"],
    positions: Int[Array, "T"],
    row_starts: Int[Array, "S"],
    row_counts: Int[Array, "S"],
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> Float[Array, "T heads head_dim"]:
    """Causal GQA attention for flat queries: row s owns tokens [row_starts[s],
    row_starts[s] + row_counts[s]); tokens no row owns (padding) come back as zeros. Equal,
    cell for cell, to `paged_attention` on the same rows padded to `[S, Q]`."""
    t, h, d = q.shape
    s = context_lens.shape[0]
    if k_pages.ndim != 4 or k_pages.shape[3] != d or h % k_pages.shape[1]:
        raise ValueError(f"ragged paged attention: q {q.shape} does not fit pages "
                         f"{k_pages.shape}")
    if (positions.shape != (t,) or row_starts.shape != (s,) or row_counts.shape != (s,)
            or block_tables.shape[0] != s):
        raise ValueError(f"ragged paged attention: positions {positions.shape}, row_starts "
                         f"{row_starts.shape}, row_counts {row_counts.shape}, block_tables "
                         f"{block_tables.shape} do not fit T={t}, S={s}")
    _check_pages(k_pages, v_pages)
    call = jax.ffi.ffi_call(_RAGGED[k_pages.dtype],
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = jnp.int32
    out = call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(i32),
               context_lens.astype(i32), positions.astype(i32), row_starts.astype(i32),
               row_counts.astype(i32), scale=np.float32(scale),
               soft_cap=np.float32(soft_cap or 0.0), window=np.int32(sliding_window or 0))
    return out.astype(q.dtype)


def write_kv_pages(
    k_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    v_pages: Float[Array, "blocks kv_heads block_size head_dim"],
    k: Float[Array, "T kv_heads head_dim"],
    v: Float[Array, "T kv_heads head_dim"],
    slot_mapping: Int[Array, "T"],
) -> tuple[Float[Array, "blocks kv_heads block_size head_dim"],
           Float[Array, "blocks kv_heads block_size head_dim"]]:
    """The reference's `write_kv_pages` for bfloat16 pools, in place (the pages are aliased
    to the results: donate them). XLA:CPU widens a whole bf16 pool to f32 around a scatter
    into it (kv_write.cc)."""
    if k_pages.dtype != jnp.bfloat16 or v_pages.dtype != jnp.bfloat16:
        raise ValueError(f"kv write: the CPU kernel writes bfloat16 pages, got "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    call = jax.ffi.ffi_call(
        "metrale_write_kv_pages_bf16",
        (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
         jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={0: 0, 1: 1})
    return call(k_pages, v_pages, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                slot_mapping.astype(jnp.int32))
