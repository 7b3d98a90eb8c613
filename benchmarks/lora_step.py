"""Multi-LoRA decode step cost: batch 16 with 0, 1 and 4 distinct adapters, side by side.

Per model (random weights): one `ModelRunner` with LoRA on (`max_loras=4`,
`max_lora_rank=16`), four rank-16 adapters on every target projection (the worst case),
and the same decode step (every row one token at a fixed context) run three ways: every row
on slot 0 (the no-LoRA variant), every row on one adapter, rows spread over four adapters.
Each step is timed from dispatch to tokens on the host (what delivered tok/s sees), in
interleaved rounds after warm-up; medians. The issue's goal: 4 adapters >= 0.8x of none.

Then the same three mixes through the whole engine on the built-in model (`LLM` with
`enable_lora=True`, adapters registered through `LoRARequest`, every variant warmed up): 16
greedy requests of `--output-len` tokens per run, delivered tokens/s of wall clock, the
mixes taking turns for `--rounds` rounds after one untimed run each (which loads the
adapters); a mix's figure is its best round.

Run: `python -m benchmarks.lora_step [--steps N] [--rounds N] [--models default llama-50m]
[--output-len N]`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np
from flax import nnx

from benchmarks.step_decode import MODELS
from metrale_jax.bench.results import RESULTS_DIR, write_json
from metrale_jax.config import EngineConfig, ModelConfig
from metrale_jax.lora import LoraConfig, LoraWeights
from metrale_jax.lora.targets import model_targets
from metrale_jax.model import HybridLM
from metrale_jax.runner.model_runner import ModelRunner
from metrale_jax.types import ScheduledRow

BATCH, CONTEXT, BLOCK = 16, 128, 16
LORA = LoraConfig(max_loras=4, max_lora_rank=16)
MIXES = {"no_adapter": [0] * BATCH, "1_adapter": [1] * BATCH,
         "4_adapters": [1 + i % 4 for i in range(BATCH)]}


def _adapter(cfg: ModelConfig, seed: int) -> LoraWeights:
    rng = np.random.RandomState(seed)
    r = LORA.max_lora_rank
    return LoraWeights(f"bench{seed}", r, 0.5, {
        p: (rng.randn(t.d_in, r).astype(np.float32) * 0.02,
            rng.randn(r, t.d_out).astype(np.float32) * 0.02)
        for p, t in model_targets(cfg).items()})


def _runner(cfg: ModelConfig) -> ModelRunner:
    blocks = -(-(CONTEXT + 1) // BLOCK)
    engine = EngineConfig(
        max_batch_size=BATCH, max_tokens_per_tick=BATCH, max_seq_len=blocks * BLOCK,
        seq_buckets=(BATCH,), token_buckets=(BATCH,), query_buckets=(1, BATCH),
        block_buckets=(blocks,), block_size=BLOCK, num_kv_blocks=1 + BATCH * blocks,
        max_logprobs=1, program_cache="none", lora=LORA)
    runner = ModelRunner(HybridLM(cfg, nnx.Rngs(0)), engine)
    for slot in range(1, LORA.max_loras + 1):
        runner.load_adapter(slot, _adapter(cfg, slot))
    return runner


def _rows(slots: list[int]) -> list[ScheduledRow]:
    blocks = -(-(CONTEXT + 1) // BLOCK)
    return [ScheduledRow([7], CONTEXT, list(range(1 + i * blocks, 1 + (i + 1) * blocks)),
                         ssm_slot=i + 1, adapter_slot=s) for i, s in enumerate(slots)]


def bench_model(name: str, steps: int, rounds: int) -> dict:
    runner = _runner(MODELS[name])
    rows = {mix: _rows(slots) for mix, slots in MIXES.items()}
    for mix in MIXES:  # compile both variants outside the timed window
        runner.run(rows[mix])
    times: dict[str, list[float]] = {mix: [] for mix in MIXES}
    for _ in range(rounds):
        for mix in MIXES:
            for _ in range(steps):
                t0 = time.perf_counter()
                runner.run(rows[mix])
                times[mix].append(time.perf_counter() - t0)
    med = {mix: float(np.median(t)) for mix, t in times.items()}
    base = med["no_adapter"]
    return {"model": name, "batch": BATCH, "context": CONTEXT,
            "max_loras": LORA.max_loras, "max_lora_rank": LORA.max_lora_rank,
            "steps_per_mix": steps * rounds,
            "median_step_ms": {m: round(v * 1e3, 3) for m, v in med.items()},
            "decode_tokens_per_s": {m: round(BATCH / v, 1) for m, v in med.items()},
            "ratio_vs_no_adapter": {m: round(base / v, 3) for m, v in med.items()}}


def bench_engine(rounds: int, output_len: int) -> dict:
    """Delivered tok/s at batch 16 through `LLM` (scheduler, cohort gate, sampling, all)."""
    from metrale_jax import LLM, LoRARequest, SamplingParams
    from metrale_jax.default_model.model import CONFIG

    llm = LLM(enable_lora=True, max_loras=LORA.max_loras, max_lora_rank=LORA.max_lora_rank,
              max_batch_size=BATCH, adapter_loader=lambda name, path: _adapter(
                  CONFIG, int(name.removeprefix("bench"))))
    adapters = [LoRARequest(f"bench{i}", i, f"/bench/{i}") for i in range(1, 5)]
    mixes = {"no_adapter": [None] * BATCH, "1_adapter": [adapters[0]] * BATCH,
             "4_adapters": [adapters[i % 4] for i in range(BATCH)]}
    prompts = [f"Sonnet {i}: shall I compare thee" for i in range(BATCH)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    best = {m: 0.0 for m in mixes}
    for rnd in range(rounds + 1):
        for mix, loras in mixes.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if rnd:  # the first round loads the adapters: not timed
                best[mix] = max(best[mix], tokens / elapsed)
    base = best["no_adapter"]
    return {"model": "default (engine)", "batch": BATCH, "output_len": output_len,
            "rounds": rounds, "delivered_tokens_per_s": {m: round(v, 1) for m, v in best.items()},
            "ratio_vs_no_adapter": {m: round(v / base, 3) for m, v in best.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    results = []
    for name in args.models:
        results.append(bench_model(name, args.steps, args.rounds))
        print(results[-1], flush=True)
    results.append(bench_engine(args.rounds, args.output_len))
    print(results[-1], flush=True)
    command = " ".join([pathlib.Path(sys.executable).name, "-m", "benchmarks.lora_step"]
                       + sys.argv[1:])
    write_json(RESULTS_DIR / "lora-step.json", {"results": results}, command)


if __name__ == "__main__":
    main()
