"""Fused acceptance for speculative decoding (MTP drafts): greedy exact, sampled by rejection
sampling so the output distribution equals the target's.

`reference` holds the jnp version (the XLA path); `kernel` the Pallas one, same signature
plus static tiling arguments and `interpret`.
"""

from pallas_kernels.mtp.reference import mtp_accept

__all__ = ["mtp_accept"]
