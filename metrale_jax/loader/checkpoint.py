"""Our own checkpoint format, and `load_model` for either format.

A metrale checkpoint is a directory:
    metrale_config.json   the ModelConfig as JSON (plus a format tag)
    state/                the parameters as an orbax StandardCheckpointer pytree
Tokenizer files may sit beside them (the engine reads the tokenizer from the same directory).
The config file deliberately is not `config.json`, so a directory is never mistaken for a
Hugging Face one (or the reverse).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.loader.hf_weights import load_hf_model
from metrale_jax.loader.targets import Placement, param_shardings, plain_path
from metrale_jax.model.hybrid import HybridLM

CONFIG_FILE = "metrale_config.json"
STATE_DIR = "state"
FORMAT = "metrale_jax/1"


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig as strict JSON: non-finite floats become strings ("inf")."""
    def encode(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, tuple):
            return [encode(x) for x in v]
        return v
    return {f.name: encode(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def config_from_json(data: dict[str, Any]) -> ModelConfig:
    known = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{CONFIG_FILE}: unknown ModelConfig fields {unknown}")
    fields = {}
    for name, value in data.items():
        if isinstance(value, list):  # tuples travel as JSON lists
            value = tuple(value)
        if isinstance(value, str) and value in ("inf", "-inf", "nan"):
            value = float(value)
        fields[name] = value
    return ModelConfig(**fields)


def _state_dir(path: Path) -> Path:
    # orbax wants absolute paths.
    return (path / STATE_DIR).absolute()


def save_checkpoint(model: HybridLM, path: str | Path) -> Path:
    """Write `model` (config and parameters) into directory `path`, replacing a previous one."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(_state_dir(path), nnx.to_pure_dict(state), force=True)
    checkpointer.wait_until_finished()
    # The config goes last: its presence marks a complete checkpoint.
    with open(path / CONFIG_FILE, "w") as f:
        json.dump({"format": FORMAT, "model_config": config_to_json(model.cfg)}, f, indent=2)
    return path


def is_metrale_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def read_checkpoint_config(path: str | Path) -> ModelConfig:
    with open(Path(path) / CONFIG_FILE) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}/{CONFIG_FILE}: format {data.get('format')!r}, expected {FORMAT!r}")
    return config_from_json(data["model_config"])


def _like(target: Any, restored: Any) -> Any:
    """`restored` keyed exactly like `target`: orbax stores list indices as string keys."""
    if not isinstance(target, dict):
        return restored
    return {k: _like(v, restored[k] if k in restored else restored[str(k)])
            for k, v in target.items()}


def load_checkpoint(path: str | Path, placement: Placement | None = None) -> HybridLM:
    """Restore a model written by `save_checkpoint`, straight into its final shapes/dtypes:
    onto this process's first device, or with a `placement` (loader/targets.py) into each
    parameter's sharding, every device reading only its own shard from the files."""
    path = Path(path)
    cfg = read_checkpoint_config(path)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg, nnx.Rngs(0))))
    pure = nnx.to_pure_dict(state)
    target = jax.tree.unflatten(jax.tree.structure(pure), _restore_targets(pure, cfg, placement))
    restored = ocp.StandardCheckpointer().restore(_state_dir(path), target)
    nnx.replace_by_pure_dict(state, _like(target, restored))
    return nnx.merge(graphdef, state)


def _restore_targets(pure: dict, cfg: ModelConfig, placement: Placement | None,
                     ) -> list[jax.ShapeDtypeStruct]:
    """The abstract leaves orbax restores into, each with the sharding it lands on. Whatever
    the device layout of the save: the targets' shardings win (with several processes,
    orbax would otherwise refuse the saved one-device topology)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(pure)
    shardings = param_shardings(placement, cfg, flat)
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=local if shardings is None
                                 else shardings[plain_path(path)]) for path, x in flat]


def load_model(path_or_dir: str | Path, *, dtype: str | None = None, progress: bool = True,
               placement: Placement | None = None) -> tuple[HybridLM, ModelConfig]:
    """Load either format: a metrale checkpoint or a Hugging Face directory.

    `path_or_dir` may also name a file inside the directory (e.g. its config.json).
    `dtype` converts a Hugging Face checkpoint; a metrale checkpoint keeps its saved dtype.
    `placement`: load every parameter straight onto its shards (loader/targets.py).
    """
    path = Path(path_or_dir)
    if path.is_file():
        path = path.parent
    if is_metrale_checkpoint(path):
        if dtype is not None and dtype != read_checkpoint_config(path).dtype:
            raise ValueError(f"dtype: {path} is a metrale checkpoint saved in "
                             f"{read_checkpoint_config(path).dtype}; it cannot load as {dtype}")
        model = load_checkpoint(path, placement)
        return model, model.cfg
    if (path / "config.json").is_file():
        return load_hf_model(path, dtype=dtype, progress=progress, placement=placement)
    raise FileNotFoundError(f"{path}: neither a metrale checkpoint ({CONFIG_FILE}) nor a Hugging "
                            "Face model directory (config.json + *.safetensors)")
