"""Pallas kernels of metrale_jax, each beside the jnp reference it must equal.

Every kernel folder holds `reference.py` (the plain jnp/XLA version the engine runs on CPUs
and the tests compare against), `kernel.py` (the Pallas version: kernel body, and a jitted
wrapper with the same signature plus static tiling arguments and `interpret`) and
`common.py` (the shape checks both share, so they cannot drift). `backend.py` picks one of
the two per `EngineConfig.kernel_backend` and hands the model a hashable op set.

* `paged_attention/`: ragged paged attention (prefill chunks and decode tokens in one call)
  and the K/V page write.
* `ssm_scan/`: the Mamba2 SSD chunked scan, the decode step, the scan keeping every state.
* `mtp/`: fused speculative-decoding acceptance (greedy, and rejection sampling).
"""
