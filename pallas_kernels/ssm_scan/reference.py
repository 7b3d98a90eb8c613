"""jnp reference for the Mamba2 SSD (state space duality) scan.

The recurrence per head h, for each position t:
    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t B_t^T        state: [head_dim, d_state]
    y_t     = state_t C_t
`dt` arrives already discretised (softplus, bias, clamp); padding positions carry dt = 0, which
leaves the state untouched (decay exp(0) = 1, no input). The D skip and gating are the caller's.

The chunked form computes the intra-chunk part as a masked, decayed attention-like product
and carries the state across chunks; the decay matrix is formed explicitly so every
contraction is a two-operand einsum (much faster on XLA:CPU than one four-operand einsum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels.ssm_scan.common import ssd_dims


def _heads_from_groups(t: Float[Array, "... G N"], num_heads: int) -> Float[Array, "... H N"]:
    return jnp.repeat(t, num_heads // t.shape[-2], axis=-2)


def _f32_per_head(x, dt, b, c, num_heads: int):
    """x, dt in float32 and B, C broadcast from their groups to every head."""
    f32 = jnp.float32
    return (x.astype(f32), dt.astype(f32), _heads_from_groups(b.astype(f32), num_heads),
            _heads_from_groups(c.astype(f32), num_heads))


def ssd_chunk_scan(
    x: Float[Array, "S Q H P"],
    dt: Float[Array, "S Q H"],
    a: Float[Array, "H"],
    b: Float[Array, "S Q G N"],
    c: Float[Array, "S Q G N"],
    init_state: Float[Array, "S H P N"],
    *,
    chunk_size: int,
) -> tuple[Float[Array, "S Q H P"], Float[Array, "S H P N"]]:
    """Run the SSD over Q positions per sequence, starting from `init_state`."""
    dims = ssd_dims(x, dt, a, b, c, init_state)
    s, q, h, p, n = dims.seqs, dims.length, dims.heads, dims.head_dim, dims.state
    chunk = min(chunk_size, q)
    pad = (-q) % chunk
    f32 = jnp.float32
    x, dt, bh, ch = _f32_per_head(x, dt, b, c, h)
    if pad:
        padding = lambda t: jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        x, dt, bh, ch = map(padding, (x, dt, bh, ch))
    nc = (q + pad) // chunk
    # [S, nc, L, ...] with heads moved before positions where the decay math wants them.
    xs = x.reshape(s, nc, chunk, h, p)
    bs_ = bh.reshape(s, nc, chunk, h, n)
    cs = ch.reshape(s, nc, chunk, h, n)
    da = (dt * a.astype(f32)).reshape(s, nc, chunk, h).transpose(0, 1, 3, 2)  # [S,nc,H,L]
    cum = jnp.cumsum(da, axis=-1)
    xdt = xs * dt.reshape(s, nc, chunk, h)[..., None]  # dt_j x_j

    # Intra-chunk: y_i = sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j.
    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))
    seg = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, seg, 0.0)), 0.0)  # [S,nc,H,L,L]
    scores = jnp.einsum("sclhn,scmhn->schlm", cs, bs_) * decay
    y_diag = jnp.einsum("schlm,scmhp->sclhp", scores, xdt)

    # Each chunk's own contribution to the state at its end.
    to_end = jnp.exp(cum[..., -1:] - cum)  # [S,nc,H,L]
    chunk_states = jnp.einsum("sclhn,sclhp->schpn", bs_ * to_end.transpose(0, 1, 3, 2)[..., None],
                              xdt)
    chunk_decay = jnp.exp(cum[..., -1])  # [S,nc,H]

    def carry_state(state, inputs):
        own, dec = inputs
        return state * dec[:, :, None, None] + own, state

    final, starts = jax.lax.scan(
        carry_state, init_state.astype(f32),
        (chunk_states.transpose(1, 0, 2, 3, 4), chunk_decay.transpose(1, 0, 2)))
    starts = starts.transpose(1, 0, 2, 3, 4)  # state entering each chunk: [S,nc,H,P,N]

    # Inter-chunk: y_i += exp(cum_i) C_i . state_start.
    y_off = jnp.einsum("sclhn,schpn->sclhp", cs, starts) * jnp.exp(cum).transpose(0, 1, 3, 2)[..., None]
    y = (y_diag + y_off).reshape(s, nc * chunk, h, p)[:, :q]
    return y, final


def ssm_decode_step(
    x: Float[Array, "S H P"],
    dt: Float[Array, "S H"],
    a: Float[Array, "H"],
    b: Float[Array, "S G N"],
    c: Float[Array, "S G N"],
    state: Float[Array, "S H P N"],
) -> tuple[Float[Array, "S H P"], Float[Array, "S H P N"]]:
    """One position of the recurrence: the decode path, addressed by state slot upstream."""
    h = ssd_dims(x, dt, a, b, c, state).heads
    f32 = jnp.float32
    x, dt, bh, ch = _f32_per_head(x, dt, b, c, h)
    decay = jnp.exp(dt * a.astype(f32))[:, :, None, None]
    new_state = state.astype(f32) * decay + (dt[:, :, None] * x)[..., None] * bh[:, :, None, :]
    y = jnp.einsum("shpn,shn->shp", new_state, ch)
    return y, new_state


def ssd_scan_states(
    x: Float[Array, "S Q H P"],
    dt: Float[Array, "S Q H"],
    a: Float[Array, "H"],
    b: Float[Array, "S Q G N"],
    c: Float[Array, "S Q G N"],
    init_state: Float[Array, "S H P N"],
) -> tuple[Float[Array, "S Q H P"], Float[Array, "S Q H P N"]]:
    """The recurrence token by token, keeping the state after every position: MTP
    verification rolls a sequence's state back to its last accepted token with it."""
    ssd_dims(x, dt, a, b, c, init_state)

    def one(state, inputs):
        xt, dtt, bt, ct = inputs
        y, state = ssm_decode_step(xt, dtt, a, bt, ct, state)
        return state, (y, state)

    move = lambda t: jnp.moveaxis(t, 1, 0)
    _, (y, states) = jax.lax.scan(one, init_state.astype(jnp.float32),
                                  (move(x), move(dt), move(b), move(c)))
    return move(y), move(states)
