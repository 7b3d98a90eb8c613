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


def add_nemotronh_mtp(path: pathlib.Path, num_modules: int = 2, seed: int = 0) -> None:
    """Give a saved NemotronH `num_modules` MTP modules (attention + MLP each, vLLM's
    nemotron_h_mtp tensor names, seeded random weights) and say so in its config: a hybrid
    checkpoint that can draft, which transformers itself would load without the extras."""
    import json

    import numpy as np
    from safetensors.numpy import load_file, save_file

    hf = json.loads((path / "config.json").read_text())
    d, q = hf["hidden_size"], hf["num_attention_heads"] * hf["head_dim"]
    kv, inner = hf["num_key_value_heads"] * hf["head_dim"], hf["intermediate_size"]
    shapes = {}
    for k in range(num_modules):
        a, f = f"mtp.layers.{2 * k}.", f"mtp.layers.{2 * k + 1}."
        shapes.update({a + "enorm.weight": (d,), a + "hnorm.weight": (d,),
                       a + "eh_proj.weight": (d, 2 * d), a + "norm.weight": (d,),
                       a + "mixer.q_proj.weight": (q, d), a + "mixer.k_proj.weight": (kv, d),
                       a + "mixer.v_proj.weight": (kv, d), a + "mixer.o_proj.weight": (d, q),
                       f + "norm.weight": (d,), f + "mixer.up_proj.weight": (inner, d),
                       f + "mixer.down_proj.weight": (d, inner),
                       f + "final_layernorm.weight": (d,)})
    rng = np.random.RandomState(seed)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, shape in shapes.items():
        norm = name.endswith(("norm.weight", "layernorm.weight"))
        tensors[name] = (1.0 + 0.1 * rng.randn(*shape) if norm
                         else 0.1 * rng.randn(*shape)).astype(np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    hf.update(num_nextn_predict_layers=num_modules,
              mtp_layers_block_type=["full_attention", "mlp"])
    (path / "config.json").write_text(json.dumps(hf))


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
