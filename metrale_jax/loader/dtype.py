"""Recast a loaded model to another dtype (`LLM(dtype=...)`, `--dtype`), as vLLM's `dtype`.

Weights and activations take the new dtype; SSM state stays float32 and the KV pool's dtype is
chosen apart (`EngineConfig.kv_cache_dtype`). The model is rebuilt abstractly from the new
config, so every module that derives a dtype from the config agrees with the cast weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import DTYPES, ConfigError
from metrale_jax.model.hybrid import HybridLM

# vLLM's spellings, accepted too.
ALIASES = {"auto": None, "float": "float32", "fp32": "float32", "bf16": "bfloat16",
           "half": "float16", "fp16": "float16"}


def resolve_dtype(dtype: str | None) -> str | None:
    """A dtype name, or None to keep the checkpoint's; a clear error for anything else."""
    if dtype is None:
        return None
    name = ALIASES.get(dtype, dtype)
    if name is not None and name not in DTYPES:
        raise ConfigError(f"dtype: must be auto or one of {DTYPES}, got {dtype!r}")
    return name


def with_dtype(model: HybridLM, dtype: str) -> HybridLM:
    """`model` with its weights cast to `dtype` (a new model; the old one is untouched)."""
    if model.cfg.dtype == dtype:
        return model
    cfg = model.cfg.replace(dtype=dtype)
    abstract = nnx.eval_shape(lambda: HybridLM(cfg, nnx.Rngs(0)))
    graphdef, target = nnx.split(abstract)
    _, state = nnx.split(model)
    cast = jax.tree.map(lambda w, t: jnp.asarray(w, t.dtype), state, target)
    return nnx.merge(graphdef, cast)
