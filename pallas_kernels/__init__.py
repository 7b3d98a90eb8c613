"""Pallas kernels of metrale_jax, each beside the jnp reference it must equal.

Every kernel folder holds `reference.py`: the plain jnp/XLA version that the engine runs on
CPUs and that tests compare the kernel against. The engine's model code calls these
functions through their shared signatures, so a kernel can replace its reference one-for-one.
"""
