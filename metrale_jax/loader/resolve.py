"""Turn a `--model` argument into a model, its config and its tokenizer."""

from __future__ import annotations

import dataclasses
import pathlib

from metrale_jax.config import ModelConfig
from metrale_jax.default_model import ASSET_DIR
from metrale_jax.default_model import model as default_model
from metrale_jax.loader.dtype import resolve_dtype, with_dtype
from metrale_jax.model.hybrid import HybridLM
from metrale_jax.tokenizer import Tokenizer

DEFAULT_NAMES = (None, "", "default", default_model.NAME)


@dataclasses.dataclass
class LoadedModel:
    model: HybridLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str


def load(name_or_dir: str | None, dtype: str | None = None) -> LoadedModel:
    """The model named by `--model`, recast to `dtype` when one is given (None: as stored)."""
    loaded = _load(name_or_dir)
    dtype = resolve_dtype(dtype)
    if dtype is not None and dtype != loaded.config.dtype:
        loaded.model = with_dtype(loaded.model, dtype)
        loaded.config = loaded.model.cfg
    return loaded


def _load(name_or_dir: str | None) -> LoadedModel:
    if name_or_dir in DEFAULT_NAMES:
        return LoadedModel(default_model.load_trained(), default_model.CONFIG,
                           Tokenizer.from_dir(ASSET_DIR), default_model.NAME)
    path = pathlib.Path(name_or_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model: {name_or_dir!r} is neither a built-in model ({default_model.NAME}) nor a "
            "directory; models are never downloaded, pass a local Hugging Face or metrale "
            "checkpoint directory")
    from metrale_jax.loader.checkpoint import load_model  # heavy: orbax, safetensors

    model, config = load_model(path)
    return LoadedModel(model, config, Tokenizer.from_dir(path), path.name)


def load_tokenizer(name_or_dir: str | None) -> Tokenizer:
    """The tokenizer of a `--model` argument, without loading the weights."""
    if name_or_dir in DEFAULT_NAMES:
        return Tokenizer.from_dir(ASSET_DIR)
    path = pathlib.Path(name_or_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer: {name_or_dir!r} is not a checkpoint directory")
    return Tokenizer.from_dir(path)
