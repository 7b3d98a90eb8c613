"""Ragged paged attention: write new K/V into pages, attend over a sequence's pages.

`reference` holds the jnp versions (the XLA path); `kernel` the Pallas ones, same signatures
plus static tiling arguments and `interpret`.
"""

from pallas_kernels.paged_attention.reference import paged_attention, write_kv_pages

__all__ = ["paged_attention", "write_kv_pages"]
