"""CPU kernels as XLA custom calls (C++ compiled on first use), beside the jnp references."""
