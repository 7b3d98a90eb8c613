"""The device caches: paged K/V per attention layer, conv and SSM state per Mamba2 layer.

Block 0 of every KV pool is the null block that padding tokens write into; slot 0 of every
SSM pool is the null slot that padding rows use. Host bookkeeping (which block or slot
belongs to whom) lives in `metrale_jax.cache`; here are only the arrays and their sizes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from metrale_jax.config import EngineConfig, ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceCaches:
    # One (k, v) pair per attention block, main model first, then the MTP modules':
    # each [num_blocks, block_size, kv_heads, head_dim].
    kv: tuple[tuple[jax.Array, jax.Array], ...]
    conv: tuple[jax.Array, ...]  # per Mamba2 block: [num_slots, conv_kernel - 1, conv_dim]
    ssm: tuple[jax.Array, ...]   # per Mamba2 block: [num_slots, heads, head_dim, d_state] f32

    @property
    def num_blocks(self) -> int:
        return self.kv[0][0].shape[0] if self.kv else 0

    @property
    def num_slots(self) -> int:
        return self.conv[0].shape[0] if self.conv else 0


def num_kv_layers(cfg: ModelConfig) -> int:
    return len(cfg.attention_layers) + cfg.num_mtp_attention_layers


def kv_bytes_per_block(cfg: ModelConfig, block_size: int) -> int:
    per_layer = 2 * block_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    return per_layer * num_kv_layers(cfg)


def num_kv_blocks(cfg: ModelConfig, engine: EngineConfig) -> int:
    """Blocks in the pool, the null block included: explicit, or what the budget holds."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    per_block = kv_bytes_per_block(cfg, engine.block_size)
    if per_block == 0:  # a pure SSM model has no KV pool, only the null block
        return 1
    blocks = engine.kv_memory_bytes // per_block
    if blocks < 2:
        raise ValueError(
            f"kv_memory_bytes: {engine.kv_memory_bytes} bytes hold {blocks} KV blocks of "
            f"{per_block} bytes; at least 2 are needed")
    return int(blocks)


def allocate_caches(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                    ) -> DeviceCaches:
    dt = jnp.dtype(cfg.dtype)
    page = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    kv = tuple((jnp.zeros(page, dt), jnp.zeros(page, dt)) for _ in range(num_kv_layers(cfg)))
    n_mamba = len(cfg.mamba_layers)
    conv = tuple(jnp.zeros((num_slots, cfg.conv_kernel - 1, cfg.conv_dim), dt)
                 for _ in range(n_mamba))
    ssm = tuple(jnp.zeros((num_slots, cfg.mamba_num_heads, cfg.mamba_head_dim,
                           cfg.ssm_state_size), jnp.float32) for _ in range(n_mamba))
    return DeviceCaches(kv=kv, conv=conv, ssm=ssm)
