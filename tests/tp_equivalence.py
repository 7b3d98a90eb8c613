"""Tensor parallel against one device, run as its own process on simulated CPU devices.

`python -m tests.tp_equivalence` sets `--xla_force_host_platform_device_count` before jax is
imported (which a pytest worker has already done), then for each model and each tp runs
one engine through the same workload and prints one JSON line per (model, tp): the greedy
outputs, the log-probabilities (top-n of every sampled and prompt position), the spill,
swap-in and prefix-hit counts. `tests/test_tensor_parallel.py` compares them with tp=1's.

The workload covers what the acceptance asks for in one engine per (model, tp): a pool so
small that admission must spill running sequences and resume them, prompts sharing a
prefix (run twice, so the second round hits the prefix cache), the async pipeline on, and
one request with prompt logprobs.
"""

from __future__ import annotations

import json
import os
import sys

DEVICES = 4
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()

from metrale_jax.config import ModelConfig  # noqa: E402  (after XLA_FLAGS)

TINY_LLAMA = ModelConfig(
    vocab_size=512, hidden_size=64, layer_pattern="AFAF", num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=128, max_position_embeddings=128)
# NemotronH's shape: no RoPE, squared-ReLU MLP, one KV head (replicated on every device),
# Mamba2 with one B/C group (widened per device), dt clamped.
TINY_NEMOTRONH = ModelConfig(
    vocab_size=512, hidden_size=64, layer_pattern="MAFM", num_heads=4, num_kv_heads=1,
    head_dim=16, use_rope=False, mlp_kind="relu2", intermediate_size=128,
    mamba_num_heads=4, mamba_head_dim=16, mamba_groups=1, ssm_state_size=8,
    mamba_chunk_size=8, time_step_min=1e-3, max_position_embeddings=128)
MODELS = {"llama": (TINY_LLAMA, (1, 2, 4)), "nemotronh": (TINY_NEMOTRONH, (1, 2, 4)),
          "default": (None, (1, 2))}
ENGINE = dict(block_size=8, num_kv_blocks=10, max_seq_len=64, max_batch_size=4,
              max_tokens_per_tick=32, prefill_chunk_size=32, seq_buckets=(4,),
              token_buckets=(32,), query_buckets=(1, 32), block_buckets=(8,),
              max_logprobs=2, num_ssm_snapshots=4, check_every_tick=True)


def _install(cfg: ModelConfig | None) -> None:
    """Make `LLMEngine(None)` build `cfg` with a seeded random init (None: the built-in
    trained model), with the built-in tokenizer (token-id prompts only)."""
    from flax import nnx

    from metrale_jax import engine
    from metrale_jax.default_model import ASSET_DIR
    from metrale_jax.loader.resolve import LoadedModel, load
    from metrale_jax.model.hybrid import HybridLM
    from metrale_jax.tokenizer import Tokenizer

    if cfg is None:
        engine.load = load
        return
    engine.load = lambda name, dtype=None: LoadedModel(
        HybridLM(cfg, nnx.Rngs(0)), cfg, Tokenizer.from_dir(ASSET_DIR), "tiny")


def _greedy(engine, prompts, max_tokens: int, **params) -> list:
    from metrale_jax.request import SamplingParams

    reqs = [engine.make_request({"prompt_token_ids": p}, SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)) for p in prompts]
    for r in reqs:
        engine.submit(r)
    while not all(r.finished for r in reqs):
        engine.step()
    engine.drain()
    return [r.sequences[0] for r in reqs]


def _logprobs(positions) -> list:
    return [sorted((tid, lp.logprob) for tid, lp in pos.items()) if pos else []
            for pos in positions]


def run(name: str, tp: int) -> dict:
    from metrale_jax.engine import LLMEngine

    cfg, _ = MODELS[name]
    _install(cfg)
    engine = LLMEngine(None, tensor_parallel_size=tp, **ENGINE)
    try:
        scored = _greedy(engine, [list(range(5, 25))], 6, logprobs=2, prompt_logprobs=2)[0]
        shared = list(range(30, 54))  # three full blocks every prompt starts with
        prompts = [shared + list(range(100 + 7 * i, 104 + 7 * i)) for i in range(4)]
        rounds, compiled = [], []
        for _ in range(2):  # the second round runs no shape the first did not compile
            rounds.append([s.output_ids for s in _greedy(engine, prompts, 20)])
            compiled.append(engine.runner.step._jitted._cache_size())
        counters = engine.core.tel.counters()
        return {"model": name, "tp": tp, "outputs": rounds, "scored": scored.output_ids,
                "logprobs": _logprobs(scored.logprobs),
                "prompt_logprobs": _logprobs(scored.prompt_logprobs[1:]),
                "step_programs": compiled, "spills": counters.get("spills", 0), "swap_ins": counters.get("swap_ins", 0),
                "prefix_hit_tokens": engine.core.memory.pool.stats.prefix_hit_tokens}
    finally:
        engine.close()


def refused(tp: int) -> str:
    """The error of a tp that does not divide the built-in model's heads."""
    from metrale_jax.engine import LLMEngine
    from metrale_jax.parallel.config import ParallelConfigError

    _install(None)
    try:
        LLMEngine(None, tensor_parallel_size=tp, **ENGINE)
    except ParallelConfigError as err:
        return str(err)
    return ""


def main(names: list[str]) -> None:
    for name in names or list(MODELS):
        for tp in MODELS[name][1]:
            print(json.dumps(run(name, tp)), flush=True)
    print(json.dumps({"refused": refused(4)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
