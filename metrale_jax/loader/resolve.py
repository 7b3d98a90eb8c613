"""Turn a `--model` argument into a model, its config and its tokenizer."""

from __future__ import annotations

import dataclasses
import pathlib

from metrale_jax.config import ModelConfig
from metrale_jax.default_model import ASSET_DIR
from metrale_jax.default_model import model as default_model
from metrale_jax.loader.dtype import resolve_dtype, with_dtype
from metrale_jax.loader.targets import Placement
from metrale_jax.model.hybrid import HybridLM
from metrale_jax.tokenizer import Tokenizer

DEFAULT_NAMES = (None, "", "default", default_model.NAME)


@dataclasses.dataclass
class LoadedModel:
    model: HybridLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str


def load(name_or_dir: str | None, dtype: str | None = None,
         placement: Placement | None = None) -> LoadedModel:
    """The model named by `--model`, recast to `dtype` when one is given (None: as stored).

    `placement` (loader/targets.py): the parameters load straight onto their shards, never
    whole on one device. A Hugging Face checkpoint is then cast to `dtype` part by part as
    it is read; a metrale checkpoint is restored as saved and cast where it lies (each
    device casting its own shard)."""
    dtype = resolve_dtype(dtype)
    loaded = _load(name_or_dir, placement, dtype if placement is not None else None)
    if dtype is not None and dtype != loaded.config.dtype:
        loaded.model = with_dtype(loaded.model, dtype)
        loaded.config = loaded.model.cfg
    return loaded


def _load(name_or_dir: str | None, placement: Placement | None,
          hf_dtype: str | None) -> LoadedModel:
    if name_or_dir in DEFAULT_NAMES:
        return LoadedModel(default_model.load_trained(placement=placement),
                           default_model.CONFIG, Tokenizer.from_dir(ASSET_DIR),
                           default_model.NAME)
    path = pathlib.Path(name_or_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model: {name_or_dir!r} is neither a built-in model ({default_model.NAME}) nor a "
            "directory; models are never downloaded, pass a local Hugging Face or metrale "
            "checkpoint directory")
    from metrale_jax.loader.checkpoint import (  # heavy: orbax, safetensors
        is_metrale_checkpoint, load_model)

    # A metrale checkpoint loads in its saved dtype only (cast above).
    dtype = None if is_metrale_checkpoint(path) else hf_dtype
    model, config = load_model(path, dtype=dtype, placement=placement)
    return LoadedModel(model, config, Tokenizer.from_dir(path), path.name)


def load_tokenizer(name_or_dir: str | None) -> Tokenizer:
    """The tokenizer of a `--model` argument, without loading the weights."""
    if name_or_dir in DEFAULT_NAMES:
        return Tokenizer.from_dir(ASSET_DIR)
    path = pathlib.Path(name_or_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer: {name_or_dir!r} is not a checkpoint directory")
    return Tokenizer.from_dir(path)
