"""Tiny Hugging Face checkpoints built locally with transformers (nothing is downloaded)."""

from __future__ import annotations

import pathlib
import shutil

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, NemotronHConfig, NemotronHForCausalLM

from metrale_jax.default_model import ASSET_DIR


def save_tiny_nemotronh(path: pathlib.Path, **overrides) -> NemotronHForCausalLM:
    """A seeded random NemotronH hybrid saved with `save_pretrained`, plus the built-in
    tokenizer files so the directory loads as a complete model."""
    torch.manual_seed(0)
    fields = dict(vocab_size=4096, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, n_groups=2, mamba_head_dim=16,
                  chunk_size=8, initializer_range=0.1)
    model = NemotronHForCausalLM(NemotronHConfig(**{**fields, **overrides})).eval()
    return _save(model, path)


def save_tiny_mamba2(path: pathlib.Path) -> Mamba2ForCausalLM:
    """A seeded random attention-free Mamba2 model, saved the same way."""
    torch.manual_seed(0)
    model = Mamba2ForCausalLM(Mamba2Config(
        vocab_size=4096, hidden_size=64, num_heads=8, head_dim=16, expand=2, n_groups=2,
        state_size=16, num_hidden_layers=2, chunk_size=8, initializer_range=0.1)).eval()
    return _save(model, path)


def _save(model, path: pathlib.Path):
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET_DIR / name, path / name)
    return model


def save_tiny_llama(path: pathlib.Path) -> "LlamaForCausalLM":
    """A seeded random Llama (two layers, grouped KV heads), saved the same way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1)).eval()
    return _save(model, path)
