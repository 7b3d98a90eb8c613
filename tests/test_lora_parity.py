"""PEFT LoRA adapters load and reproduce transformers + PEFT.

Each case makes an adapter with PEFT on a tiny random HF model (torch, CPU, float32), gives
every lora_A / lora_B random non-zero values (PEFT initialises B to zero, which would test
nothing), saves it, loads it with `load_peft_adapter` into a device slot and compares our
logits, over a prompt run as one ragged prefill beside a row on the base model, with the
PEFT model's. Then greedy decoding through the runner with the adapter equals the same base
model with the adapter merged (`merge_and_unload`) and loaded as a plain checkpoint; and
every PEFT configuration we refuse raises a `LoraError` that says why.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from safetensors.numpy import load_file, save_file

from metrale_jax.config import EngineConfig
from metrale_jax.loader import load_hf_model
from metrale_jax.lora import LoraConfig, LoraError
from metrale_jax.lora.peft import load_peft_adapter
from metrale_jax.lora.targets import our_target, target_paths
from metrale_jax.model import allocate_caches
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch
from metrale_jax.runner.lora_slots import allocate_lora_slots, slot_arrays, write_slot
from metrale_jax.runner.model_runner import ModelRunner
from metrale_jax.types import ScheduledRow
from tests.hf_models import save_tiny_llama, save_tiny_nemotronh

TOL = 1e-4
BLOCK = 4
LORA = LoraConfig(max_loras=2, max_lora_rank=16)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
NEMOTRON_LAYERS = ["linear_attention", "full_attention", "mlp", "linear_attention", "mlp"]

CASES = {
    "llama_attn": ("llama", dict(r=8, lora_alpha=16, target_modules=ATTN)),
    "llama_attn_mlp_rslora": ("llama", dict(r=16, lora_alpha=8, use_rslora=True,
                                            target_modules=ATTN + ["gate_proj", "up_proj",
                                                                   "down_proj"])),
    "llama_regex_layers_patterns": ("llama", dict(
        r=8, lora_alpha=16, target_modules=r".*\.(q_proj|v_proj|down_proj)",
        rank_pattern={"v_proj": 4}, alpha_pattern={"down_proj": 3.0})),
    "nemotronh_attn_mlp": ("nemotronh", dict(r=8, lora_alpha=16,
                                             target_modules=ATTN + ["up_proj", "down_proj"])),
    # PEFT refuses out_proj on Mamba models (its fused CUDA kernels read the weight), so
    # the out_proj adapters are added to the saved file by hand (`_add_out_proj`).
    "nemotronh_all_mamba": ("nemotronh", dict(
        r=16, lora_alpha=32, target_modules=ATTN + ["in_proj", "up_proj", "down_proj"],
        layers_to_transform=[0, 1, 3])),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    llama_dir = tmp_path_factory.mktemp("llama")
    nemo_dir = tmp_path_factory.mktemp("nemotronh")
    llama = save_tiny_llama(llama_dir)
    nemo = save_tiny_nemotronh(nemo_dir, intermediate_size=128, mamba_num_heads=8,
                               ssm_state_size=16, max_position_embeddings=256,
                               layers_block_type=NEMOTRON_LAYERS)
    return {"llama": (llama, llama_dir), "nemotronh": (nemo, nemo_dir)}


@pytest.fixture(scope="module")
def ours(bases) -> dict:
    return {k: load_hf_model(path, progress=False) for k, (_, path) in bases.items()}


def make_adapter(base: torch.nn.Module, out: Path, seed: int = 0, **config):
    """A PEFT adapter on a copy of `base` with random A and B, saved to `out`."""
    peft_model = get_peft_model(copy.deepcopy(base), PeftLoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    peft_model.eval()
    peft_model.save_pretrained(out)
    if "in_proj" in config["target_modules"]:
        _add_out_proj(peft_model, out, config, gen)
    return peft_model


def _add_out_proj(peft_model, out: Path, config: dict, gen: torch.Generator) -> None:
    """LoRA on each Mamba2 out_proj of the adapted layers: written into the saved adapter,
    and into the PEFT model as what LoRA on a linear layer is, W + scaling * B @ A."""
    file = out / "adapter_model.safetensors"
    tensors = load_file(file)
    r, scaling = config["r"], config["lora_alpha"] / config["r"]
    for name, module in peft_model.named_modules():
        if not name.endswith("mixer.out_proj"):
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        if layer not in config["layers_to_transform"]:
            continue
        a = 0.1 * torch.randn((r, module.in_features), generator=gen)
        b = 0.1 * torch.randn((module.out_features, r), generator=gen)
        key = name[:-len("out_proj")]  # PEFT's own prefix, base_model.model.
        tensors[f"{key}out_proj.lora_A.weight"] = a.numpy()
        tensors[f"{key}out_proj.lora_B.weight"] = b.numpy()
        with torch.no_grad():
            module.weight.add_(scaling * b @ a)
    save_file(tensors, file)


def _logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _forward(model, cfg, rows: list[RowChunk], slots) -> np.ndarray:
    """Our logits for every token of one prefill step of `rows` (each on its adapter)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, batch, caches, slots):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(batch, caches, slots.inputs(batch.adapter_slots[batch.token_row]))
        return m.logits(hidden)

    caches = allocate_caches(cfg, num_blocks=16, block_size=BLOCK, num_slots=4)
    batch = build_step_batch(rows, StepShape(tokens=32, rows=2, query_len=16, max_blocks=8),
                             BLOCK)
    return np.asarray(step(state, batch, caches, slots))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_peft(case, bases, ours, tmp_path):
    arch, config = CASES[case]
    base, _ = bases[arch]
    model, cfg = ours[arch]
    peft_model = make_adapter(base, tmp_path / "adapter", **config)
    weights = load_peft_adapter(tmp_path / "adapter", cfg, LORA, case)
    if "layers_to_transform" in config:
        assert {p.split(".")[1] for p in weights.targets} == {"0", "1", "3"}

    slots = allocate_lora_slots(cfg, LORA)
    slots = write_slot(slots, np.int32(0), *slot_arrays(cfg, LORA, weights))  # slot 1
    rng = np.random.RandomState(0)
    prompt = rng.randint(0, cfg.vocab_size, 11).tolist()
    other = rng.randint(0, cfg.vocab_size, 5).tolist()
    rows = [RowChunk(prompt, 0, [3, 1, 5], 1, adapter_slot=1),
            RowChunk(other, 0, [2, 4], 2, adapter_slot=0)]
    logits = _forward(model, cfg, rows, slots)
    np.testing.assert_allclose(logits[:11], _logits(peft_model, prompt), atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[11:16], _logits(base, other), atol=TOL, rtol=0)
    # The adapter changes the output: the comparison above is not the base model's.
    assert np.abs(logits[:11] - _logits(base, prompt)).max() > 100 * TOL


def _greedy(runner: ModelRunner, prompt: list[int], new: int, adapter_slot: int) -> list[int]:
    table = list(range(1, 1 + -(-(len(prompt) + new) // BLOCK)))
    row = ScheduledRow(prompt, 0, table, ssm_slot=1, adapter_slot=adapter_slot)
    out = [runner.run([row])[0].token]
    for _ in range(new - 1):
        row = ScheduledRow([out[-1]], len(prompt) + len(out) - 1, table, ssm_slot=1,
                           adapter_slot=adapter_slot)
        out.append(runner.run([row])[0].token)
    return out


ENGINE = dict(max_batch_size=2, max_tokens_per_tick=16, max_seq_len=32, seq_buckets=(2,),
              token_buckets=(16,), query_buckets=(1, 16), block_size=BLOCK, num_kv_blocks=16,
              block_buckets=(8,), max_logprobs=2, program_cache="none")


@pytest.mark.parametrize("case", ["llama_attn_mlp_rslora", "nemotronh_all_mamba"])
def test_greedy_equals_merged_checkpoint(case, bases, ours, tmp_path):
    arch, config = CASES[case]
    base, _ = bases[arch]
    model, cfg = ours[arch]
    peft_model = make_adapter(base, tmp_path / "adapter", **config)
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    merged_model, merged_cfg = load_hf_model(tmp_path / "merged", progress=False)
    assert merged_cfg == cfg

    runner = ModelRunner(model, EngineConfig(**ENGINE, lora=LORA))
    runner.load_adapter(2, load_peft_adapter(tmp_path / "adapter", cfg, LORA, case))
    plain = ModelRunner(merged_model, EngineConfig(**ENGINE))
    prompt = np.random.RandomState(1).randint(0, cfg.vocab_size, 9).tolist()
    assert _greedy(runner, prompt, 8, adapter_slot=2) == _greedy(plain, prompt, 8, 0)


# ---- names ------------------------------------------------------------------------------

def test_target_names(ours):
    _, llama = ours["llama"]
    _, nemo = ours["nemotronh"]
    assert our_target(llama, "base_model.model.model.layers.1.self_attn.q_proj") == \
        "blocks.2.mixer.q_proj"
    assert our_target(llama, "model.layers.0.mlp.down_proj") == "blocks.1.mixer.down_proj"
    assert our_target(nemo, "backbone.layers.3.mixer.in_proj") == "blocks.3.mixer.in_proj"
    assert our_target(nemo, "model.layers.2.mixer.up_proj") == "blocks.2.mixer.up_proj"
    assert "blocks.0.mixer.out_proj" in target_paths(nemo)
    assert "blocks.2.mixer.gate_proj" not in target_paths(nemo)  # NemotronH's MLP is ungated
    with pytest.raises(LoraError, match="has no projection 'gate_proj'"):
        our_target(nemo, "backbone.layers.2.mixer.gate_proj")
    with pytest.raises(LoraError, match="layer 7 does not exist"):
        our_target(llama, "model.layers.7.self_attn.q_proj")


# ---- refusals ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_adapter(bases, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama_adapter")
    make_adapter(bases["llama"][0], path, r=8, lora_alpha=16, target_modules=["q_proj"])
    return path


def _edited(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        file = dst / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if tensors is not None:
        file = dst / "adapter_model.safetensors"
        data = load_file(file)
        tensors(data)
        save_file(data, file)
    return dst


def _q_a(data: dict) -> str:
    return next(k for k in data if "q_proj.lora_A" in k)


REFUSALS = {
    "dora": (dict(use_dora=True), None, "DoRA"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), None, "modules_to_save"),
    "bias": (dict(bias="lora_only"), None, "bias 'lora_only'"),
    "lm_head_target": (dict(target_modules=["q_proj", "lm_head"]), None, "lm_head"),
    "embedding_tensor": (None, lambda d: d.update({
        "base_model.model.model.embed_tokens.lora_embedding_A": np.ones((8, 4096), np.float32)}),
        "embedding"),
    "dora_tensor": (None, lambda d: d.update({
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
            np.ones(64, np.float32)}), "DoRA"),
    "unknown_layer": (None, lambda d: d.update({
        "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight":
            np.ones((8, 64), np.float32),
        "base_model.model.model.layers.5.self_attn.q_proj.lora_B.weight":
            np.ones((64, 8), np.float32)}), "layer 5 does not exist"),
    "unknown_module": (None, lambda d: d.update({
        "base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight":
            np.ones((8, 64), np.float32),
        "base_model.model.model.layers.0.self_attn.x_proj.lora_B.weight":
            np.ones((64, 8), np.float32)}), "no projection 'x_proj'"),
    "shape_mismatch": (None, lambda d: d.update({_q_a(d): np.ones((8, 32), np.float32)}),
                       "another base model"),
    "missing_b": (None, lambda d: d.pop(_q_a(d).replace("lora_A", "lora_B")), "lacks lora_B"),
    "bias_tensor": (None, lambda d: d.update({
        "base_model.model.model.layers.0.self_attn.q_proj.bias": np.ones(64, np.float32)}),
        "not a LoRA A/B weight"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_adapters(case, llama_adapter, ours, tmp_path):
    config, tensors, message = REFUSALS[case]
    path = _edited(llama_adapter, tmp_path / "a", config, tensors)
    with pytest.raises(LoraError, match=message) as err:
        load_peft_adapter(path, ours["llama"][1], LORA, "mine")
    assert "'mine'" in str(err.value)


def test_bfloat16_adapter_file(llama_adapter, ours, tmp_path):
    from safetensors.torch import load_file as torch_load
    from safetensors.torch import save_file as torch_save

    cfg = ours["llama"][1]
    path = _edited(llama_adapter, tmp_path / "bf16")
    file = path / "adapter_model.safetensors"
    torch_save({k: v.to(torch.bfloat16) for k, v in torch_load(file).items()}, file)
    f32 = load_peft_adapter(llama_adapter, cfg, LORA, "f32")
    bf16 = load_peft_adapter(path, cfg, LORA, "bf16")
    assert f32.targets.keys() == bf16.targets.keys()
    for key, (a, b) in f32.targets.items():
        np.testing.assert_allclose(bf16.targets[key][0], a, rtol=1e-2, atol=1e-3)
        np.testing.assert_allclose(bf16.targets[key][1], b, rtol=1e-2, atol=1e-3)


def test_rank_above_max_and_missing_files(llama_adapter, ours, tmp_path):
    cfg = ours["llama"][1]
    with pytest.raises(LoraError, match="rank 8 .* exceeds max_lora_rank 4"):
        load_peft_adapter(llama_adapter, cfg, LoraConfig(max_lora_rank=4), "big")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="adapter_config.json not found"):
        load_peft_adapter(tmp_path / "empty", cfg, LORA, "gone")
    path = _edited(llama_adapter, tmp_path / "noweights")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="adapter_model.safetensors not found"):
        load_peft_adapter(path, cfg, LORA, "gone")
