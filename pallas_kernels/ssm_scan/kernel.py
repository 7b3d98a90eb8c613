"""Pallas (Triton) Mamba2 SSD kernels: chunked scan, decode step, per-position states.

One program owns one (sequence, head) pair and keeps its [P, N] state in registers: the scan
walks the chunks in order (the state must pass from one chunk to the next), and inside a
chunk does the SSD's three matmuls. The wrapper pre-multiplies `da = dt * A` so a kernel
never indexes a per-head scalar, and maps heads to their B/C group in the index map instead
of repeating B and C in memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from pallas_kernels._pallas import check_triton_tile, require, round_up, triton_params
from pallas_kernels.ssm_scan.common import ssd_dims

_F32 = jnp.float32
# dot_general contracting the named dimension of each side (no transposed copies).
_CONTRACT_LAST = (((1,), (1,)), ((), ()))
_CONTRACT_FIRST = (((0,), (0,)), ((), ()))


def _scan_kernel(x_ref, dt_ref, da_ref, b_ref, c_ref, s0_ref, y_ref, s_ref, *, chunk: int):
    # x_ref [Qp, P], dt_ref/da_ref [Qp], b_ref/c_ref [Qp, N], s0_ref/s_ref [P, N].
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    causal = row >= jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)

    def body(i, state):
        span = pl.ds(i * chunk, chunk)
        x, dt, da = x_ref[span, :].astype(_F32), dt_ref[span], da_ref[span]
        b, c = b_ref[span, :].astype(_F32), c_ref[span, :].astype(_F32)
        # cumsum as a masked row sum: Triton has no scan primitive we can count on.
        cum = jnp.sum(jnp.where(causal, da[None, :], 0.0), axis=1)
        total = jnp.sum(da)
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], 0.0)),
                          0.0)
        xdt = x * dt[:, None]
        scores = jax.lax.dot_general(c, b, _CONTRACT_LAST, preferred_element_type=_F32) * decay
        y = jnp.dot(scores, xdt, preferred_element_type=_F32)
        y += jax.lax.dot_general(c, state, _CONTRACT_LAST,
                                 preferred_element_type=_F32) * jnp.exp(cum)[:, None]
        y_ref[span, :] = y.astype(y_ref.dtype)
        to_end = xdt * jnp.exp(total - cum)[:, None]
        return state * jnp.exp(total) + jax.lax.dot_general(
            to_end, b, _CONTRACT_FIRST, preferred_element_type=_F32)

    steps = x_ref.shape[0] // chunk
    s_ref[...] = jax.lax.fori_loop(0, steps, body, s0_ref[...].astype(_F32))


def _states_kernel(x_ref, dt_ref, da_ref, b_ref, c_ref, s0_ref, y_ref, st_ref):
    # The token recurrence, storing every state: x_ref [Q, P], st_ref [Q, P, N].
    def body(t, state):
        x, b, c = x_ref[t, :].astype(_F32), b_ref[t, :].astype(_F32), c_ref[t, :].astype(_F32)
        state = state * jnp.exp(da_ref[t]) + (dt_ref[t] * x)[:, None] * b[None, :]
        y_ref[t, :] = jnp.sum(state * c[None, :], axis=1).astype(y_ref.dtype)
        st_ref[t] = state
        return state

    jax.lax.fori_loop(0, x_ref.shape[0], body, s0_ref[...].astype(_F32))


def _scan_call(kernel, name, x, dt, a, b, c, init_state, *, states_out: bool, num_warps: int,
               num_stages: int, interpret: bool):
    """The pallas_call both scan kernels share: grid (S, H), one head's slices per program."""
    dims = ssd_dims(x, dt, a, b, c, init_state)
    s, q, h, p, n = dims.seqs, dims.length, dims.heads, dims.head_dim, dims.state
    rep = dims.heads_per_group
    dt = dt.astype(_F32)
    da = dt * a.astype(_F32)[None, None, :]
    seq = lambda *tail: pl.BlockSpec((None, q, None) + tail,
                                     lambda i, j: (i, 0, j) + (0,) * len(tail))
    grouped = pl.BlockSpec((None, q, None, n), lambda i, j: (i, 0, j // rep, 0))
    state = pl.BlockSpec((None, None, p, n), lambda i, j: (i, j, 0, 0))
    if states_out:
        last = pl.BlockSpec((None, q, None, p, n), lambda i, j: (i, 0, j, 0, 0))
        last_shape = (s, q, h, p, n)
    else:
        last, last_shape = state, (s, h, p, n)
    return pl.pallas_call(
        kernel,
        grid=(s, h),
        in_specs=[seq(p), seq(), seq(), grouped, grouped, state],
        out_specs=[seq(p), last],
        out_shape=[jax.ShapeDtypeStruct((s, q, h, p), _F32),
                   jax.ShapeDtypeStruct(last_shape, _F32)],
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(x, dt, da, b, c, init_state)


@functools.partial(jax.jit, static_argnames=("chunk_size", "num_warps", "num_stages",
                                             "interpret"))
def ssd_chunk_scan(
    x: Float[Array, "S Q H P"],
    dt: Float[Array, "S Q H"],
    a: Float[Array, "H"],
    b: Float[Array, "S Q G N"],
    c: Float[Array, "S Q G N"],
    init_state: Float[Array, "S H P N"],
    *,
    chunk_size: int,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[Float[Array, "S Q H P"], Float[Array, "S H P N"]]:
    """Same contract as `reference.ssd_chunk_scan`; `chunk_size` is the tile (any size
    gives the same result up to rounding)."""
    dims = ssd_dims(x, dt, a, b, c, init_state)
    require(chunk_size >= 1, f"chunk_size={chunk_size}: must be >= 1")
    chunk = min(chunk_size, dims.length) if interpret else chunk_size
    for name, size in (("chunk_size", chunk), ("head_dim", dims.head_dim),
                       ("d_state", dims.state)):
        check_triton_tile(interpret, name, size)
    q = dims.length
    pad = round_up(q, chunk) - q
    if pad:
        # dt = 0 on padding: decay exp(0) = 1 and no input, so the final state is unchanged.
        padding = lambda t: jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        x, dt, b, c = map(padding, (x, dt, b, c))
    y, final = _scan_call(functools.partial(_scan_kernel, chunk=chunk), "ssd_chunk_scan",
                          x, dt, a, b, c, init_state, states_out=False, num_warps=num_warps,
                          num_stages=num_stages, interpret=interpret)
    return y[:, :q], final


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def ssd_scan_states(
    x: Float[Array, "S Q H P"],
    dt: Float[Array, "S Q H"],
    a: Float[Array, "H"],
    b: Float[Array, "S Q G N"],
    c: Float[Array, "S Q G N"],
    init_state: Float[Array, "S H P N"],
    *,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[Float[Array, "S Q H P"], Float[Array, "S Q H P N"]]:
    """Same contract as `reference.ssd_scan_states`: y and the state after every position."""
    dims = ssd_dims(x, dt, a, b, c, init_state)
    check_triton_tile(interpret, "head_dim", dims.head_dim)
    check_triton_tile(interpret, "d_state", dims.state)
    return _scan_call(_states_kernel, "ssd_scan_states", x, dt, a, b, c, init_state,
                      states_out=True, num_warps=num_warps, num_stages=1, interpret=interpret)


def _decode_kernel(x_ref, dt_ref, da_ref, b_ref, c_ref, s_ref, y_ref, new_ref):
    # block_h heads of one sequence: x_ref [bh, P], dt/da [bh], b/c [bh, N], s [bh, P, N].
    x, b, c = x_ref[...].astype(_F32), b_ref[...].astype(_F32), c_ref[...].astype(_F32)
    state = s_ref[...].astype(_F32) * jnp.exp(da_ref[...])[:, None, None]
    state += (dt_ref[...][:, None] * x)[:, :, None] * b[:, None, :]
    new_ref[...] = state
    y_ref[...] = jnp.sum(state * c[:, None, :], axis=2).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_h", "num_warps", "interpret"))
def ssm_decode_step(
    x: Float[Array, "S H P"],
    dt: Float[Array, "S H"],
    a: Float[Array, "H"],
    b: Float[Array, "S G N"],
    c: Float[Array, "S G N"],
    state: Float[Array, "S H P N"],
    *,
    block_h: int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[Float[Array, "S H P"], Float[Array, "S H P N"]]:
    """Same contract as `reference.ssm_decode_step`; `block_h` heads per program."""
    dims = ssd_dims(x, dt, a, b, c, state)
    s, h, p, n = dims.seqs, dims.heads, dims.head_dim, dims.state
    if block_h is None:  # the largest power of two that divides H, at most 16
        block_h = min(h & -h, 16)
    require(block_h >= 1 and h % block_h == 0,
            f"block_h={block_h}: must divide the {h} heads")
    if not interpret:
        require(block_h & (block_h - 1) == 0, f"block_h={block_h}: must be a power of two")
    check_triton_tile(interpret, "head_dim", p)
    check_triton_tile(interpret, "d_state", n)
    # Per-head B and C (tiny at decode): keeps the kernel free of group arithmetic.
    b = jnp.repeat(b, dims.heads_per_group, axis=1)
    c = jnp.repeat(c, dims.heads_per_group, axis=1)
    dt = dt.astype(_F32)
    da = dt * a.astype(_F32)[None, :]
    heads = lambda *tail: pl.BlockSpec((None, block_h) + tail,
                                       lambda i, j: (i, j) + (0,) * len(tail))
    return pl.pallas_call(
        _decode_kernel,
        grid=(s, h // block_h),
        in_specs=[heads(p), heads(), heads(), heads(n), heads(n), heads(p, n)],
        out_specs=[heads(p), heads(p, n)],
        out_shape=[jax.ShapeDtypeStruct((s, h, p), _F32),
                   jax.ShapeDtypeStruct((s, h, p, n), _F32)],
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="ssm_decode_step",
    )(x, dt, da, b, c, state)
