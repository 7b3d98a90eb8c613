"""Small building blocks shared by every architecture: norms, the MLP, linear layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from metrale_jax.config import ModelConfig
from metrale_jax.model.lora import BlockLora, group_deltas, project, project_group
from pallas_kernels.backend import XLA


def dtype_of(cfg: ModelConfig) -> jnp.dtype:
    return jnp.dtype(cfg.dtype)


def accumulate_dtype(cfg: ModelConfig) -> jnp.dtype | None:
    """What a 16-bit model's matmuls accumulate and return: float32 (None: the operands'
    own). On XLA:CPU a bf16 x bf16 dot asked for a float32 result runs on the AMX/bf16 units,
    ~3x an f32 dot at M >= 16, while one asked for a bf16 result takes a path ~1.5x *slower*
    than f32; on GPUs it is the usual f32 accumulation."""
    return jnp.float32 if dtype_of(cfg).itemsize == 2 else None


def linear(cfg: ModelConfig, d_in: int, d_out: int, rngs: nnx.Rngs, *, bias: bool = False,
           ) -> nnx.Linear:
    """`x @ kernel` with kernel stored `[in, out]` (the fast layout on XLA:CPU). Apply it with
    `apply_linear`, which returns the activation dtype."""
    init = nnx.initializers.normal(stddev=0.02)
    return nnx.Linear(d_in, d_out, use_bias=bias, kernel_init=init, dtype=dtype_of(cfg),
                      param_dtype=dtype_of(cfg), preferred_element_type=accumulate_dtype(cfg),
                      rngs=rngs)


def apply_linear(layer: nnx.Linear, x: Float[Array, "T I"]) -> Float[Array, "T O"]:
    """`layer(x)` in the layer's dtype (a 16-bit layer accumulates in f32: `accumulate_dtype`)."""
    return layer(x).astype(layer.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        # Normalise in float32 whatever the activation dtype, as the reference models do.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * xf).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Mamba2's output norm: gate with silu(z) first, then RMS-normalise per group."""

    def __init__(self, dim: int, groups: int, eps: float, dtype: jnp.dtype = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.groups = groups
        self.eps = eps

    def __call__(self, x: Float[Array, "... D"], gate: Float[Array, "... D"]) -> Float[Array, "... D"]:
        xf = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        grouped = xf.reshape(xf.shape[:-1] + (self.groups, -1))
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True)
                                          + self.eps)
        return (self.scale[...] * grouped.reshape(xf.shape).astype(x.dtype)).astype(x.dtype)


class MLP(nnx.Module):
    """Gated SiLU (Llama, Qwen3) or the plain squared-ReLU MLP (NemotronH)."""

    # Layers over one input whose kernels get one packed copy side by side (model/packing.py).
    PACK_GROUPS = {"gate_up_packed": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.ops = XLA  # static: which kernels (HybridLM.use_kernels)
        self.kind = cfg.mlp_kind
        d, f = cfg.hidden_size, cfg.intermediate_size
        if self.kind == "gated_silu":
            self.gate_proj = linear(cfg, d, f, rngs)
        self.up_proj = linear(cfg, d, f, rngs)
        self.down_proj = linear(cfg, f, d, rngs)

    def __call__(self, x: Float[Array, "T D"], lora: BlockLora | None = None,
                 norm: RMSNorm | None = None) -> Float[Array, "T D"]:
        """`norm`: the block's pre-norm, applied to `x` first (folded into the gate/up
        projection's custom call on the CPU's decode rows)."""
        # The activation in float32, rounded once: XLA:CPU runs a bf16 silu * mul at twice
        # the f32 form's time (it rounds after each op), and this is the more exact product.
        f32 = jnp.float32
        if norm is not None and (lora is not None or self.kind != "gated_silu"):
            x, norm = norm(x), None  # adapters read the normed rows; one layer: no group
        if self.kind == "gated_silu":
            deltas = group_deltas(lora, "gate_up", x, ("gate_proj", "up_proj"))
            gate, up = project_group((self.gate_proj, self.up_proj), x, deltas, self.ops,
                                     getattr(self, "gate_up_packed", None), norm)
            h = jax.nn.silu(gate.astype(f32)) * up.astype(f32)
        else:
            (d_up,) = group_deltas(lora, "gate_up", x, ("up_proj",))
            h = jnp.square(jax.nn.relu(project(self.up_proj, x, d_up, self.ops).astype(f32)))
        h = h.astype(x.dtype)
        (d_down,) = group_deltas(lora, "down", h, ("down_proj",))
        return project(self.down_proj, h, d_down, self.ops)
