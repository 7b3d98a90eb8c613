"""The CPU bf16 matmul on AMX tiles: `x @ w` for bf16 activations and weights, f32 accumulation.

XLA:CPU's bf16 dots (YNNPACK) run at a third of what this processor's AMX units reach on the
shapes a decode step of many rows and a prefill chunk multiply (measured: 64 x 512 x 1536 in
0.38 ms against 0.12 ms for oneDNN in torch). The kernel (`amx_matmul.cc`) takes every bf16
layer applied to more rows than `small_matmul` takes, where the process may use AMX.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels.cpu import build

_TARGETS = {jnp.dtype(jnp.float32): "metrale_amx_matmul_f32",
            jnp.dtype(jnp.bfloat16): "metrale_amx_matmul_bf16"}


@functools.cache
def available() -> bool:
    """Whether the library loaded, was built with AMX, and Linux granted this process the
    tiles (static for the process). `METRALE_CPU_AMX=0` turns the kernel off (A/B runs)."""
    if os.environ.get("METRALE_CPU_AMX", "1") == "0":
        return False
    lib = build.load()
    return lib is not None and bool(lib.MetraleAmxReady())


def takes(x: jax.Array, w: jax.Array) -> bool:
    """Whether `x @ w` should run here (static: dtypes, and AMX present): both bf16, so the
    products are exactly XLA's; an f32 activation stays on XLA rather than being rounded."""
    return (x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and x.ndim == 2
            and w.ndim == 2 and available())


def amx_matmul(x: Float[Array, "M K"], w: Float[Array, "K N"],
               out_dtype=jnp.float32) -> Float[Array, "M N"]:
    """`x @ w` accumulated in float32, returned as `out_dtype` (float32, or bfloat16 rounded
    to nearest even). Needs `available()`."""
    m, k = x.shape
    if w.ndim != 2 or w.shape[0] != k:
        raise ValueError(f"amx matmul: x {x.shape} and w {w.shape} do not fit")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"amx matmul: bfloat16 operands expected, got {x.dtype} and {w.dtype}")
    out = jnp.dtype(out_dtype)
    if out not in _TARGETS:
        raise ValueError(f"amx matmul: out_dtype must be float32 or bfloat16, got {out}")
    call = jax.ffi.ffi_call(_TARGETS[out], jax.ShapeDtypeStruct((m, w.shape[1]), out))
    return call(x, w)
