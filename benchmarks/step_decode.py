"""Decode tokens/s of the bare jitted step (no scheduler) at batch 1, 8 and 64.

For each model, every row decodes one token per step at a fixed context length; the step is
compiled first and timed apart. Run: `python -m benchmarks.step_decode [--steps N]`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import write_result
from metrale_jax.config import ModelConfig
from metrale_jax.default_model import model as default_model
from metrale_jax.model import HybridLM, allocate_caches
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch
from metrale_jax.runner.penalties import history_width
from metrale_jax.runner.sampler import make_sampling_arrays
from metrale_jax.runner.slot_tables import allocate_slot_tables
from metrale_jax.runner.step import StepOptions, StepRunner

# ~53M parameters, shaped like a small Llama (untied head, 32k vocabulary).
LLAMA_50M = ModelConfig(
    vocab_size=32000, hidden_size=512, layer_pattern="AF" * 6, num_heads=8, num_kv_heads=8,
    head_dim=64, intermediate_size=1536, rope_theta=10000.0, max_position_embeddings=2048)

MODELS = {"default": default_model.CONFIG, "llama-50m": LLAMA_50M}


def count_params(model: HybridLM) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model)))


def bench_decode(cfg: ModelConfig, batch: int, context: int, steps: int,
                 block_size: int = 16) -> dict:
    model = HybridLM(cfg, nnx.Rngs(0))
    runner = StepRunner(model)
    blocks_per_seq = -(-(context + 1) // block_size)
    caches = allocate_caches(cfg, 1 + batch * blocks_per_seq, block_size, batch + 1)
    rows = [RowChunk([7], context, list(range(1 + i * blocks_per_seq,
                                              1 + (i + 1) * blocks_per_seq)), i + 1)
            for i in range(batch)]
    shape = StepShape(batch, batch, 1, blocks_per_seq)
    step_batch = jax.tree.map(jnp.asarray, build_step_batch(rows, shape, block_size))
    sampling = jax.tree.map(jnp.asarray, make_sampling_arrays([], batch))
    options = StepOptions(num_top=1)
    tables = allocate_slot_tables(batch + 1, batch + 1, history_width(context + 1), 1)

    t0 = time.perf_counter()
    out, caches, tables = runner(step_batch, sampling, None, caches, tables, options)
    np.asarray(out.sampled.tokens)
    compile_s = time.perf_counter() - t0

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out, caches, tables = runner(step_batch, sampling, None, caches, tables, options)
        np.asarray(out.sampled.tokens)  # the host reads every step's tokens, as serving does
        times.append(time.perf_counter() - t0)
    median = float(np.median(times))
    return {"batch": batch, "context": context, "steps": steps,
            "compile_s": round(compile_s, 3), "median_step_ms": round(median * 1e3, 3),
            "decode_tokens_per_s": round(batch / median, 1),
            "params": count_params(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    results = []
    for name in args.models:
        for batch in args.batches:
            r = {"model": name, **bench_decode(MODELS[name], batch, args.context, args.steps)}
            print(r, flush=True)
            results.append(r)
    path = write_result("step_decode", {"results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
