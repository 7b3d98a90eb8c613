"""Model loading: Hugging Face checkpoints and our own orbax format.

    load_model(dir) -> (HybridLM, ModelConfig)   either format, detected from the directory
    load_hf_model(dir, dtype=None)               config.json + safetensors (sharded or not)
    model_config_from_hf(config_dict)            HF config -> ModelConfig (ValueError if unsupported)
    save_checkpoint(model, dir) / load_checkpoint(dir)
"""

from metrale_jax.loader.checkpoint import (is_metrale_checkpoint, load_checkpoint, load_model,
                                           save_checkpoint)
from metrale_jax.loader.hf_config import (SUPPORTED_ARCHITECTURES, architecture_of,
                                          model_config_from_hf, read_hf_config)
from metrale_jax.loader.hf_weights import load_hf_model, load_hf_weights

__all__ = ["SUPPORTED_ARCHITECTURES", "architecture_of", "is_metrale_checkpoint",
           "load_checkpoint", "load_hf_model", "load_hf_weights", "load_model",
           "model_config_from_hf", "read_hf_config", "save_checkpoint"]
