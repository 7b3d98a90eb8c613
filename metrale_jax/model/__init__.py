"""Device math: layers, attention, Mamba2, MTP and the hybrid assembly."""

from metrale_jax.model.batch import StepBatch
from metrale_jax.model.caches import DeviceCaches, allocate_caches
from metrale_jax.model.hybrid import HybridLM

__all__ = ["DeviceCaches", "HybridLM", "StepBatch", "allocate_caches"]
