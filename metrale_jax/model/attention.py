"""Attention mixer: GQA with RoPE and optional QK-norm, reading and writing paged K/V."""

from __future__ import annotations

from flax import nnx
from jaxtyping import Array, Float

from metrale_jax.config import ModelConfig
from metrale_jax.model.batch import StepBatch
from metrale_jax.model.layers import RMSNorm, linear
from metrale_jax.model.lora import BlockLora, group_deltas, project, project_group
from metrale_jax.model.rope import inverse_frequencies, rope_tables, rotate
from pallas_kernels.backend import XLA, KernelOps

KVPages = tuple[Float[Array, "blocks kv_heads block_size head_dim"],
                Float[Array, "blocks kv_heads block_size head_dim"]]


class Attention(nnx.Module):
    # Layers over one input whose kernels get one packed copy side by side (model/packing.py).
    PACK_GROUPS = {"qkv_packed": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, ops: KernelOps = XLA):
        self.cfg = cfg
        self.ops = ops  # static: which kernels (HybridLM.use_kernels)
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = linear(cfg, d, h * hd, rngs)
        self.k_proj = linear(cfg, d, kvh * hd, rngs)
        self.v_proj = linear(cfg, d, kvh * hd, rngs)
        self.o_proj = linear(cfg, h * hd, d, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)

    def __call__(self, x: Float[Array, "T D"], batch: StepBatch, kv: KVPages,
                 lora: BlockLora | None = None, norm: RMSNorm | None = None,
                 ) -> tuple[Float[Array, "T D"], KVPages]:
        """`norm`: the block's pre-norm, applied to `x` first (folded into the q/k/v
        projection's custom call on the CPU's decode rows)."""
        cfg = self.cfg
        t = x.shape[0]
        if norm is not None and lora is not None:  # the adapters read the normed rows
            x, norm = norm(x), None
        deltas = group_deltas(lora, "qkv", x, ("q_proj", "k_proj", "v_proj"))
        q, k, v = project_group((self.q_proj, self.k_proj, self.v_proj), x, deltas, self.ops,
                                getattr(self, "qkv_packed", None), norm)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.use_rope:
            tables = rope_tables(batch.positions, inverse_frequencies(cfg))
            q, k = rotate(q, tables), rotate(k, tables)
        k_pages, v_pages = self.ops.write_kv_pages(kv[0], kv[1], k, v, batch.slot_mapping)
        out = self.ops.ragged_paged_attention(q, k_pages, v_pages, batch,
                                              scale=cfg.head_dim ** -0.5)
        out = out.reshape(t, cfg.num_heads * cfg.head_dim)
        (do,) = group_deltas(lora, "o", out, ("o_proj",))
        return project(self.o_proj, out, do, self.ops), (k_pages, v_pages)
