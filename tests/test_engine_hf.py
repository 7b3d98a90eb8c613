"""`LLM` on a Hugging Face NemotronH directory: greedy generation through the whole engine
(tokenizer, batched loop, paged caches, SSM slots, device sampler) equals transformers'
greedy continuation computed by full forwards."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from metrale_jax import LLM, SamplingParams
from metrale_jax.default_model import ASSET_DIR

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = NemotronHConfig(
        vocab_size=4096, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
        ssm_state_size=16, chunk_size=8, max_position_embeddings=256, initializer_range=0.1,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention",
                           "mlp"])
    model = NemotronHForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("nemotronh")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET_DIR / name, path / name)
    return path, model


def _hf_greedy(model, ids: list[int]) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([out])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    return out[len(ids):]


def test_engine_greedy_equals_transformers(hf_dir):
    path, hf = hf_dir
    llm = LLM(str(path), max_batch_size=4, max_tokens_per_tick=32, max_seq_len=128,
              block_size=4, num_kv_blocks=64)
    prompts = ["Return the value of", "x", "class Foo: def __init__(self) is called when"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    for out in outs:
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids)
