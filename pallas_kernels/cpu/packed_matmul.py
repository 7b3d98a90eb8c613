"""The CPU matmul over column-packed weights: `x @ w` for a decode step's rows.

A decode step is bound by how fast it reads the weights, and on the CPU that depends on the
order of the reads (`packed_matmul.cc`): packed into column blocks of 32, each block one
contiguous run, two Zen 4 cores read a 49M Llama's bf16 weights at ~37 GB/s, against ~20 for
`small_matmul`'s column bands over the model's `[K, N]` layout; further rows re-read a
block from cache, so up to MAX_ROWS rows the kernel also beats XLA's dots (measured on the
whole layer chain of that model: bf16 2.1x at 16 rows and 1.5x at 64, f32 1.7x and 1.3x;
even at 128). The packed copy is made once at load time beside the model's own kernel,
which prefill chunks keep reading through XLA's dots: it costs the weights' memory once more.
On AVX2 machines without AVX-512 (an AMD EPYC Zen 3 here) the kernel runs 8-lane vectors
(float32: six rows over half a block a pass; bf16: two rows over the whole block): there
XLA:CPU's bf16 dot reads one row's weights ~10x slower than the kernel, and its f32 dot of
4-16 rows ~2x slower (the whole layer chain of that Llama, interleaved: f32 14 against 39 ms
at 4 rows, 22 against 46 at 16; bf16 10 against 106 ms at 1 row).

Layouts (`pack`): float32 `[N/32, K, 32]`, element `[b, k, c] = w[k, 32b + c]`; bfloat16
`[N/32, K/2, 64]`, element `[b, p, 2c + j] = w[2p + j, 32b + c]` (the pairs of k that
AVX512-BF16's dot product takes). N is padded to a multiple of 32 with zero columns.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from pallas_kernels.cpu import build

BLOCK = 32
# Rows up to which the kernel beats XLA's dot (a decode step's; prefill chunks have more).
MAX_ROWS = 64
# Smaller layers are not worth a second copy: XLA's dot and small_matmul keep them in cache.
MIN_WEIGHTS = 1 << 16
_TARGETS = {jnp.dtype(jnp.float32): "metrale_packed_matmul_f32",
            jnp.dtype(jnp.bfloat16): "metrale_packed_matmul_bf16"}
_NORM_TARGETS = {jnp.dtype(jnp.float32): "metrale_packed_norm_matmul_f32",
                 jnp.dtype(jnp.bfloat16): "metrale_packed_norm_matmul_bf16"}


@functools.cache
def fast(dtype) -> bool:
    """Whether the library loaded and runs `dtype` weights on its vector path (bf16: built
    with AVX512-BF16, or AVX2 + FMA widening the pairs; f32: AVX-512 or AVX2 + FMA).
    `METRALE_CPU_PACKED=0` turns packing off (A/B runs)."""
    if os.environ.get("METRALE_CPU_PACKED", "1") == "0":
        return False
    lib = build.load()
    dtype = jnp.dtype(dtype)
    return (lib is not None and dtype in _TARGETS
            and bool(lib.MetralePackedMatmulFast(int(dtype == jnp.bfloat16))))


def packs(w: jax.Array) -> bool:
    """Whether a layer's `[K, N]` kernel gets a packed copy (static: shape and dtype; bf16
    pairs up k, so an odd K is not packed)."""
    bf16 = jnp.dtype(w.dtype) == jnp.bfloat16
    return (w.ndim == 2 and w.size >= MIN_WEIGHTS and not (bf16 and w.shape[0] % 2)
            and jnp.dtype(w.dtype) in _TARGETS and fast(w.dtype))


def takes(x: jax.Array, packed: jax.Array) -> bool:
    """Whether `x` runs on `packed` (static): at most MAX_ROWS rows, in the weights' dtype
    (bf16 rows are bf16 activations; an f32 row is not rounded for a bf16 copy)."""
    return x.ndim == 2 and x.shape[0] <= MAX_ROWS and x.dtype == packed.dtype


def packed_bytes(w: jax.Array) -> int:
    """What `pack(w)` takes: `w` with its columns padded to whole blocks."""
    k, n = w.shape
    return k * -(-n // BLOCK) * BLOCK * jnp.dtype(w.dtype).itemsize


@jax.jit
def pack(w: Float[Array, "K N"]) -> Float[Array, "B P L"]:
    """The packed copy of a `[K, N]` kernel (see the module's docstring for the layout)."""
    k, n = w.shape
    blocks = -(-n // BLOCK)
    w = jnp.pad(w, ((0, 0), (0, blocks * BLOCK - n)))
    if w.dtype == jnp.bfloat16:
        return w.reshape(k // 2, 2, blocks, BLOCK).transpose(2, 0, 3, 1).reshape(
            blocks, k // 2, 2 * BLOCK)
    return w.reshape(k, blocks, BLOCK).transpose(1, 0, 2)


def packed_matmul(x: Float[Array, "M K"], packed: Float[Array, "B P L"],
                  n: int) -> Float[Array, "M n"]:
    """`x @ w` in float32, `packed = pack(w)` and `n` the columns of `w` (the library must
    be loaded: `build.load()`)."""
    _check(x, packed)
    width = packed.shape[0] * BLOCK
    call = jax.ffi.ffi_call(_TARGETS[jnp.dtype(x.dtype)],
                            jax.ShapeDtypeStruct((x.shape[0], width), jnp.float32))
    y = call(x, packed)
    return y if width == n else y[:, :n]


def packed_norm_matmul(x: Float[Array, "M K"], scale: Float[Array, "K"], eps: float,
                       packed: Float[Array, "B P L"], n: int) -> Float[Array, "M n"]:
    """`rms_norm(x) @ w` in float32, the norm as model/layers.py's `RMSNorm` computes it
    (float32 math, `scale * (x * rsqrt(mean(x^2) + eps))`, rounded to x's dtype) and done
    inside the call: a decode step's block then folds its pre-norm into its first
    projection. `scale` in x's dtype."""
    if scale.shape != (x.shape[-1],) or scale.dtype != x.dtype:
        raise ValueError(f"packed norm matmul: scale {scale.shape} {scale.dtype} for x "
                         f"{x.shape} {x.dtype}")
    _check(x, packed)
    width = packed.shape[0] * BLOCK
    call = jax.ffi.ffi_call(_NORM_TARGETS[jnp.dtype(x.dtype)],
                            jax.ShapeDtypeStruct((x.shape[0], width), jnp.float32))
    y = call(x, scale, packed, eps=np.float32(eps))
    return y if width == n else y[:, :n]


def _check(x: jax.Array, packed: jax.Array) -> None:
    pairs = 2 if packed.dtype == jnp.bfloat16 else 1
    if x.ndim != 2 or packed.ndim != 3 or packed.shape[1] * pairs != x.shape[1]:
        raise ValueError(f"packed matmul: x {x.shape} and packed {packed.shape} do not fit")
    if x.dtype != packed.dtype or jnp.dtype(x.dtype) not in _TARGETS:
        raise ValueError(f"packed matmul: x and packed of one dtype expected (float32 or "
                         f"bfloat16), got {x.dtype} and {packed.dtype}")
