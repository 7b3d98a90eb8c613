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

from benchmarks.common import write_result
from metrale_jax.bench.overhead import CONTEXT, make_engine, overhead
from metrale_jax.request import SamplingParams


def ttft(prefix_len: int) -> dict:
    engine = make_engine(None, 4, True)
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
    engine = make_engine(None, 2, False)
    core = engine.core
    req = engine.make_request({"prompt_token_ids": list(range(7, 7 + length))},
                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.submit(req)
    while not core.active:
        engine.step()
    seq = req.sequences[0]

    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        assert core.parking.swap_out(seq)
        core.active.remove(seq)
        resumed = core.parking.resume(first_chunk=length)
        assert resumed.decoding == [seq]
        core.active.extend(resumed.decoding)
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
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    rows = []
    for batch in args.batches:
        row = overhead(None, batch, args.ticks, args.rounds)
        print(row, flush=True)
        rows.append(row)
    prefix = [ttft(n) for n in (256, 896)]
    print(prefix, flush=True)
    spill = [spill_vs_recompute(n) for n in (256, 896)]
    print(spill, flush=True)
    path = write_result("engine_overhead", {
        "model": "built-in default", "context_tokens": CONTEXT, "decode_overhead": rows,
        "ttft_prefix_cache": prefix, "spill_vs_recompute": spill,
        "target": "ratio_pipeline_on >= 0.95 at batch 64"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
