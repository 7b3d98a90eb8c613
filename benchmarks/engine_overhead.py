"""The tick loop's cost against the bare jitted step, and what the caches buy.

1. Decode tokens/s through the engine (LLMEngine ticks, all sequences decoding) against the
   bare step at the same batch and context (batch 1, 8, 64), pipeline on and off.
2. Time to first token of a request whose long prefix is cached, against the same request
   with the prefix cache cold.
3. Spill + resume of a long sequence (swap-out to disk and back) against recomputing it.
Run: `python -m benchmarks.engine_overhead`; results go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_result
from metrale_jax.engine import LLMEngine
from metrale_jax.request import SamplingParams
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch
from metrale_jax.runner.sampler import make_sampling_arrays
from metrale_jax.runner.step import StepOptions

CONTEXT = 136  # with 2 x 40 ticks the block-table bucket (16 blocks of 16) never changes


def _engine(batch: int, pipeline: bool, **kw) -> LLMEngine:
    return LLMEngine(None, max_batch_size=max(batch, 1), max_tokens_per_tick=1024,
                     max_seq_len=1024, block_size=16, num_kv_blocks=max(batch, 1) * 64 + 1,
                     enable_pipeline=pipeline, **kw)


def engine_decode_tps(batch: int, pipeline: bool, ticks: int) -> float:
    engine = _engine(batch, pipeline)
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    reqs = [engine.make_request({"prompt_token_ids": list(range(5 + i, 5 + i + CONTEXT))},
                                params) for i in range(batch)]
    for r in reqs:
        engine.submit(r)
    core = engine.core
    while len(core.active) < batch or core.prefilling:  # prefill everything first
        engine.step()
    for _ in range(ticks):  # warm every bucket the timed ticks will use
        engine.step()
    start_tokens = sum(len(s.output_ids) for r in reqs for s in r.sequences)
    t0 = time.perf_counter()
    for _ in range(ticks):
        engine.step()
    core.settle()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for r in reqs for s in r.sequences) - start_tokens
    engine.close()
    return tokens / elapsed


def bare_decode_tps(batch: int, steps: int) -> float:
    engine = _engine(batch, False)
    runner = engine.runner
    bs = 16
    blocks = -(-(CONTEXT + steps + 1) // bs)
    rows = [RowChunk([7], CONTEXT, list(range(1 + i * blocks, 1 + (i + 1) * blocks)), i + 1)
            for i in range(batch)]
    shape = runner.ladders.shape_for(batch, batch, 1, blocks)
    batch_arrays = jax.tree.map(jnp.asarray, build_step_batch(rows, shape, bs))
    sampling = jax.tree.map(jnp.asarray, make_sampling_arrays([], shape.rows, 0, 0))
    options = StepOptions(num_top=engine.engine_config.max_logprobs)
    caches, future = runner.caches, runner.future
    for _ in range(3):
        out, caches, future = runner.step(batch_arrays, sampling, None, caches, future, options)
        np.asarray(out.sampled.tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        out, caches, future = runner.step(batch_arrays, sampling, None, caches, future, options)
        np.asarray(out.sampled.tokens)
    elapsed = time.perf_counter() - t0
    engine.close()
    return batch * steps / elapsed


def ttft(prefix_len: int) -> dict:
    engine = _engine(4, True)
    shared = list(range(3, 3 + prefix_len))
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def first_token(prompt):
        req = engine.make_request({"prompt_token_ids": prompt}, params)
        t0 = time.perf_counter()
        engine.submit(req)
        while not req.finished:
            engine.step()
        return time.perf_counter() - t0

    first_token(list(range(1000, 1000 + prefix_len + 8)))  # compile the shapes involved
    cold = first_token(shared + [11, 12, 13, 14, 15, 16, 17, 18])
    warm = first_token(shared + [21, 22, 23, 24, 25, 26, 27, 28])
    hits = engine.core.pool.stats.prefix_hit_tokens
    engine.close()
    return {"prefix_tokens": prefix_len, "ttft_cold_s": round(cold, 4),
            "ttft_prefix_hit_s": round(warm, 4), "speedup": round(cold / warm, 2),
            "prefix_hit_tokens": hits}


def spill_vs_recompute(length: int) -> dict:
    engine = _engine(2, False)
    core = engine.core
    req = engine.make_request({"prompt_token_ids": list(range(7, 7 + length))},
                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.submit(req)
    while not core.active:
        engine.step()
    seq = req.sequences[0]
    from metrale_jax.scheduler import swap

    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        assert swap.swap_out(core, seq)
        assert swap.swap_in(core, seq)
        jax.block_until_ready(engine.runner.caches)
        timings.append(time.perf_counter() - t0)
    spill_s = min(timings)
    nbytes = sum(a.nbytes for a in engine.runner.gather(seq.block_table, seq.slot).values())
    while not req.finished:
        engine.step()
    # Recompute: the same tokens prefilled again from nothing (what preemption costs).
    timings = []
    for i in range(3):
        again = engine.make_request({"prompt_token_ids": list(range(7, 7 + length))},
                                    SamplingParams(temperature=0.0, max_tokens=1))
        engine.levers.set(prefix_cache_enabled=False)
        t0 = time.perf_counter()
        engine.submit(again)
        while not again.finished:
            engine.step()
        timings.append(time.perf_counter() - t0)
    recompute_s = min(timings[1:])
    engine.close()
    return {"tokens": length, "state_bytes": int(nbytes), "spill_and_resume_s": round(spill_s, 4),
            "recompute_s": round(recompute_s, 4), "ratio_recompute_over_spill":
            round(recompute_s / spill_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ticks", type=int, default=40)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    overhead = []
    for batch in args.batches:
        bare = bare_decode_tps(batch, args.ticks)
        row = {"batch": batch, "bare_step_tokens_per_s": round(bare, 1)}
        for pipeline in (True, False):
            tps = engine_decode_tps(batch, pipeline, args.ticks)
            key = "pipeline_on" if pipeline else "pipeline_off"
            row[f"engine_tokens_per_s_{key}"] = round(tps, 1)
            row[f"ratio_{key}"] = round(tps / bare, 3)
        print(row, flush=True)
        overhead.append(row)
    prefix = [ttft(n) for n in (256, 896)]
    print(prefix, flush=True)
    spill = [spill_vs_recompute(n) for n in (256, 896)]
    print(spill, flush=True)
    path = write_result("engine_overhead", {
        "model": "built-in default", "context_tokens": CONTEXT, "decode_overhead": overhead,
        "ttft_prefix_cache": prefix, "spill_vs_recompute": spill,
        "target": "ratio_pipeline_on >= 0.95 at batch 64"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
