"""Host bookkeeping of device memory: which KV blocks and SSM slots belong to whom."""

from metrale_jax.cache.block_pool import BlockPool, SlotPool

__all__ = ["BlockPool", "SlotPool"]
