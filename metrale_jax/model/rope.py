"""Rotary position embeddings (the rotate-half layout of Llama and Qwen), with scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from metrale_jax.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotation speeds, computed once on the host as a constant of the trace."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_scaling_args[0]
    elif cfg.rope_scaling == "llama3":
        factor, low, high, original = cfg.rope_scaling_args
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(is_mid, mid, scaled)
    return inv.astype(np.float32)


def rope_tables(positions: Int[Array, "T"], inv_freq: np.ndarray) -> Float[Array, "2 T half"]:
    """cos and sin of each position's angles, stacked, computed once for both rotations (q and
    k). Left to itself XLA fuses them into each rotation and evaluates them once per head and
    element (XLA:CPU, 512 tokens x 8 heads: 4x the cost of the rotations themselves); the
    no-op `reduce_precision` is an op it does not fuse through, so they stay one array."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    tables = jnp.stack([jnp.cos(angles), jnp.sin(angles)])
    return jax.lax.reduce_precision(tables, exponent_bits=8, mantissa_bits=23)


def rotate(x: Float[Array, "T H D"], tables: Float[Array, "2 T half"]) -> Float[Array, "T H D"]:
    """Rotate-half RoPE of `x` by `rope_tables`, in float32, returned in x's dtype."""
    cos, sin = tables[0][:, None, :], tables[1][:, None, :]
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
