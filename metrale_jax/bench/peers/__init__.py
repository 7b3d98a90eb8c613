"""Peers run on the same weights and workloads as metrale_jax: transformers and llama.cpp."""
