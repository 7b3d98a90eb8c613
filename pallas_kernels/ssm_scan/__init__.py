"""Mamba2 SSD: the chunked scan for prefill chunks, the single-step update for decode, and the
scan that keeps every position's state (MTP verification rolls back with it).

`reference` holds the jnp versions (the XLA path); `kernel` the Pallas ones, same signatures
plus static tiling arguments and `interpret`.
"""

from pallas_kernels.ssm_scan.reference import ssd_chunk_scan, ssd_scan_states, ssm_decode_step

__all__ = ["ssd_chunk_scan", "ssd_scan_states", "ssm_decode_step"]
