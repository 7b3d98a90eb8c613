"""HF safetensors checkpoints -> a filled `HybridLM`.

The model is built abstractly (`nnx.eval_shape`) and every parameter leaf is named by the HF
tensor it comes from (`hf_rules`). Before any data is read the whole mapping is checked
against the checkpoint headers: a missing tensor names the HF tensor and our path, a wrong
shape names both shapes, a tensor nothing consumes (and that is not known-ignorable, like a
rotary `inv_freq`) is named too. Then tensors are read one by one, memory-mapped, converted
to our layout and the leaf's dtype, and put on the device. Split over devices (a
`placement`, loader/targets.py), each leaf is built shard by shard instead: every device of
this process gets the part of the leaf it holds, read as the matching part of the HF tensor
(our layouts are transposes of HF's, so a part of ours is a part of theirs) and cast on the
host; no tensor of a split leaf is ever read whole.

HF key prefixes, as transformers 5.24 writes them: Llama / Qwen3 use `model.` (decoder
layers `model.layers.{i}.self_attn|mlp.*`, `model.embed_tokens`, `model.norm`); Mamba2 and
NemotronH use `backbone.` (`backbone.embeddings`, `backbone.layers.{i}.norm|mixer.*`,
`backbone.norm_f`; NemotronH's module is `model` but it is saved as `backbone`, so `model.`
is accepted as well). `lm_head.weight` is top level and absent when embeddings are tied.

NemotronH MTP tensors follow vLLM's nemotron_h_mtp naming: module k of pattern length L owns
flat layers `mtp.layers.{k*L + j}`; the first holds `enorm`, `hnorm` and `eh_proj`, the last
`final_layernorm`, and each holds `norm` plus `mixer.*` like a backbone layer. The MTP modules
share the backbone's embedding and `lm_head`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from metrale_jax.config import ModelConfig
from metrale_jax.loader.hf_config import (LLAMA, MAMBA2, NEMOTRON_H, QWEN3, architecture_of,
                                          model_config_from_hf, read_hf_config)
from metrale_jax.loader.targets import Placement, StatePath, param_shardings, plain_path
from metrale_jax.model.hybrid import HybridLM

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtypes numpy cannot build; `safe_open(framework="numpy")` refuses them.
_EXTRA_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
                 "F8_E5M2": ml_dtypes.float8_e5m2}
# Every safetensors dtype, for reading parts of tensors straight from the memory map.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
           **_EXTRA_DTYPES}
# Tensors a checkpoint may carry that no model parameter corresponds to.
_IGNORABLE = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"),)
_MTP_PREFIX = "mtp."


# ---- reading safetensors ------------------------------------------------------------------

def safetensors_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> shard file: from the index when sharded, else from every file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files and no {INDEX_FILE}")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            names.update((name, file) for name in f.keys())
    return names


class SafetensorsReader(contextlib.AbstractContextManager):
    """Memory-mapped access to a (sharded) checkpoint; shards stay open while in use."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.files = safetensors_files(self.model_dir)
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}
        self._maps: dict[Path, tuple[dict, np.memmap]] = {}

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._maps.clear()

    def names(self) -> set[str]:
        return set(self.files)

    def _handle(self, name: str) -> Any:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(file, framework="numpy"))
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        dtype = self._handle(name).get_slice(name).get_dtype()
        if dtype in _EXTRA_DTYPES:
            return _read_raw(self.files[name], name, _EXTRA_DTYPES[dtype])
        return self._handle(name).get_tensor(name)

    def part(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """`tensor[index]` (HF layout), a view of the memory-mapped file: copying it reads
        the bytes of that part only, whatever the tensor's size."""
        return self._view(name)[index]

    def _view(self, name: str) -> np.ndarray:
        """The whole tensor as a view of its file's memory map; nothing is read yet."""
        file = self.files[name]
        if file not in self._maps:
            self._maps[file] = _map_file(file)
        header, data = self._maps[file]
        entry = header[name]
        start, end = entry["data_offsets"]
        return data[start:end].view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _map_file(file: Path) -> tuple[dict, np.memmap]:
    """A safetensors file's header and its data section, memory-mapped: u64 header length,
    JSON header, then the tensors' bytes (little-endian, C order)."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
    return header, data


def _read_raw(file: Path, name: str, dtype: Any) -> np.ndarray:
    """One tensor sliced from the file itself: u64 header length, JSON header, data."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(header_len))[name]
    start, end = entry["data_offsets"]
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len + start,
                     shape=(end - start,))
    return data.view(dtype).reshape(entry["shape"])


# ---- naming: our leaf -> HF tensor ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorRule:
    path: StatePath         # our state path
    names: tuple[str, ...]  # accepted HF names (aliases), the first present one is used
    layout: str             # "same", "linear" (HF [out, in]) or "conv" (HF [C, 1, K])

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor shape that maps onto a leaf of shape `ours`."""
        if self.layout == "linear":
            return tuple(reversed(ours))
        if self.layout == "conv":
            k, c = ours
            return (c, 1, k)
        return tuple(ours)

    def to_ours(self, x: np.ndarray) -> np.ndarray:
        if self.layout == "linear":
            return x.T
        if self.layout == "conv":
            return x[:, 0, :].T
        return x

    def hf_index(self, ours: tuple[slice, ...]) -> tuple[slice, ...]:
        """The part of the HF tensor that `to_ours` turns into part `ours` of our leaf:
        `to_ours(x[hf_index(i)]) == to_ours(x)[i]`, every layout being a transpose."""
        if self.layout == "linear":
            rows, cols = ours
            return (cols, rows)
        if self.layout == "conv":
            k, c = ours
            return (c, slice(None), k)
        return tuple(ours)


def _leaf_rule(path: StatePath, rest: tuple, prefixes: tuple[str, ...]) -> TensorRule:
    """A leaf inside a mixer (or a norm/projection of an MTP module) under `prefixes`."""
    def rule(suffix: str, layout: str = "same") -> TensorRule:
        return TensorRule(path, tuple(p + suffix for p in prefixes), layout)

    if len(rest) == 2 and rest[1] == "kernel":
        return rule(f"{rest[0]}.weight", "linear")
    if len(rest) == 2 and rest[1] == "bias":
        return rule(f"{rest[0]}.bias")
    if len(rest) == 2 and rest[1] == "scale":  # RMSNorm weights (q_norm, gated norm, ...)
        return rule(f"{rest[0]}.weight")
    single = {"conv_weight": ("conv1d.weight", "conv"), "conv_bias": ("conv1d.bias", "same"),
              "a_log": ("A_log", "same"), "dt_bias": ("dt_bias", "same"), "d_skip": ("D", "same")}
    if len(rest) == 1 and rest[0] in single:
        return rule(*single[rest[0]])
    raise ValueError(f"no HF name is known for our parameter {_fmt(path)}")


def _base_prefixes(arch: str, names: set[str]) -> tuple[str, ...]:
    """The backbone prefix this checkpoint uses (first the one most keys carry)."""
    candidates = ("model.",) if arch in (LLAMA, QWEN3) else ("backbone.", "model.")
    return tuple(sorted(candidates, key=lambda p: -sum(n.startswith(p) for n in names)))


def hf_rules(cfg: ModelConfig, arch: str, paths: Iterable[StatePath], names: set[str],
             ) -> list[TensorRule]:
    """One rule per leaf of our state."""
    bases = _base_prefixes(arch, names)
    transformer = arch in (LLAMA, QWEN3)

    def under(*suffixes: str) -> tuple[str, ...]:
        return tuple(b + s for b in bases for s in suffixes)

    rules = []
    for path in paths:
        head = path[0]
        if head == "embed":
            names_ = under("embed_tokens.weight") if transformer else under(
                "embeddings.weight", "embedding.weight")
            rules.append(TensorRule(path, names_, "same"))
        elif head == "final_norm":
            rules.append(TensorRule(path, under("norm.weight" if transformer else "norm_f.weight"),
                                    "same"))
        elif head == "lm_head":
            rules.append(TensorRule(path, ("lm_head.weight",), "linear"))
        elif head == "blocks":
            i, part, rest = path[1], path[2], path[3:]
            kind = cfg.layer_pattern[i]
            if transformer:  # block 2l is layer l's attention, block 2l+1 its MLP
                layer = f"layers.{i // 2}."
                if part == "norm":
                    norm = "input_layernorm" if kind == "A" else "post_attention_layernorm"
                    rules.append(TensorRule(path, under(f"{layer}{norm}.weight"), "same"))
                else:
                    mixer = "self_attn." if kind == "A" else "mlp."
                    rules.append(_leaf_rule(path, rest, under(layer + mixer)))
            elif part == "norm":
                rules.append(TensorRule(path, under(f"layers.{i}.norm.weight"), "same"))
            else:
                rules.append(_leaf_rule(path, rest, under(f"layers.{i}.mixer.")))
        elif head == "mtp":
            rules.append(_mtp_rule(cfg, path))
        else:
            raise ValueError(f"no HF name is known for our parameter {_fmt(path)}")
    return rules


def _mtp_rule(cfg: ModelConfig, path: StatePath) -> TensorRule:
    k, part = path[1], path[2]
    n = len(cfg.mtp_pattern)
    first, last = f"{_MTP_PREFIX}layers.{k * n}.", f"{_MTP_PREFIX}layers.{k * n + n - 1}."
    if part in ("enorm", "hnorm", "eh_proj"):
        return _leaf_rule(path, path[2:], (first,))
    if part == "norm":
        return TensorRule(path, (last + "final_layernorm.weight",), "same")
    j, sub, rest = path[3], path[4], path[5:]
    layer = f"{_MTP_PREFIX}layers.{k * n + j}."
    if sub == "norm":
        return TensorRule(path, (layer + "norm.weight",), "same")
    return _leaf_rule(path, rest, (layer + "mixer.",))


# ---- loading ----------------------------------------------------------------------------

def _fmt(path: StatePath) -> str:
    return ".".join(map(str, path))


def _listing(items: list[str], limit: int = 12) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


def _ignorable(name: str, cfg: ModelConfig, arch: str) -> bool:
    if any(p.search(name) for p in _IGNORABLE):
        return True
    # transformers itself ignores NemotronH MTP tensors; we do when the config has no MTP.
    return arch == NEMOTRON_H and cfg.num_mtp_modules == 0 and name.startswith(_MTP_PREFIX)


def _resolve(rules: list[TensorRule], leaves: dict[StatePath, jax.ShapeDtypeStruct],
             reader: SafetensorsReader, cfg: ModelConfig, arch: str) -> dict[StatePath, str]:
    """Pick each rule's HF tensor and check names and shapes before reading any data."""
    available = reader.names()
    chosen, missing, wrong = {}, [], []
    for rule in rules:
        name = next((n for n in rule.names if n in available), None)
        if name is None:
            missing.append(f"{rule.names[0]!r} (for our {_fmt(rule.path)})")
            continue
        chosen[rule.path] = name
        want, have = rule.hf_shape(leaves[rule.path].shape), reader.shape(name)
        if want != have:
            wrong.append(f"{name!r} has shape {have}, expected {want} (for our "
                         f"{_fmt(rule.path)} of shape {tuple(leaves[rule.path].shape)})")
    where = reader.model_dir
    if missing:
        raise ValueError(f"{where}: checkpoint lacks tensors the {arch} model needs: "
                         f"{_listing(missing)}")
    if wrong:
        raise ValueError(f"{where}: tensors with the wrong shape: {_listing(wrong)}")
    used = set(chosen.values())
    extra = sorted(n for n in available - used if not _ignorable(n, cfg, arch)
                   and not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    if extra:
        raise ValueError(f"{where}: unexpected tensors the {arch} model does not use: "
                         f"{_listing([repr(n) for n in extra])}")
    return chosen


def _check_tied_head(reader: SafetensorsReader, name: str, embedding: np.ndarray,
                     index: tuple[slice, ...]) -> None:
    """A tied checkpoint may still store lm_head.weight; accept it only as a copy. Compared
    part by part: `embedding` is part `index` (HF layout) of tensor `name`."""
    if "lm_head.weight" not in reader.names():
        return
    if reader.shape("lm_head.weight") != reader.shape(name) or \
            not np.array_equal(reader.part("lm_head.weight", index), embedding):
        raise ValueError(f"{reader.model_dir}: tie_word_embeddings is true but lm_head.weight "
                         "differs from the input embedding")


def _set(tree: dict, path: StatePath, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def load_hf_weights(model_dir: str | Path, cfg: ModelConfig, arch: str, *,
                    progress: bool = True, placement: Placement | None = None) -> HybridLM:
    """Fill a `HybridLM(cfg)` from the safetensors checkpoint in `model_dir`: each leaf
    whole on the default device or, with a `placement` (loader/targets.py), on its
    sharding, read part by part."""
    abstract = nnx.eval_shape(lambda: HybridLM(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    flat, _ = jax.tree_util.tree_flatten_with_path(pure)
    leaves = {plain_path(path): leaf for path, leaf in flat}
    shardings = param_shardings(placement, cfg, flat)
    with SafetensorsReader(model_dir) as reader:
        rules = hf_rules(cfg, arch, sorted(leaves, key=_fmt), reader.names())
        chosen = _resolve(rules, leaves, reader, cfg, arch)
        for rule in tqdm(rules, desc=f"loading {Path(model_dir).name}", unit="tensor",
                         disable=not progress):
            tied = rule.path == ("embed", "embedding") and cfg.tie_word_embeddings
            read = _read_whole if shardings is None else functools.partial(
                _read_sharded, sharding=shardings[rule.path])
            _set(pure, rule.path, read(reader, rule, chosen[rule.path], leaves[rule.path],
                                       tied=tied))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _read_whole(reader: SafetensorsReader, rule: TensorRule, name: str,
                leaf: jax.ShapeDtypeStruct, *, tied: bool) -> jax.Array:
    """The single-device path: the tensor whole, converted, onto the default device."""
    raw = reader.read(name)
    if tied:
        _check_tied_head(reader, name, raw, (slice(None),) * raw.ndim)
    value = np.asarray(rule.to_ours(raw)).astype(leaf.dtype, copy=False)
    return jnp.asarray(value)


def _read_sharded(reader: SafetensorsReader, rule: TensorRule, name: str,
                  leaf: jax.ShapeDtypeStruct, *, tied: bool,
                  sharding: jax.sharding.Sharding) -> jax.Array:
    """One leaf built on `sharding`, each of this process's devices from its own part:
    that part of our layout is the same part of the HF tensor transposed
    (`TensorRule.hf_index`), read from the memory map and cast to the leaf's dtype there.
    No device, and no host buffer, ever holds more of a split leaf than one shard."""
    def shard(index: tuple[slice, ...]) -> np.ndarray:
        hf_index = rule.hf_index(index)
        raw = reader.part(name, hf_index)
        if tied:
            _check_tied_head(reader, name, raw, hf_index)
        # One copy: out of the map, into our layout and dtype at once.
        return np.array(rule.to_ours(raw), dtype=leaf.dtype, order="C")

    return jax.make_array_from_callback(leaf.shape, sharding, shard, dtype=leaf.dtype)


def load_hf_model(model_dir: str | Path, *, dtype: str | None = None, progress: bool = True,
                  placement: Placement | None = None) -> tuple[HybridLM, ModelConfig]:
    """A Hugging Face directory (config.json + safetensors) -> our model and config;
    `placement`: load each parameter straight onto its shards (loader/targets.py)."""
    model_dir = Path(model_dir)
    hf = read_hf_config(model_dir)
    arch = architecture_of(hf)
    names = safetensors_files(model_dir)
    has_mtp = any(n.startswith(_MTP_PREFIX) for n in names)
    cfg = model_config_from_hf(hf, has_mtp_weights=has_mtp, dtype=dtype)
    return load_hf_weights(model_dir, cfg, arch, progress=progress,
                           placement=placement), cfg
