"""Our orbax checkpoint format: round trips exactly, and `load_model` tells the formats apart."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.loader import is_metrale_checkpoint, load_checkpoint, load_model, save_checkpoint
from metrale_jax.loader.checkpoint import CONFIG_FILE, config_from_json, config_to_json
from metrale_jax.model import HybridLM, allocate_caches
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch

# Every block kind, GQA, llama3 RoPE (a tuple field), an infinite float, an MTP module and
# more than ten blocks (list indices that sort differently as strings).
CFG = ModelConfig(
    vocab_size=200, hidden_size=32, layer_pattern="MAF" * 4, num_heads=4, num_kv_heads=2,
    head_dim=8, rope_scaling="llama3", rope_scaling_args=(8.0, 1.0, 4.0, 16.0),
    intermediate_size=48, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8,
    mamba_groups=2, mamba_norm_groups=2, mamba_chunk_size=4, time_step_min=1e-3,
    num_mtp_modules=1, max_position_embeddings=64)


def _leaves(model: HybridLM) -> dict:
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model))}


@nnx.jit
def _forward(model: HybridLM, batch, caches):
    hidden, _ = model(batch, caches)
    return model.logits(hidden)


def _logits(model: HybridLM) -> np.ndarray:
    batch = build_step_batch([RowChunk(list(range(3, 12)), 0, [3, 1, 2], 1)],
                             StepShape(tokens=16, rows=1, query_len=16, max_blocks=4), 4)
    caches = allocate_caches(model.cfg, num_blocks=5, block_size=4, num_slots=2)
    return np.asarray(_forward(model, batch, caches))


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_exact(tmp_path, tied):
    cfg = CFG.replace(tie_word_embeddings=tied)
    model = HybridLM(cfg, nnx.Rngs(7))
    save_checkpoint(model, tmp_path / "ckpt")
    assert is_metrale_checkpoint(tmp_path / "ckpt")
    restored = load_checkpoint(tmp_path / "ckpt")
    assert restored.cfg == cfg
    a, b = _leaves(model), _leaves(restored)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    np.testing.assert_array_equal(_logits(model), _logits(restored))


def test_save_overwrites_and_load_model_detects_format(tmp_path):
    path = tmp_path / "ckpt"
    save_checkpoint(HybridLM(CFG, nnx.Rngs(1)), path)
    model = HybridLM(CFG, nnx.Rngs(2))
    save_checkpoint(model, path)  # replaces the first one
    loaded, cfg = load_model(path)
    assert cfg == CFG
    np.testing.assert_array_equal(loaded.embed.embedding[...], model.embed.embedding[...])
    # A file inside the directory names the directory.
    loaded, _ = load_model(path / CONFIG_FILE)
    np.testing.assert_array_equal(loaded.embed.embedding[...], model.embed.embedding[...])
    with pytest.raises(ValueError, match="dtype"):
        load_model(path, dtype="bfloat16")


def test_bfloat16_round_trip(tmp_path):
    cfg = CFG.replace(dtype="bfloat16", num_mtp_modules=0)
    model = HybridLM(cfg, nnx.Rngs(3))
    save_checkpoint(model, tmp_path)
    restored = load_checkpoint(tmp_path)
    assert restored.embed.embedding[...].dtype == jax.numpy.bfloat16
    a, b = _leaves(model), _leaves(restored)
    assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_config_json_is_strict_and_round_trips():
    data = config_to_json(CFG)
    text = json.dumps(data, allow_nan=False)  # strict JSON: no bare Infinity
    back = config_from_json(json.loads(text))
    assert back == CFG and math.isinf(back.time_step_max)
    assert isinstance(back.rope_scaling_args, tuple)
    with pytest.raises(ValueError, match="not_a_field"):
        config_from_json({**data, "not_a_field": 1})
