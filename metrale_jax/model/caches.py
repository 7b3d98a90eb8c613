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
from pallas_kernels.backend import resolve


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceCaches:
    # One (k, v) pair per attention block, main model first, then the MTP modules' (only
    # while speculative decoding runs): each [num_blocks, kv_heads, block_size, head_dim].
    kv: tuple[tuple[jax.Array, jax.Array], ...]
    conv: tuple[jax.Array, ...]  # per Mamba2 block: [num_slots, conv_kernel - 1, conv_dim]
    ssm: tuple[jax.Array, ...]   # per Mamba2 block: [num_slots, heads, head_dim, d_state] f32

    @property
    def num_blocks(self) -> int:
        return self.kv[0][0].shape[0] if self.kv else 0

    @property
    def num_slots(self) -> int:
        return self.conv[0].shape[0] if self.conv else 0


def num_kv_layers(cfg: ModelConfig, with_mtp: bool = False) -> int:
    """KV layers in the pool: the main model's, plus the MTP modules' when they run."""
    return len(cfg.attention_layers) + (cfg.num_mtp_attention_layers if with_mtp else 0)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: str,
                       with_mtp: bool = False, kv_heads: int | None = None) -> int:
    """Bytes of one block over every KV layer; `kv_heads`: heads one device stores (tensor
    parallel), default the model's."""
    kv_heads = cfg.num_kv_heads if kv_heads is None else kv_heads
    per_layer = 2 * block_size * kv_heads * cfg.head_dim * jnp.dtype(kv_dtype).itemsize
    return per_layer * num_kv_layers(cfg, with_mtp)


def num_kv_blocks(cfg: ModelConfig, engine: EngineConfig, with_mtp: bool = False) -> int:
    """Blocks in the pool, the null block included: explicit, or what the budget holds.
    Under tensor parallelism the budget is each device's, as its pages hold its KV heads."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    kv_heads = engine.parallel.kv_heads_per_device(cfg.num_kv_heads)
    per_block = kv_bytes_per_block(cfg, engine.block_size, kv_cache_dtype(cfg, engine),
                                   with_mtp, kv_heads)
    if per_block == 0:
        # An attention-free model has no KV arrays: its block pool is bookkeeping alone (the
        # scheduler's lengths, prefix hashes for SSM snapshots), so size it to hold every
        # sequence at full length, which costs no device memory.
        return 1 + engine.max_batch_size * engine.max_blocks_per_seq
    blocks = engine.kv_memory_bytes // per_block
    if blocks < 2:
        raise ValueError(
            f"kv_memory_bytes: {engine.kv_memory_bytes} bytes hold {blocks} KV blocks of "
            f"{per_block} bytes; at least 2 are needed")
    return int(blocks)


def kv_cache_dtype(cfg: ModelConfig, engine: EngineConfig) -> str:
    """The KV pool's dtype: explicit, or the model's dtype on accelerators. On the CPU, a
    bf16 model keeps bf16 pages where the CPU attention kernel runs (it widens them as it
    loads them: half the bytes of a pass that is bound by them), and every other model
    float32: XLA has no fast path for bf16 K/V in the attention mat-vecs (measured 4-5x
    slower than f32, while bf16 weight matmuls are the faster ones)."""
    if engine.kv_cache_dtype != "auto":
        return engine.kv_cache_dtype
    if jax.default_backend() != "cpu":
        return cfg.dtype
    kernel_pages = resolve(engine.kernel_backend, "cpu").cpu_kernels
    return "bfloat16" if kernel_pages and cfg.dtype == "bfloat16" else "float32"


def allocate_caches(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                    kv_dtype: str | None = None, with_mtp: bool = False,
                    kv_heads: int | None = None) -> DeviceCaches:
    """`kv_heads`: the pool's KV heads, default the model's (tensor parallel with fewer KV
    heads than devices stores one per device: `ParallelConfig.stored_kv_heads`)."""
    dt = jnp.dtype(cfg.dtype)
    kv_dt = jnp.dtype(kv_dtype or cfg.dtype)
    page = (num_blocks, cfg.num_kv_heads if kv_heads is None else kv_heads, block_size,
            cfg.head_dim)
    kv = tuple((jnp.zeros(page, kv_dt), jnp.zeros(page, kv_dt))
               for _ in range(num_kv_layers(cfg, with_mtp)))
    n_mamba = len(cfg.mamba_layers)
    conv = tuple(jnp.zeros((num_slots, cfg.conv_kernel - 1, cfg.conv_dim), dt)
                 for _ in range(n_mamba))
    ssm = tuple(jnp.zeros((num_slots, cfg.mamba_num_heads, cfg.mamba_head_dim,
                           cfg.ssm_state_size), jnp.float32) for _ in range(n_mamba))
    return DeviceCaches(kv=kv, conv=conv, ssm=ssm)
