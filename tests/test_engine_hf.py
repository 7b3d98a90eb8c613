"""`LLM` on a Hugging Face NemotronH directory: greedy generation through the whole engine
(tokenizer, batched loop, paged caches, SSM slots, device sampler) equals transformers'
greedy continuation computed by full forwards."""

from __future__ import annotations

import pytest
import torch

from metrale_jax import LLM, SamplingParams
from tests.hf_models import save_tiny_mamba2, save_tiny_nemotronh

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotronh")
    model = save_tiny_nemotronh(
        path, intermediate_size=128, mamba_num_heads=8, ssm_state_size=16,
        max_position_embeddings=256,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention",
                           "mlp"])
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
              block_size=4, num_kv_blocks=64, warmup=False)
    prompts = ["Return the value of", "x", "class Foo: def __init__(self) is called when"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    for out in outs:
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids)


def test_an_attention_free_model_serves_with_default_sizes(tmp_path):
    # A pure Mamba2 model has no KV pool; its block pool is bookkeeping only and used to
    # get a single block from the memory budget ("BlockPool needs num_blocks >= 2").
    hf = save_tiny_mamba2(tmp_path)
    llm = LLM(str(tmp_path), max_batch_size=4, max_seq_len=128, warmup=False)
    prompts = ["Return the value of", "x"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    for out in outs:
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids)
