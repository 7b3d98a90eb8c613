"""The CPU small-batch matmul custom call: `x @ w` for a few rows, each weight read once.

XLA:CPU has no bf16 matrix-vector path (a bf16 dot with one row runs ~5x slower than the f32
one), so a decode step of a few rows with bf16 weights lost its bf16 advantage exactly where
weight bandwidth is all that matters. The kernel streams `w` once per call for up to
`MAX_ROWS` rows (more rows: once per `MAX_ROWS`), bf16 or f32, accumulating in f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels.cpu import build

# Rows up to which the kernel beats XLA's dot here (it re-reads the weights every 4 rows).
MAX_ROWS = 4
_TARGETS = {jnp.dtype(jnp.float32): "metrale_small_matmul_f32",
            jnp.dtype(jnp.bfloat16): "metrale_small_matmul_bf16"}


# f32 weights smaller than this stay on XLA's dot, as fast as the kernel on them.
MIN_F32_WEIGHTS = 1 << 18


def takes(x_rows: int, w: jax.Array) -> bool:
    """Whether a layer applied to `x_rows` rows should run here rather than on XLA's dot
    (static: rows, the weight's dtype and size). bf16 always: XLA:CPU has no bf16
    matrix-vector path. f32 from MIN_F32_WEIGHTS on, where the library has its AVX-512
    path (`f32_fast`): the kernel streams the weights ~1.3x faster than XLA's dot there,
    and loses to it on small layers."""
    if not supports(x_rows, w.dtype):
        return False
    return w.dtype == jnp.bfloat16 or (w.size >= MIN_F32_WEIGHTS and f32_fast())


@functools.cache
def f32_fast() -> bool:
    """Whether the loaded library runs f32 weights on its vector path (AVX-512)."""
    lib = build.load()
    return lib is not None and bool(lib.MetraleSmallMatmulF32Fast())


def supports(x_rows: int, w_dtype) -> bool:
    """Whether `small_matmul` takes this call (static: rows and the weight's dtype)."""
    return x_rows <= MAX_ROWS and jnp.dtype(w_dtype) in _TARGETS


def small_matmul(x: Float[Array, "M K"], w: Float[Array, "K N"]) -> Float[Array, "M N"]:
    """`x @ w` in float32 (the library must be loaded: `build.load()`)."""
    m, k = x.shape
    if w.ndim != 2 or w.shape[0] != k:
        raise ValueError(f"small matmul: x {x.shape} and w {w.shape} do not fit")
    if not supports(m, w.dtype):
        raise ValueError(f"small matmul: {m} rows of {w.dtype} weights (at most {MAX_ROWS} "
                         f"rows of {sorted(str(d) for d in _TARGETS)})")
    call = jax.ffi.ffi_call(_TARGETS[jnp.dtype(w.dtype)],
                            jax.ShapeDtypeStruct((m, w.shape[1]), jnp.float32))
    return call(x.astype(jnp.float32), w)
