"""Which projections of our model take an adapter, and what PEFT calls them.

A target is named by its path in our module tree, `blocks.{i}.mixer.{projection}`: block `i`
of `ModelConfig.layer_pattern` (the backbone's; MTP modules take no adapter). Each block kind
has its own projections:

  A (attention)  q_proj, k_proj, v_proj, o_proj
  F (MLP)        gate_proj (gated SiLU only), up_proj, down_proj
  M (Mamba2)     in_proj (to [z, xBC, dt]), out_proj

Our projections are HF's, one to one: nothing is fused or split (a Llama layer is our
blocks 2l and 2l+1; a NemotronH layer i is our block i), so an adapter on one HF projection is
an adapter on one of ours with the same A and B, transposed into our `[in, out]` layout.

This module is host only (no jax): the registry may list targets without the device.
"""

from __future__ import annotations

import dataclasses
import re

from metrale_jax.config import ModelConfig
from metrale_jax.lora.weights import LoraError


@dataclasses.dataclass(frozen=True)
class Target:
    path: str      # "blocks.3.mixer.q_proj"
    d_in: int      # the projection's input width (A is [d_in, r])
    d_out: int     # its output width (B is [r, d_out])


def block_targets(cfg: ModelConfig, kind: str) -> dict[str, tuple[int, int]]:
    """The projections of one block kind: name -> (in, out)."""
    d = cfg.hidden_size
    if kind == "A":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
    if kind == "M":
        proj = cfg.mamba_inner + cfg.conv_dim + cfg.mamba_num_heads
        return {"in_proj": (d, proj), "out_proj": (cfg.mamba_inner, d)}
    f = cfg.intermediate_size
    mlp = {"up_proj": (d, f), "down_proj": (f, d)}
    return {"gate_proj": (d, f), **mlp} if cfg.mlp_kind == "gated_silu" else mlp


def target_path(block: int, name: str) -> str:
    return f"blocks.{block}.mixer.{name}"


def model_targets(cfg: ModelConfig) -> dict[str, Target]:
    """Every projection of the backbone that can take an adapter, by path, in block order."""
    out = {}
    for i, kind in enumerate(cfg.layer_pattern):
        for name, (d_in, d_out) in block_targets(cfg, kind).items():
            path = target_path(i, name)
            out[path] = Target(path, d_in, d_out)
    return out


@dataclasses.dataclass(frozen=True)
class TargetGroup:
    """Targets of one block that read the same input, adapted by one fused matmul pair."""

    path: str                        # "blocks.3.mixer.qkv"
    d_in: int                        # the shared input width
    members: tuple[Target, ...]      # in output-column order

    @property
    def d_out(self) -> int:
        return sum(t.d_out for t in self.members)


# Projections of one block kind that read one input (the step applies their adapters with one
# `x @ A` and one `@ B` per group: on XLA:CPU every small matmul costs ~40us however small).
_GROUPS = {"A": {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",)},
           "F": {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)},
           "M": {"in": ("in_proj",), "out": ("out_proj",)}}


def model_groups(cfg: ModelConfig) -> dict[str, TargetGroup]:
    """Every target of `model_targets`, in groups of one block sharing an input, by path."""
    targets, out = model_targets(cfg), {}
    for i, kind in enumerate(cfg.layer_pattern):
        for group, names in _GROUPS[kind].items():
            members = tuple(targets[target_path(i, n)] for n in names
                            if target_path(i, n) in targets)
            if members:
                path = target_path(i, group)
                out[path] = TargetGroup(path, members[0].d_in, members)
    return out


def target_paths(cfg: ModelConfig) -> list[str]:
    """The keys `LoraWeights.targets` may use, in a fixed order."""
    return list(model_targets(cfg))


# ---- PEFT / HF module names -> ours -----------------------------------------------------

# PEFT prefixes every module with "base_model.model."; then HF's own module path. Llama and
# Qwen3 spell `model.layers.{l}.self_attn|mlp.*`; Mamba2 and NemotronH
# `backbone|model.layers.{i}.mixer.*` (NemotronH's module is `model`, saved as `backbone`).
_PEFT_PREFIX = "base_model.model."
_LAYER = re.compile(r"^(?:model|backbone)\.layers\.(\d+)\.(self_attn|mlp|mixer)\.([A-Za-z_0-9]+)$")
# Modules PEFT can target that we refuse, with why.
_REFUSED = {
    "embed_tokens": "embedding adapters are not supported",
    "embeddings": "embedding adapters are not supported",
    "embedding": "embedding adapters are not supported",
    "lm_head": "lm_head adapters are not supported",
}


def strip_peft_prefix(module: str) -> str:
    return module[len(_PEFT_PREFIX):] if module.startswith(_PEFT_PREFIX) else module


def our_target(cfg: ModelConfig, hf_module: str, adapter: str = "") -> str:
    """Our target path for a PEFT/HF module name (with or without PEFT's prefix), e.g.
    `model.layers.3.self_attn.q_proj` -> `blocks.6.mixer.q_proj` for a Llama,
    `backbone.layers.3.mixer.in_proj` -> `blocks.3.mixer.in_proj` for a NemotronH.
    Raises `LoraError` naming the adapter when the module is no target of this model."""
    module = strip_peft_prefix(hf_module)
    where = f"LoRA adapter {adapter!r}: module {hf_module!r}"
    last = module.rsplit(".", 1)[-1]
    if last in _REFUSED:
        raise LoraError(f"{where}: {_REFUSED[last]}")
    if module.startswith("mtp."):
        raise LoraError(f"{where}: MTP modules take no adapter")
    match = _LAYER.match(module)
    if match is None:
        raise LoraError(f"{where}: not a projection this model can adapt (expected "
                        "model.layers.N.self_attn|mlp.* or backbone.layers.N.mixer.*)")
    layer, part, name = int(match[1]), match[2], match[3]
    if part == "mixer":
        block = layer
    else:  # a transformer layer l is our attention block 2l and MLP block 2l+1
        if cfg.layer_pattern != "AF" * (len(cfg.layer_pattern) // 2):
            raise LoraError(f"{where}: a transformer layer name, but this model's layers are "
                            f"{cfg.layer_pattern!r}")
        block = 2 * layer + (part == "mlp")
    if block >= len(cfg.layer_pattern):
        raise LoraError(f"{where}: layer {layer} does not exist (the model has "
                        f"{len(cfg.layer_pattern)} blocks)")
    kind = cfg.layer_pattern[block]
    names = block_targets(cfg, kind)
    if name not in names:
        raise LoraError(f"{where}: {kind!r} block {block} has no projection {name!r} "
                        f"(it has {', '.join(names)})")
    return target_path(block, name)
