"""Row writes into donated cache pools stay in place, one row included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.reference import write_kv_pages
from pallas_kernels.scatter import set_rows


def _pool_copies(rows: int) -> int:
    """Copies of a whole KV pool in a step that writes `rows` tokens and reads pages back."""
    def step(k_pages, v_pages, k, slots):
        k_pages, v_pages = write_kv_pages(k_pages, v_pages, k, k, slots)
        return k_pages[1:18].sum() + v_pages[1:18].sum(), k_pages, v_pages

    pool = jnp.zeros((300, 8, 16, 64))  # [blocks, kv_heads, block_size, head_dim]
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        pool, pool, jnp.ones((rows, 8, 64)), jnp.arange(rows, dtype=jnp.int32) * 3 + 40,
    ).compile()
    return sum(1 for line in compiled.as_text().splitlines()
               if " copy(" in line and "300,8,16,64" in line)


@pytest.mark.parametrize("rows", [1, 3])
def test_kv_writes_never_copy_the_pool(rows):
    # A one-row write used to copy the whole pool each step (batch-1 decode: 40 ms a layer
    # at 36 MB); see pallas_kernels/scatter.py.
    assert _pool_copies(rows) == 0


def test_set_rows_writes_the_rows_and_spares_the_rest():
    pool = jnp.arange(10 * 3, dtype=jnp.float32).reshape(10, 3)
    out = np.asarray(set_rows(pool, jnp.array([7], jnp.int32), jnp.full((1, 3), -1.0)))
    want = np.asarray(pool).copy()
    want[7] = -1.0
    np.testing.assert_array_equal(out[1:], want[1:])   # row 0 is the null row: anything goes
    out = np.asarray(set_rows(pool, jnp.array([2, 4], jnp.int32), jnp.zeros((2, 3))))
    want = np.asarray(pool).copy()
    want[[2, 4]] = 0.0
    np.testing.assert_array_equal(out, want)
