"""Mamba2 mixer: in-projection, causal depthwise conv, SSD scan, gated norm, out-projection.

A sequence's recurrent state lives in a slot: `conv [slots, K-1, conv_dim]` holds the last K-1
conv inputs, `ssm [slots, heads, head_dim, d_state]` (float32) the SSM state. A prefill chunk
starts from its slot's state (or from zero when `ssm_fresh`), so chunked prefill continues
exactly where the previous chunk stopped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from metrale_jax.config import ModelConfig
from metrale_jax.model.batch import StepBatch
from metrale_jax.model.layers import GatedRMSNorm, dtype_of, linear
from metrale_jax.model.lora import BlockLora, group_deltas, project
from pallas_kernels.backend import XLA, KernelOps
from pallas_kernels.scatter import set_rows

SSMState = tuple[Float[Array, "slots K1 conv_dim"], Float[Array, "slots H P N"]]
# Per row, the state after each of the first W positions of its chunk (MTP verification):
# conv tails [S, W, K-1, conv_dim] and SSM states [S, W, H, P, N] float32.
StateCandidates = tuple[Float[Array, "S W K1 conv_dim"], Float[Array, "S W H P N"]]


def causal_conv(
    inputs: Float[Array, "S Q C"],
    prev: Float[Array, "S K1 C"],
    weight: Float[Array, "K C"],
    bias: Float[Array, "C"] | None,
    query_lens: Int[Array, "S"],
) -> tuple[Float[Array, "S Q C"], Float[Array, "S K1 C"]]:
    """Depthwise causal conv continuing from the previous K-1 inputs; returns the new tail."""
    k = weight.shape[0]
    full = jnp.concatenate([prev.astype(inputs.dtype), inputs], axis=1)  # [S, K-1+Q, C]
    q = inputs.shape[1]
    out = sum(full[:, i:i + q, :] * weight[i] for i in range(k))
    if bias is not None:
        out = out + bias
    # The new tail is the K-1 inputs ending at the row's last valid position.
    tail = conv_tails(full, query_lens, k)
    return out, tail


def conv_tails(full: Float[Array, "S L C"], valid: Int[Array, "S"], k: int,
               ) -> Float[Array, "S K1 C"]:
    """The K-1 conv inputs ending at each row's `valid`-th position of the chunk (`full` is
    the previous tail followed by the chunk)."""
    index = valid[:, None] + jnp.arange(k - 1)[None, :]
    return jnp.take_along_axis(full, index[:, :, None], axis=1)


class Mamba2Mixer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: KernelOps = XLA):
        self.cfg = cfg
        self.ops = ops  # static: which kernels (HybridLM.use_kernels)
        h = cfg.mamba_num_heads
        proj = cfg.mamba_inner + cfg.conv_dim + h
        self.in_proj = linear(cfg, cfg.hidden_size, proj, rngs, bias=cfg.mamba_proj_bias)
        bound = 1.0 / np.sqrt(cfg.conv_kernel)
        self.conv_weight = nnx.Param(jax.random.uniform(
            rngs.params(), (cfg.conv_kernel, cfg.conv_dim), dtype_of(cfg), -bound, bound))
        if cfg.mamba_conv_bias:
            self.conv_bias = nnx.Param(jnp.zeros((cfg.conv_dim,), dtype_of(cfg)))
        # Mamba2's usual initialisation: A = -[1..H], dt ~ softplus^-1 of a small step.
        self.a_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)))
        self.dt_bias = nnx.Param(jnp.full((h,), np.log(np.expm1(0.01)), jnp.float32))
        self.d_skip = nnx.Param(jnp.ones((h,), jnp.float32))
        self.norm = GatedRMSNorm(cfg.mamba_inner, cfg.mamba_norm_groups, cfg.norm_eps,
                                 dtype_of(cfg))
        self.out_proj = linear(cfg, cfg.mamba_inner, cfg.hidden_size, rngs,
                               bias=cfg.mamba_proj_bias)

    def __call__(self, x: Float[Array, "T D"], batch: StepBatch, state: SSMState,
                 window: int = 0, lora: BlockLora | None = None,
                 ) -> tuple[Float[Array, "T D"], SSMState, StateCandidates | None]:
        """Returns the output, the new state pools and, when `window` (static) > 0, each
        row's state after each of its chunk's first `window` positions: MTP verification
        keeps them so a row whose drafts are rejected rolls back without recompute. Rows
        whose chunk fits the window then take their outputs from the token-by-token
        recurrence, the decode step's own arithmetic, so a verified token sees what a
        plain decode of it would."""
        cfg = self.cfg
        inner, h, p = cfg.mamba_inner, cfg.mamba_num_heads, cfg.mamba_head_dim
        g, n = cfg.mamba_groups, cfg.ssm_state_size
        (d_in,) = group_deltas(lora, "in", x, ("in_proj",))
        z, xbc, dt = jnp.split(project(self.in_proj, x, d_in, self.ops),
                               [inner, inner + cfg.conv_dim], axis=-1)

        conv_pool, ssm_pool = state
        slots, fresh = batch.ssm_slots, batch.ssm_fresh
        prev_conv = jnp.where(fresh[:, None, None], 0.0, conv_pool[slots])
        prev_ssm = jnp.where(fresh[:, None, None, None], 0.0, ssm_pool[slots])
        query_lens = jnp.sum(batch.gather_valid, axis=1).astype(jnp.int32)

        conv_bias = self.conv_bias[...] if cfg.mamba_conv_bias else None
        padded_xbc = batch.to_padded(xbc)
        xbc_conv, conv_tail = causal_conv(padded_xbc, prev_conv,
                                          self.conv_weight[...], conv_bias, query_lens)
        xbc_conv = jax.nn.silu(xbc_conv)
        xs, b, c = jnp.split(xbc_conv, [inner, inner + g * n], axis=-1)
        s, q = xs.shape[:2]
        xs = xs.reshape(s, q, h, p)
        b = b.reshape(s, q, g, n)
        c = c.reshape(s, q, g, n)

        dt = jax.nn.softplus(batch.to_padded(dt).astype(jnp.float32) + self.dt_bias[...])
        dt = jnp.clip(dt, cfg.time_step_min, cfg.time_step_max)
        dt = jnp.where(batch.gather_valid[..., None], dt, 0.0)  # padding leaves the state alone
        a = -jnp.exp(self.a_log[...].astype(jnp.float32))

        candidates = None
        if window and q <= window:
            y, states = self.ops.ssd_scan_states(xs, dt, a, b, c, prev_ssm)
            new_ssm = jnp.take_along_axis(
                states, jnp.maximum(query_lens - 1, 0)[:, None, None, None, None], axis=1)[:, 0]
        elif q == 1:
            y, new_ssm = self.ops.ssm_decode_step(xs[:, 0], dt[:, 0], a, b[:, 0], c[:, 0],
                                                  prev_ssm)
            y = y[:, None]
        else:
            y, new_ssm = self.ops.ssd_chunk_scan(xs, dt, a, b, c, prev_ssm,
                                                 chunk_size=cfg.mamba_chunk_size)
            if window:
                w = window
                y_rec, states = self.ops.ssd_scan_states(xs[:, :w], dt[:, :w], a, b[:, :w],
                                                         c[:, :w], prev_ssm)
                short = (query_lens <= w)[:, None, None, None]
                y = jnp.where(short, jnp.pad(y_rec, ((0, 0), (0, q - w), (0, 0), (0, 0))), y)
        if window:
            w = min(window, q)
            full = jnp.concatenate([prev_conv.astype(padded_xbc.dtype), padded_xbc], axis=1)
            tails = jnp.stack([conv_tails(full, jnp.full((s,), j + 1, jnp.int32),
                                          cfg.conv_kernel) for j in range(w)], axis=1)
            candidates = (tails, states)
        y = y + xs.astype(jnp.float32) * self.d_skip[...][:, None]
        y = batch.to_flat(y.reshape(s, q, inner).astype(x.dtype))
        gated = self.norm(y, z)
        (d_out,) = group_deltas(lora, "out", gated, ("out_proj",))
        out = project(self.out_proj, gated, d_out, self.ops)

        conv_pool = set_rows(conv_pool, slots, conv_tail)
        ssm_pool = set_rows(ssm_pool, slots, new_ssm)
        return out, (conv_pool, ssm_pool), candidates
