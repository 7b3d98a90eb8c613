"""The built-in model: a tiny hybrid (Mamba2 + attention + MLP blocks, two MTP modules).

Its trained weights ship beside this file (`weights/`, a metrale checkpoint; see
MODEL_CARD.md), trained on Shakespeare by `metrale train --out metrale_jax/default_model/weights`;
the tokenizer is the project's own byte-level BPE in this folder. `build` gives the same
architecture with a seeded random initialisation (tests, and the untrained baseline).
"""

from __future__ import annotations

import pathlib

from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.default_model import ASSET_DIR
from metrale_jax.model.hybrid import HybridLM

NAME = "metrale-default"
WEIGHTS_DIR: pathlib.Path = ASSET_DIR / "weights"

CONFIG = ModelConfig(
    vocab_size=4096,
    hidden_size=192,
    layer_pattern="MFAFMFAF",
    num_heads=6,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=512,
    ssm_state_size=16,
    conv_kernel=4,
    mamba_num_heads=6,
    mamba_head_dim=64,
    mamba_groups=1,
    mamba_chunk_size=64,
    num_mtp_modules=2,
    mtp_pattern="AF",
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)

SEED = 0


def build(config: ModelConfig = CONFIG, seed: int = SEED) -> HybridLM:
    return HybridLM(config, nnx.Rngs(seed))


def load_trained(path: pathlib.Path = WEIGHTS_DIR, placement=None) -> HybridLM:
    """The committed trained weights (a metrale checkpoint of `CONFIG`); `placement`:
    restored straight onto their shards (metrale_jax/loader/targets.py)."""
    from metrale_jax.loader.checkpoint import (  # heavy: orbax
        is_metrale_checkpoint, load_checkpoint, read_checkpoint_config)

    if not is_metrale_checkpoint(path):
        raise FileNotFoundError(
            f"{path}: the built-in model's trained weights are missing; re-create them with "
            "`metrale train --out metrale_jax/default_model/weights`")
    if read_checkpoint_config(path) != CONFIG:
        raise ValueError(f"{path}: the trained checkpoint's config differs from "
                         "default_model.CONFIG; retrain or update CONFIG")
    return load_checkpoint(path, placement)
