"""HF `config.json` -> `ModelConfig` for the architectures we run.

Supported: LlamaForCausalLM, Qwen3ForCausalLM, Mamba2ForCausalLM, NemotronHForCausalLM.
Anything we would compute differently from transformers (an unknown architecture, a RoPE
type we do not implement, biases, sliding windows, MoE layers, other activations) is a
`ValueError` naming the architecture or the config field, never a silent approximation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metrale_jax.config import ModelConfig

LLAMA, QWEN3, MAMBA2, NEMOTRON_H = (
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Mamba2ForCausalLM", "NemotronHForCausalLM")
SUPPORTED_ARCHITECTURES = (LLAMA, QWEN3, MAMBA2, NEMOTRON_H)
_ARCH_BY_MODEL_TYPE = {"llama": LLAMA, "qwen3": QWEN3, "mamba2": MAMBA2, "nemotron_h": NEMOTRON_H}
_DTYPES = ("float32", "bfloat16", "float16")

# NemotronH layer types (transformers 5 names, the legacy names, and the pattern characters
# of `hybrid_override_pattern`) -> our block kinds. MoE has no block kind: it is refused.
_NEMOTRON_BLOCKS = {"linear_attention": "M", "mamba": "M", "M": "M",
                    "full_attention": "A", "attention": "A", "*": "A",
                    "mlp": "F", "-": "F"}
_NEMOTRON_MOE = ("moe", "E")


def _decode_floats(obj: Any) -> Any:
    """transformers 5 writes non-finite floats as {"__float__": "Infinity"}."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json, not a Hugging Face model directory")
    with open(path) as f:
        return _decode_floats(json.load(f))


def architecture_of(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        arch = _ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""), f"model_type={hf.get('model_type')!r}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architectures: {arch!r} is not supported; supported are "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _get(hf: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of several spellings that is present (configs renamed fields over time)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


def _refuse(arch: str, field: str, why: str) -> None:
    raise ValueError(f"{arch}: config field {field!r} {why}")


def _require_false(hf: Mapping[str, Any], arch: str, *fields: str) -> None:
    for field in fields:
        if hf.get(field):
            _refuse(arch, field, f"= {hf[field]!r} is not supported (only False)")


def _require_value(hf: Mapping[str, Any], arch: str, field: str, allowed: tuple, default: Any,
                   ) -> None:
    value = hf.get(field, default)
    if value not in allowed:
        _refuse(arch, field, f"= {value!r} is not supported (supported: {allowed})")


def _dtype(hf: Mapping[str, Any], override: str | None) -> str:
    if override is not None:
        return override
    saved = _get(hf, "dtype", "torch_dtype", default="float32")
    return saved if saved in _DTYPES else "float32"


def _rope(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """rope_theta / rope_scaling, from transformers 5 `rope_parameters` or the older fields."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type parameters; every layer is full here
    field = "rope_parameters"
    if not isinstance(params, Mapping):
        params = dict(hf.get("rope_scaling") or {})
        field = "rope_scaling"
        if "rope_theta" in hf:
            params.setdefault("rope_theta", hf["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse(arch, "partial_rotary_factor", f"= {partial} is not supported (only 1.0)")
    if rope_type == "default":
        return dict(rope_theta=theta, rope_scaling="none", rope_scaling_args=())
    if rope_type == "linear":
        return dict(rope_theta=theta, rope_scaling="linear",
                    rope_scaling_args=(float(params["factor"]),))
    if rope_type == "llama3":
        return dict(rope_theta=theta, rope_scaling="llama3", rope_scaling_args=(
            float(params["factor"]), float(params["low_freq_factor"]),
            float(params["high_freq_factor"]), float(params["original_max_position_embeddings"])))
    _refuse(arch, f"{field}.rope_type",
            f"= {rope_type!r} is not supported (supported: default, linear, llama3)")
    raise AssertionError  # unreachable: _refuse raises


def _attention_fields(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    kv_heads = _get(hf, "num_key_value_heads", default=heads)
    head_dim = _get(hf, "head_dim", "attention_head_dim", default=hf["hidden_size"] // heads)
    return dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def _transformer(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """Llama and Qwen3: each decoder layer is attention then gated-SiLU MLP ("AF")."""
    _require_value(hf, arch, "hidden_act", ("silu",), "silu")
    # (NemotronH's attention has no bias whatever attention_bias says, so only checked here.)
    _require_false(hf, arch, "attention_bias", "mlp_bias")
    if arch == QWEN3:
        _require_false(hf, arch, "use_sliding_window")
        types = set(hf.get("layer_types") or ["full_attention"])
        if types != {"full_attention"}:
            _refuse(arch, "layer_types", f"= {sorted(types)} is not supported (only full_attention)")
    else:
        _require_false(hf, arch, "sliding_window")
    return dict(
        layer_pattern="AF" * hf["num_hidden_layers"],
        **_attention_fields(hf, arch),
        **_rope(hf, arch),
        qk_norm=arch == QWEN3,
        intermediate_size=hf["intermediate_size"],
        mlp_kind="gated_silu",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
    )


def _dt_limit(limit: Any) -> dict[str, float]:
    """A Mamba2 mixer's dt clamp, `time_step_limit` = (low, high), as our config fields."""
    low, high = limit
    return dict(time_step_min=float(low), time_step_max=float(high))


def _mamba_fields(hf: Mapping[str, Any], arch: str, heads: int, head_dim: int) -> dict[str, Any]:
    groups = _get(hf, "n_groups", "mamba_n_groups", default=1)
    return dict(
        ssm_state_size=_get(hf, "state_size", "ssm_state_size", default=128),
        conv_kernel=_get(hf, "conv_kernel", "mamba_d_conv", default=4),
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_groups=groups,
        # transformers' gated norm uses group_size = inner // n_groups, i.e. n_groups groups.
        mamba_norm_groups=groups,
        mamba_chunk_size=_get(hf, "chunk_size", "mamba_chunk_size", default=256),
        mamba_conv_bias=bool(_get(hf, "use_conv_bias", "mamba_conv_bias", default=True)),
        mamba_proj_bias=bool(hf.get("use_bias", False)),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )


def _mamba2(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    _require_value(hf, arch, "hidden_act", ("silu",), "silu")
    heads, head_dim = hf["num_heads"], hf["head_dim"]
    inner = int(hf.get("expand", 2) * hf["hidden_size"])
    if inner != heads * head_dim:
        _refuse(arch, "expand", f"* hidden_size = {inner} differs from num_heads * head_dim = "
                                f"{heads * head_dim}")
    # Mamba2 clamps dt into time_step_limit (time_step_min/max only shape the initialisation).
    return dict(
        layer_pattern="M" * hf["num_hidden_layers"],
        **_mamba_fields(hf, arch, heads, head_dim),
        **_dt_limit(hf.get("time_step_limit", (0.0, math.inf))),
        # A recurrent model has no position limit; the engine's max_seq_len governs.
        max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
    )


def _nemotron_pattern(types: list[str] | str, arch: str, field: str) -> str:
    pattern = ""
    for t in types:
        if t in _NEMOTRON_MOE:
            _refuse(arch, field, "contains MoE layers, which are not supported")
        if t not in _NEMOTRON_BLOCKS:
            _refuse(arch, field, f"contains unknown layer type {t!r}")
        pattern += _NEMOTRON_BLOCKS[t]
    return pattern


def _nemotron_h(hf: Mapping[str, Any], arch: str, has_mtp_weights: bool) -> dict[str, Any]:
    _require_value(hf, arch, "mlp_hidden_act", ("relu2",), "relu2")
    _require_value(hf, arch, "mamba_hidden_act", ("silu",), "silu")
    _require_false(hf, arch, "mlp_bias", "sliding_window")
    field = next((f for f in ("layers_block_type", "layer_types", "hybrid_override_pattern")
                  if hf.get(f)), None)
    if field is None:
        _refuse(arch, "layers_block_type", "is missing (nor layer_types / hybrid_override_pattern)")
    pattern = _nemotron_pattern(hf[field], arch, field)
    mtp = {}
    n_mtp = hf.get("num_nextn_predict_layers", 0) or 0
    # MTP weights are optional extras (transformers ignores `mtp.*`); use them when present.
    if n_mtp and has_mtp_weights:
        mtp_field = next((f for f in ("mtp_layers_block_type", "mtp_hybrid_override_pattern")
                          if hf.get(f)), "mtp_layers_block_type")
        mtp_pattern = _nemotron_pattern(hf.get(mtp_field) or ["full_attention", "moe"], arch,
                                        mtp_field)
        if "M" in mtp_pattern:
            _refuse(arch, mtp_field, "contains Mamba layers, which MTP modules cannot hold")
        mtp = dict(num_mtp_modules=n_mtp, mtp_pattern=mtp_pattern)
    return dict(
        layer_pattern=pattern,
        **_attention_fields(hf, arch),
        use_rope=False,  # NemotronH attention has no positional encoding
        intermediate_size=hf["intermediate_size"],
        mlp_kind="relu2",
        **_mamba_fields(hf, arch, hf["mamba_num_heads"], hf["mamba_head_dim"]),
        # dt is clamped into time_step_limit, as in Mamba2 and NVIDIA's own code (transformers
        # up to 5.24 clamped into (time_step_min, inf) instead; 5.25 follows the limit).
        **_dt_limit(_get(hf, "time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        **mtp,
    )


def model_config_from_hf(hf: Mapping[str, Any], *, has_mtp_weights: bool = False,
                         dtype: str | None = None) -> ModelConfig:
    """Map a parsed HF config to ours. `has_mtp_weights` says the checkpoint holds `mtp.*`
    tensors (NemotronH); `dtype` overrides the checkpoint's own dtype."""
    arch = architecture_of(hf)
    if arch in (LLAMA, QWEN3):
        fields = _transformer(hf, arch)
    elif arch == MAMBA2:
        fields = _mamba2(hf, arch)
    else:
        fields = _nemotron_h(hf, arch, has_mtp_weights)
    return ModelConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       dtype=_dtype(hf, dtype), **fields)
