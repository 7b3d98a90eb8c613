"""PEFT adapter directories -> `LoraWeights`.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are `base_model.model.<HF module>.lora_A.weight [r, in]` and `.lora_B.weight [out, r]`;
the module's output gains `x @ A.T @ B.T * scaling`, scaling = alpha / r (alpha / sqrt(r) with
rsLoRA). The tensors say which modules are adapted (so `target_modules` and
`layers_to_transform` need no matching of ours); the config gives alpha and the per-module
rank/alpha overrides (`rank_pattern`, `alpha_pattern`). A module whose scaling differs from
the adapter's (an alpha or rank override) has the ratio folded into its B, so one
`LoraWeights.scaling` holds for every target.

Refused, each with a `LoraError` naming the adapter and the reason: DoRA, embedding and
lm_head targets, `modules_to_save`, trained biases, ranks above `max_lora_rank`, modules that
are no target of our model, tensors whose shapes do not match it, missing files. Host only.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

from metrale_jax.config import ModelConfig
from metrale_jax.lora.config import LoraConfig
from metrale_jax.lora.targets import model_targets, our_target, strip_peft_prefix
from metrale_jax.lora.weights import LoraError, LoraWeights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def load_peft_adapter(path: str | Path, model_config: ModelConfig, lora_config: LoraConfig,
                      name: str) -> LoraWeights:
    """Read the PEFT LoRA adapter in directory `path` for a model of `model_config`."""
    path = Path(path)
    config = _read_config(path, name)
    _check_config(config, name)
    tensors = _read_tensors(path, name)
    pairs = _pair_tensors(tensors, name)
    r = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", r))
    rs = bool(config.get("use_rslora", False))
    scaling = _scaling(alpha, r, rs)
    targets = model_targets(model_config)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, (a, b) in sorted(pairs.items()):
        path_ = our_target(model_config, module, name)
        if path_ in out:
            raise LoraError(f"LoRA adapter {name!r}: two modules map to our {path_}")
        rank = a.shape[0]
        if rank > lora_config.max_lora_rank:
            raise LoraError(f"LoRA adapter {name!r}: rank {rank} of {module} exceeds "
                            f"max_lora_rank {lora_config.max_lora_rank}")
        t = targets[path_]
        if a.shape != (rank, t.d_in) or b.shape != (t.d_out, rank):
            raise LoraError(
                f"LoRA adapter {name!r}: {module} has lora_A {a.shape} and lora_B {b.shape}; "
                f"the base model's projection needs [{rank}, {t.d_in}] and [{t.d_out}, {rank}] "
                "(an adapter for another base model?)")
        module_alpha = _pattern(config.get("alpha_pattern"), module, alpha)
        module_scaling = _scaling(float(module_alpha), rank, rs)
        b_ours = b.T.astype(np.float32) * np.float32(module_scaling / scaling)
        out[path_] = (np.ascontiguousarray(a.T.astype(np.float32)), b_ours)
    if not out:
        raise LoraError(f"LoRA adapter {name!r}: {path / WEIGHTS_FILE} holds no LoRA tensors")
    return LoraWeights(name=name, rank=max(a.shape[1] for a, _ in out.values()),
                       scaling=scaling, targets=out)


def _scaling(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def _pattern(patterns: dict | None, module: str, default):
    """PEFT's `rank_pattern`/`alpha_pattern`: the first key that matches the end of the
    module name (as a regex, at a dot boundary) gives its value."""
    key = strip_peft_prefix(module)
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _read_config(path: Path, name: str) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {file} not found")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {file}: {err}") from err


def _check_config(config: dict, name: str) -> None:
    def refuse(why: str) -> None:
        raise LoraError(f"LoRA adapter {name!r}: {why}")

    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        refuse(f"peft_type {peft_type!r} is not LoRA")
    if config.get("use_dora"):
        refuse("DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        refuse(f"modules_to_save {config['modules_to_save']} is not supported (only LoRA "
               "A/B weights are applied)")
    if config.get("bias", "none") != "none":
        refuse(f"bias {config['bias']!r} is not supported (only bias='none')")
    if config.get("target_parameters"):
        refuse("target_parameters is not supported")
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for bad in ("embed_tokens", "embeddings", "lm_head"):
        if any(n == bad or (isinstance(targets, str) and re.search(bad, n)) for n in names):
            refuse(f"target_modules names {bad!r}: embedding and lm_head adapters are not "
                   "supported")
    for key in ("trainable_token_indices", "layer_replication"):
        if config.get(key):
            refuse(f"{key} is not supported")


def _read_tensors(path: Path, name: str) -> dict[str, np.ndarray]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        legacy = path / "adapter_model.bin"
        hint = " (only safetensors is read, not adapter_model.bin)" if legacy.exists() else ""
        raise LoraError(f"LoRA adapter {name!r}: {file} not found{hint}")
    try:
        return _load(file)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise LoraError(f"LoRA adapter {name!r}: cannot read {file}: {err}") from err


# Adapters trained in bfloat16 are saved so; numpy has no such dtype, ml_dtypes does.
_EXTRA_DTYPES = {"BF16": ml_dtypes.bfloat16}
_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _load(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a small safetensors file; bfloat16 ones read from the raw bytes
    (u64 header length, JSON header, data)."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    if not any(v.get("dtype") in _EXTRA_DTYPES for v in header.values() if isinstance(v, dict)):
        return load_file(file)
    data = np.fromfile(file, np.uint8, offset=8 + header_len)
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        dtype = _EXTRA_DTYPES.get(entry["dtype"]) or _NUMPY[entry["dtype"]]
        out[key] = data[start:end].view(dtype).reshape(entry["shape"]).astype(np.float32)
    return out


def _pair_tensors(tensors: dict[str, np.ndarray], name: str,
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module -> (lora_A [r, in], lora_B [out, r]); anything else in the file is refused."""
    found: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        if "lora_magnitude_vector" in key:
            raise LoraError(f"LoRA adapter {name!r}: DoRA magnitude {key!r} is not supported")
        if "lora_embedding_" in key:
            raise LoraError(f"LoRA adapter {name!r}: embedding adapter {key!r} is not supported")
        match = _TENSOR.match(key)
        if match is None:
            raise LoraError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight "
                            "(biases and saved modules are not supported)")
        found.setdefault(match["module"], {})[match["ab"]] = value
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: {module} lacks lora_"
                            f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"LoRA adapter {name!r}: {module} has lora_A {a.shape} and "
                            f"lora_B {b.shape}, not a [r, in] / [out, r] pair")
        pairs[module] = (a, b)
    return pairs
