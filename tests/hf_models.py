"""Tiny Hugging Face checkpoints built locally with transformers (nothing is downloaded)."""

from __future__ import annotations

import pathlib
import shutil

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from metrale_jax.default_model import ASSET_DIR


def save_tiny_nemotronh(path: pathlib.Path, **overrides) -> NemotronHForCausalLM:
    """A seeded random NemotronH hybrid saved with `save_pretrained`, plus the built-in
    tokenizer files so the directory loads as a complete model."""
    torch.manual_seed(0)
    fields = dict(vocab_size=4096, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, n_groups=2, mamba_head_dim=16,
                  chunk_size=8, initializer_range=0.1)
    model = NemotronHForCausalLM(NemotronHConfig(**{**fields, **overrides})).eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET_DIR / name, path / name)
    return model
