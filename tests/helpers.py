"""Shared helpers for tests: a tiny hybrid config, a jitted all-positions forward and a
seeded random model drawn with numpy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.model import HybridLM, allocate_caches
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch

TINY_HYBRID = ModelConfig(
    vocab_size=301, hidden_size=64, layer_pattern="MFAFMA", num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=96, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16,
    mamba_groups=2, mamba_norm_groups=2, mamba_chunk_size=4, num_mtp_modules=1)

# A small Llama shape (the tensor-parallel and multi-process tests: 4 heads, 2 KV heads).
TINY_LLAMA = ModelConfig(
    vocab_size=512, hidden_size=64, layer_pattern="AFAF", num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=128, max_position_embeddings=128)


class Forward:
    """One model with its caches; `run` returns logits at every token of each row."""

    def __init__(self, cfg: ModelConfig = TINY_HYBRID, num_blocks: int = 64, block_size: int = 4,
                 num_slots: int = 8, seed: int = 0):
        self.model = HybridLM(cfg, nnx.Rngs(seed))
        self.block_size = block_size
        self.caches = allocate_caches(cfg, num_blocks, block_size, num_slots)
        graphdef, state = nnx.split(self.model)

        @functools.partial(jax.jit, donate_argnums=(2,))
        def forward(state, batch, caches):
            model = nnx.merge(graphdef, state)
            hidden, caches = model(batch, caches)
            return model.logits(hidden), caches

        self._state, self._forward = state, forward

    def run(self, rows: list[RowChunk], shape: StepShape) -> list[np.ndarray]:
        batch = jax.tree.map(jnp.asarray, build_step_batch(rows, shape, self.block_size))
        logits, self.caches = self._forward(self._state, batch, self.caches)
        logits = np.asarray(logits)
        out, cursor = [], 0
        for row in rows:
            out.append(logits[cursor:cursor + len(row.tokens)])
            cursor += len(row.tokens)
        return out

    def ssm_state(self, slot: int) -> list[np.ndarray]:
        return [np.asarray(s[slot]) for s in self.caches.ssm] + \
               [np.asarray(c[slot]) for c in self.caches.conv]


def random_model(cfg: ModelConfig):
    """A seeded random model drawn with numpy: nnx's initializers compile one program per
    parameter shape, seconds of a cold run for nothing under test here. Norm scales and
    D are ones, A = -[1..H] and dt's bias as Mamba2 initialises them, the rest N(0, 0.05)."""
    from metrale_jax.parallel.specs import key_names

    rng = np.random.default_rng(0)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg, nnx.Rngs(0))))

    def draw(path, x):
        leaf = key_names(path)[-1]
        if leaf in ("scale", "d_skip"):
            return np.ones(x.shape, x.dtype)
        if leaf == "a_log":
            return np.log(np.arange(1, x.shape[0] + 1)).astype(x.dtype)
        if leaf == "dt_bias":
            return np.full(x.shape, np.log(np.expm1(0.01)), x.dtype)
        return (0.05 * rng.standard_normal(x.shape)).astype(x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))
