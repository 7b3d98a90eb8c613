"""HF checkpoints load into our model and reproduce transformers' log-probabilities.

Each case builds a tiny random transformers model (torch, CPU, float32), perturbs the
parameters that initialise to constants (norm weights, A_log, D, dt_bias, biases: a swapped
or mis-transposed one would otherwise go unnoticed), saves it, loads it with our loader and
compares log_softmax with transformers' full forward: for the prompt in one ragged prefill
step (two sequences side by side, padding included), then for 8 greedy decode steps through
a paged cache with shuffled, non-contiguous blocks; the same in bfloat16 against transformers
in bfloat16, within a stated tolerance. Then: sharded and bfloat16 checkpoints,
NemotronH MTP tensors, and the loader's errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import (LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM,
                          NemotronHConfig, NemotronHForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from metrale_jax.loader import load_hf_model, load_model, model_config_from_hf
from metrale_jax.model import allocate_caches
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch

TOL = 1e-4
BLOCK = 4
MAX_BLOCKS = 8
PROMPT_LEN, OTHER_LEN, DECODE_STEPS = 11, 4, 8
# Shuffled, non-contiguous physical blocks (0 is the null block); slot 0 is the null slot.
TABLE, OTHER_TABLE = [7, 2, 9, 4, 11], [5, 10]
SLOT, OTHER_SLOT = 3, 1

# A wider init than the default 0.02 spreads the logits, so a small mismatch shows.
_ATTN = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64, initializer_range=0.1)
CASES = {
    # GQA 2, tied embeddings, vocab not a multiple of 128, llama3 RoPE scaling whose
    # original length is small enough that every band (kept, smoothed, scaled) is used.
    "llama_tied_gqa2_llama3": (LlamaForCausalLM, LlamaConfig(
        **_ATTN, vocab_size=1000, num_hidden_layers=2, num_key_value_heads=2,
        tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=8))),
    # MHA (GQA 1), untied, linear RoPE scaling.
    "llama_untied_mha_linear": (LlamaForCausalLM, LlamaConfig(
        **_ATTN, vocab_size=515, num_hidden_layers=2, num_key_value_heads=4,
        rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0))),
    # GQA 4, QK-norm, head_dim != hidden / heads.
    "qwen3_gqa4": (Qwen3ForCausalLM, Qwen3Config(
        **_ATTN, vocab_size=515, num_hidden_layers=2, num_key_value_heads=1, head_dim=32)),
    # n_groups 2, chunks of 4 so the prompt's scan crosses chunks, tied, a dt clamp that bites.
    "mamba2_groups2_chunk4_tied": (Mamba2ForCausalLM, Mamba2Config(
        vocab_size=515, hidden_size=64, num_heads=8, head_dim=16, expand=2, n_groups=2,
        state_size=16, num_hidden_layers=2, chunk_size=4, tie_word_embeddings=True,
        time_step_limit=(0.005, 2.0))),
    # M * - M * with GQA 2, n_groups 2, chunks of 4; a dt clamp (time_step_limit) that bites.
    "nemotronh_gqa2_groups2": (NemotronHForCausalLM, NemotronHConfig(
        vocab_size=515, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
        ssm_state_size=16, chunk_size=4, max_position_embeddings=64, initializer_range=0.1,
        time_step_limit=(0.05, float("inf")),
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention",
                           "full_attention"])),
}


def _perturb(model: torch.nn.Module) -> None:
    """Give every vector parameter distinct, non-default values."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 1:
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("dt_bias"):
                # Spread softplus(dt) from ~1e-4 to ~3 so both clamp bounds are exercised.
                p.copy_(torch.linspace(-9.0, 3.0, p.numel())[torch.randperm(p.numel(), generator=gen)])
            elif name.endswith("A_log"):
                p.add_(0.3 * noise)
            else:
                p.add_(0.2 * noise)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    cls, config = CASES[request.param]
    torch.manual_seed(0)
    hf = cls(config).eval()
    _perturb(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def _hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _step_fn(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, batch, caches):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(batch, caches)
        return jax.nn.log_softmax(m.logits(hidden), axis=-1), caches

    return lambda batch, caches: step(state, batch, caches)


@pytest.fixture(scope="module")
def parity(case):
    """Our log-probs and transformers' for the prompt, the side prompt and 8 decode steps."""
    name, hf, path = case
    model, cfg = load_hf_model(path, progress=False)
    rng = np.random.RandomState(0)
    prompt = rng.randint(0, cfg.vocab_size, PROMPT_LEN).tolist()
    other = rng.randint(0, cfg.vocab_size, OTHER_LEN).tolist()

    # transformers: greedy extension by full forwards, then one forward over everything.
    generated: list[int] = []
    for _ in range(DECODE_STEPS):
        generated.append(int(_hf_logprobs(hf, prompt + generated)[-1].argmax()))
    ref_full = _hf_logprobs(hf, prompt + generated)
    ref_other = _hf_logprobs(hf, other)

    step = _step_fn(model)
    caches = allocate_caches(cfg, num_blocks=12, block_size=BLOCK, num_slots=4)
    rows = [RowChunk(prompt, 0, TABLE, SLOT), RowChunk(other, 0, OTHER_TABLE, OTHER_SLOT)]
    batch = build_step_batch(rows, StepShape(tokens=16, rows=2, query_len=16,
                                             max_blocks=MAX_BLOCKS), BLOCK)
    logprobs, caches = step(batch, caches)
    logprobs = np.asarray(logprobs)
    ours_prompt = logprobs[:PROMPT_LEN]
    ours_other = logprobs[PROMPT_LEN:PROMPT_LEN + OTHER_LEN]

    ours_decode = []
    decode_shape = StepShape(tokens=1, rows=1, query_len=1, max_blocks=MAX_BLOCKS)
    for s, token in enumerate(generated):
        batch = build_step_batch([RowChunk([token], PROMPT_LEN + s, TABLE, SLOT)], decode_shape,
                                 BLOCK)
        logprobs, caches = step(batch, caches)
        ours_decode.append(np.asarray(logprobs)[0])
    return dict(
        prompt=(ours_prompt, ref_full[:PROMPT_LEN]),
        other=(ours_other, ref_other),
        decode=(np.stack(ours_decode), ref_full[PROMPT_LEN:]),
    )


def test_prompt_logprobs_match_transformers(parity):
    for key in ("prompt", "other"):
        ours, ref = parity[key]
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() < TOL, key


def test_decode_logprobs_match_transformers(parity):
    ours, ref = parity["decode"]
    assert ours.shape == (DECODE_STEPS, ref.shape[1])
    np.testing.assert_array_less(np.abs(ours - ref).max(axis=1), TOL)


# ---- bfloat16 ---------------------------------------------------------------------------

# bf16 keeps 8 bits of mantissa, so bf16 log-probs sit a few hundredths from the f32 ones in
# any implementation. The stated tolerance: ours in bf16 is within BF16_TOL of transformers
# in bf16, and no further from transformers' f32 than BF16_SLACK times transformers' own bf16
# distance from it (measured: 0.8-1.4x). A swapped or mis-cast weight is off by ~1 or more.
BF16_TOL, BF16_SLACK = 0.15, 2.0


@pytest.fixture(scope="module")
def bf16_parity(case):
    """Prompt and 4 decode steps in bf16 (weights and activations; the KV pool f32, the
    engine's choice on the CPU), with transformers' bf16 and f32 log-probs."""
    _, hf, path = case
    model, cfg = load_hf_model(path, progress=False, dtype="bfloat16")
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, PROMPT_LEN).tolist()
    hf_bf16 = type(hf)(hf.config).eval()
    hf_bf16.load_state_dict(hf.state_dict())
    hf_bf16 = hf_bf16.to(torch.bfloat16)
    generated: list[int] = []
    for _ in range(4):
        generated.append(int(_hf_logprobs(hf_bf16, prompt + generated)[-1].argmax()))
    ids = prompt + generated

    step = _step_fn(model)
    caches = allocate_caches(cfg, num_blocks=12, block_size=BLOCK, num_slots=4,
                             kv_dtype="float32")
    batch = build_step_batch([RowChunk(prompt, 0, TABLE, SLOT)],
                             StepShape(tokens=16, rows=1, query_len=16, max_blocks=MAX_BLOCKS),
                             BLOCK)
    logprobs, caches = step(batch, caches)
    ours = [np.asarray(logprobs, np.float32)[:PROMPT_LEN]]
    decode_shape = StepShape(tokens=1, rows=1, query_len=1, max_blocks=MAX_BLOCKS)
    for s, token in enumerate(generated[:-1]):
        batch = build_step_batch([RowChunk([token], PROMPT_LEN + s, TABLE, SLOT)],
                                 decode_shape, BLOCK)
        logprobs, caches = step(batch, caches)
        ours.append(np.asarray(logprobs, np.float32)[:1])
    return np.concatenate(ours), _hf_logprobs(hf_bf16, ids)[:-1], _hf_logprobs(hf, ids)[:-1]


def test_bfloat16_logprobs_match_transformers_in_bfloat16(bf16_parity):
    ours, ref_bf16, ref_f32 = bf16_parity
    assert ours.shape == ref_bf16.shape
    assert np.abs(ours - ref_bf16).max() < BF16_TOL
    assert np.abs(ours - ref_f32).max() <= BF16_SLACK * np.abs(ref_bf16 - ref_f32).max()


# ---- checkpoint variants --------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A one-layer untied Llama, saved once; tests copy it before editing."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**_ATTN, "hidden_size": 32}, vocab_size=100,
                                      num_hidden_layers=1, num_key_value_heads=2))
    path = tmp_path_factory.mktemp("llama_small")
    hf.save_pretrained(path)
    return path


def _leaves(model) -> dict:
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model))}


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    hf = json.loads((path / "config.json").read_text())
    hf.update(changes)
    (path / "config.json").write_text(json.dumps(hf))


def test_sharded_checkpoint_loads_like_single_file(llama_dir, tmp_path):
    torch.manual_seed(0)
    hf = LlamaForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    single, _ = load_hf_model(llama_dir, progress=False)
    sharded, _ = load_hf_model(tmp_path, progress=False)
    a, b = _leaves(single), _leaves(sharded)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_bfloat16_checkpoint(llama_dir, tmp_path):
    hf = LlamaForCausalLM.from_pretrained(llama_dir).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path, progress=False)
    assert cfg.dtype == "bfloat16"
    embed = model.embed.embedding[...]
    assert embed.dtype == jax.numpy.bfloat16
    ref = hf.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(embed, np.float32), ref)
    model32, cfg32 = load_model(tmp_path, dtype="float32", progress=False)
    assert cfg32.dtype == "float32"
    np.testing.assert_array_equal(np.asarray(model32.embed.embedding[...]), ref)


def test_rotary_inv_freq_is_ignored(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_tensors(path, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    load_hf_model(path, progress=False)


def test_nemotronh_mtp_tensors(tmp_path):
    """MTP tensors (vLLM nemotron_h_mtp naming) land in our mtp modules; without MTP in the
    config they are ignored, as transformers does."""
    torch.manual_seed(0)
    hf = NemotronHForCausalLM(NemotronHConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=32, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
        ssm_state_size=8, layers_block_type=["linear_attention", "full_attention"]))
    hf.save_pretrained(tmp_path)
    rng = np.random.RandomState(0)
    d, kv = 32, 16
    mtp = {"mtp.layers.0.enorm.weight": (d,), "mtp.layers.0.hnorm.weight": (d,),
           "mtp.layers.0.eh_proj.weight": (d, 2 * d), "mtp.layers.0.norm.weight": (d,),
           "mtp.layers.0.mixer.q_proj.weight": (d, d), "mtp.layers.0.mixer.k_proj.weight": (kv, d),
           "mtp.layers.0.mixer.v_proj.weight": (kv, d), "mtp.layers.0.mixer.o_proj.weight": (d, d),
           "mtp.layers.1.norm.weight": (d,), "mtp.layers.1.mixer.up_proj.weight": (32, d),
           "mtp.layers.1.mixer.down_proj.weight": (d, 32),
           "mtp.layers.1.final_layernorm.weight": (d,)}
    mtp = {k: rng.randn(*s).astype(np.float32) for k, s in mtp.items()}
    _edit_tensors(tmp_path, lambda t: t.update(mtp))

    model, cfg = load_hf_model(tmp_path, progress=False)  # num_nextn_predict_layers = 0
    assert cfg.num_mtp_modules == 0

    _edit_config(tmp_path, num_nextn_predict_layers=1,
                 mtp_layers_block_type=["full_attention", "mlp"])
    model, cfg = load_hf_model(tmp_path, progress=False)
    assert (cfg.num_mtp_modules, cfg.mtp_pattern) == (1, "AF")
    m = model.mtp[0]
    np.testing.assert_array_equal(m.enorm.scale[...], mtp["mtp.layers.0.enorm.weight"])
    np.testing.assert_array_equal(m.hnorm.scale[...], mtp["mtp.layers.0.hnorm.weight"])
    np.testing.assert_array_equal(m.eh_proj.kernel[...], mtp["mtp.layers.0.eh_proj.weight"].T)
    np.testing.assert_array_equal(m.blocks[0].mixer.k_proj.kernel[...],
                                  mtp["mtp.layers.0.mixer.k_proj.weight"].T)
    np.testing.assert_array_equal(m.blocks[1].norm.scale[...], mtp["mtp.layers.1.norm.weight"])
    np.testing.assert_array_equal(m.blocks[1].mixer.up_proj.kernel[...],
                                  mtp["mtp.layers.1.mixer.up_proj.weight"].T)
    np.testing.assert_array_equal(m.norm.scale[...], mtp["mtp.layers.1.final_layernorm.weight"])

    _edit_config(tmp_path, mtp_layers_block_type=["full_attention", "moe"])
    with pytest.raises(ValueError, match="mtp_layers_block_type.*MoE"):
        load_hf_model(tmp_path, progress=False)


# ---- errors ---------------------------------------------------------------------------

def test_unknown_architecture(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(path, progress=False)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError) as err:
        load_hf_model(path, progress=False)
    assert "model.layers.0.mlp.up_proj.weight" in str(err.value)
    assert "blocks.1.mixer.up_proj.kernel" in str(err.value)


def test_missing_lm_head_when_untied(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_tensors(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="'lm_head.weight'.*lm_head.kernel"):
        load_hf_model(path, progress=False)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_tensors(path, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": np.zeros((24, 32), np.float32)}))
    with pytest.raises(ValueError) as err:
        load_hf_model(path, progress=False)
    msg = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg
    assert "(24, 32)" in msg and "(16, 32)" in msg


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_tensors(path, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}))
    with pytest.raises(ValueError, match="unexpected.*model.layers.0.self_attn.q_proj.bias"):
        load_hf_model(path, progress=False)


def test_tied_checkpoint_may_store_lm_head_only_as_a_copy(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path)
    _edit_config(path, tie_word_embeddings=True)  # lm_head.weight stays, and differs
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_hf_model(path, progress=False)
    _edit_tensors(path, lambda t: t.__setitem__("lm_head.weight",
                                                t["model.embed_tokens.weight"].copy()))
    model, cfg = load_hf_model(path, progress=False)
    assert cfg.tie_word_embeddings and not hasattr(model, "lm_head")


def test_neither_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        load_model(tmp_path)


_LLAMA_JSON = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=32,
                   num_attention_heads=2, num_hidden_layers=1, intermediate_size=64)


@pytest.mark.parametrize("changes, field", [
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), "rope_type"),
    (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "rope_type"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=16),
     "use_sliding_window"),
    (dict(architectures=["MixtralForCausalLM"]), "MixtralForCausalLM"),
])
def test_unsupported_config_is_named(changes, field):
    with pytest.raises(ValueError, match=field):
        model_config_from_hf({**_LLAMA_JSON, **changes})


def test_legacy_rope_fields():
    """transformers 4 configs: top-level rope_theta and a rope_scaling dict (Llama 3.1)."""
    cfg = model_config_from_hf({**_LLAMA_JSON, "rope_theta": 5e5, "rope_scaling": dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)})
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, "llama3")
    assert cfg.rope_scaling_args == (8.0, 1.0, 4.0, 8192.0)
    cfg = model_config_from_hf({**_LLAMA_JSON, "rope_theta": 1e6, "rope_scaling": None})
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, "none")


def test_nemotronh_moe_layers_are_refused():
    hf = dict(architectures=["NemotronHForCausalLM"], vocab_size=100, hidden_size=32,
              num_attention_heads=2, head_dim=16, intermediate_size=64, mamba_num_heads=4,
              mamba_head_dim=16, n_groups=1, ssm_state_size=8, hybrid_override_pattern="M*E")
    with pytest.raises(ValueError, match="hybrid_override_pattern.*MoE"):
        model_config_from_hf(hf)
    cfg = model_config_from_hf({**hf, "hybrid_override_pattern": "M*-"})
    assert cfg.layer_pattern == "MAF" and not cfg.use_rope and cfg.mlp_kind == "relu2"
