"""Single-request latency by prompt length: the prefill (time to the first token) and the
decode (time per later token), one request alone in the engine, medians over repetitions.

Every repetition uses a fresh random prompt, so the prefix cache never shortens a prefill;
one untimed request of each length compiles its shapes first.
"""

from __future__ import annotations

import time

import numpy as np

from metrale_jax.bench.datasets import random_requests
from metrale_jax.bench.throughput import EngineShape, build_engine
from metrale_jax.bench.timing import compile_seconds


def time_one(engine, prompt: tuple[int, ...], output_len: int,
             clock=time.perf_counter) -> tuple[float, float]:
    """(time to first token, mean time per later token) of one request."""
    from metrale_jax.request import SamplingParams

    req = engine.make_request({"prompt_token_ids": list(prompt)}, SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True))
    seq = req.sequences[0]
    t0 = clock()
    engine.submit(req)
    first = None
    while not req.finished:
        engine.step()
        if first is None and seq.output_ids:
            first = clock()
    engine.drain()
    end = clock()
    if first is None:
        first = end
    per_token = (end - first) / (output_len - 1) if output_len > 1 else 0.0
    return first - t0, per_token


def run_latency(model: str | None, prompt_lens: list[int], output_len: int, *,
                repeats: int = 3, vocab_size: int | None = None, seed: int = 0,
                progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    if output_len < 2:
        raise ValueError(f"output_len must be at least 2 to time the decode, got {output_len}")
    longest = max(prompt_lens) + output_len + 1
    engine = build_engine(model, EngineShape(concurrency=1, max_seq_len=longest,
                                             max_tokens_per_tick=512))
    vocab = vocab_size or engine.model_config.vocab_size
    rows = []
    try:
        for n, length in enumerate(tqdm(prompt_lens, desc="prompt lengths",
                                        disable=not progress, leave=False)):
            prompts = random_requests(repeats + 1, length, output_len, vocab,
                                      seed=seed + 1000 * n)
            c0 = compile_seconds()
            time_one(engine, prompts[0].prompt_token_ids, output_len)
            c1 = compile_seconds()
            timed = [time_one(engine, p.prompt_token_ids, output_len) for p in prompts[1:]]
            prefill = float(np.median([t[0] for t in timed]))
            decode = float(np.median([t[1] for t in timed]))
            rows.append({"prompt_len": length, "output_len": output_len, "repeats": repeats,
                         "prefill_ms": round(prefill * 1e3, 3),
                         "prefill_tokens_per_s": round(length / prefill, 1),
                         "decode_ms_per_token": round(decode * 1e3, 3),
                         "decode_tokens_per_s": round(1.0 / decode, 1) if decode else None,
                         "compile_s": round(c1 - c0, 3),
                         "compile_s_in_window": round(compile_seconds() - c1, 3)})
    finally:
        engine.close()
    return rows
