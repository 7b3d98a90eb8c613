"""Shared helpers for tests: a tiny hybrid config and a jitted all-positions forward."""

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
