"""In-place row writes into donated cache pools that stay in place for one row too."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped


def set_rows(pool: Shaped[Array, "rows ..."], index: Int[Array, "n"],
             values: Shaped[Array, "n ..."]) -> Shaped[Array, "rows ..."]:
    """`pool.at[index].set(values)`, in place when `pool` is donated.

    XLA rewrites a one-row scatter as a bounds-checked dynamic-update-slice and then copies
    the whole pool first (measured on the CPU: 40 ms per layer for a 36 MB KV pool, so a
    batch-1 decode step cost as much as copying the entire cache). A second row aimed at row
    0, the null block / null slot that no valid read uses, keeps it an in-place scatter.
    """
    if index.shape[0] == 1:
        index = jnp.concatenate([index, jnp.zeros((1,), index.dtype)])
        values = jnp.concatenate([values, values])
    return pool.at[index].set(values.astype(pool.dtype), mode="promise_in_bounds")
