"""metrale_jax: an LLM inference and serving engine for hybrid models on JAX.

`from metrale_jax import LLM, SamplingParams` is the offline API. Imports are lazy so the
host-side modules (requests, scheduling, cache bookkeeping) load without jax.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "metrale_jax.engine",
    "SamplingParams": "metrale_jax.request",
    "RequestError": "metrale_jax.request",
    "StructuredOutputsParams": "metrale_jax.grammar",
    "LoRARequest": "metrale_jax.lora.request",
    "RequestOutput": "metrale_jax.outputs",
    "CompletionOutput": "metrale_jax.outputs",
    "Logprob": "metrale_jax.outputs",
    "ModelConfig": "metrale_jax.config",
    "EngineConfig": "metrale_jax.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'metrale_jax' has no attribute {name!r}")
