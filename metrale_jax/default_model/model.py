"""The built-in model: a tiny hybrid (Mamba2 + attention + MLP blocks, one MTP module).

Its weights are a seeded initialisation until a trained checkpoint ships beside this file
(`weights/`); the tokenizer is the project's own byte-level BPE in this folder.
"""

from __future__ import annotations

from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.model.hybrid import HybridLM

NAME = "metrale-default"

CONFIG = ModelConfig(
    vocab_size=2048,
    hidden_size=128,
    layer_pattern="MFAFMFAF",
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=384,
    ssm_state_size=16,
    conv_kernel=4,
    mamba_num_heads=4,
    mamba_head_dim=64,
    mamba_groups=1,
    mamba_chunk_size=64,
    num_mtp_modules=1,
    mtp_pattern="AF",
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)

SEED = 0


def build(config: ModelConfig = CONFIG, seed: int = SEED) -> HybridLM:
    return HybridLM(config, nnx.Rngs(seed))
