"""Cost of one batch-64 sampling step: greedy against filtered sampling (top-p + top-k,
top-p alone, min-p), through `sampler.sample(..., num_top=20)`, and in the same run the
previous sort-based filter and the previous draw (`jax.random.categorical`, whose argmax
XLA:CPU runs as an unvectorised paired reduction; `sampler.gumbel_max` draws the same
tokens).

Rounds are interleaved (every case once per round) and medians reported, so that load
from other processes on a shared machine hits all cases alike. Writes
benchmarks/results/sampling.json. Run: `python -m metrale_jax.bench.sampling
[--rounds N] [--vocab 8192 16384]`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.bench.results import RESULTS_DIR, write_json
from metrale_jax.runner import sampler
from metrale_jax.runner.sampler import (RowSampling, SamplingArrays, SampleResult,
                                        _mask_vocab, _top_logprobs, filter_logits,
                                        filter_logits_reference, make_sampling_arrays,
                                        row_keys, sample)

ROWS = 64
NUM_TOP = 20
TEMP = 0.8


def _sort_based_sample(logits, params: SamplingArrays, *, num_top: int) -> SampleResult:
    """`sample` as it was before the sort-free filters (apply_filters=True, no penalties,
    no bias): the reference filter over the full row, then the full-row draw."""
    logits = _mask_vocab(logits, None)
    raw_logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = params.temperature <= 0.0

    def draw(_):
        scaled = logits / jnp.where(is_greedy, 1.0, params.temperature)[:, None]
        scaled = filter_logits_reference(scaled, params.top_k, params.top_p, params.min_p)
        keys = row_keys(params.seeds, params.counters)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(is_greedy, greedy, drawn)

    tokens = jax.lax.cond(jnp.all(is_greedy), lambda _: greedy, draw, None)
    chosen = jnp.take_along_axis(raw_logp, tokens[:, None], axis=-1)[:, 0]
    vals, ids = _top_logprobs(raw_logp, num_top)
    return SampleResult(tokens=tokens, logprobs=chosen, top_ids=ids, top_logprobs=vals)


def _logits(rng: np.random.Generator, vocab: int, shape: str) -> np.ndarray:
    """'peaked': LM-like, a few tokens hold most of the mass (normal * 4 plus a boosted
    head); 'flat': normal * 1, a high-entropy step whose top-p 0.9 nucleus spans thousands
    of tokens."""
    x = rng.standard_normal((ROWS, vocab)).astype(np.float32)
    if shape == "flat":
        return x
    x *= 4.0
    head = rng.integers(0, vocab, size=(ROWS, 8))
    x[np.arange(ROWS)[:, None], head] += rng.uniform(4, 10, size=(ROWS, 8)).astype(np.float32)
    return x


# name -> (RowSampling kwargs, logits shape)
CASES = {
    "greedy": (dict(temperature=0.0), "peaked"),
    "temperature_only": (dict(temperature=TEMP), "peaked"),
    "top_p0.9_top_k50": (dict(temperature=TEMP, top_p=0.9, top_k=50), "peaked"),
    "top_p0.9": (dict(temperature=TEMP, top_p=0.9), "peaked"),
    "top_p0.9_flat": (dict(temperature=TEMP, top_p=0.9), "flat"),
    "min_p0.05": (dict(temperature=TEMP, min_p=0.05), "peaked"),
}


def run(vocab: int, rounds: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    logits = {s: jnp.asarray(_logits(rng, vocab, s)) for s in ("peaked", "flat")}
    new = jax.jit(sample, static_argnames=("num_top", "apply_filters", "vocab_size"))
    old = jax.jit(_sort_based_sample, static_argnames=("num_top",))
    # `sample` traced with the previous draw: a distinct function object, so jit traces it
    # afresh (under the patch) rather than reuse `new`'s trace.
    categorical_draw = jax.jit(functools.partial(sample),
                               static_argnames=("num_top", "apply_filters", "vocab_size"))
    fns, kept = {}, {}
    for name, (kw, shape) in CASES.items():
        rows = [RowSampling(seed=i, counter=3, **kw) for i in range(ROWS)]
        params = make_sampling_arrays(rows, ROWS)
        filt = any(r.uses_filters for r in rows)
        x = logits[shape]
        fns[name] = lambda x=x, p=params, f=filt: new(x, p, num_top=NUM_TOP, apply_filters=f)
        if kw["temperature"] > 0:
            fns[name + "/categorical_draw"] = lambda x=x, p=params, f=filt: categorical_draw(
                x, p, num_top=NUM_TOP, apply_filters=f)
        if filt:
            fns[name + "/sort_based"] = lambda x=x, p=params: old(x, p, num_top=NUM_TOP)
            masked = filter_logits(x / TEMP, params.top_k, params.top_p, params.min_p)
            kept[name] = float(jnp.mean(jnp.sum(jnp.isfinite(masked), -1)))
    previous_draw = mock.patch.object(sampler, "gumbel_max", jax.vmap(jax.random.categorical))
    for name, f in fns.items():  # compile and warm; the previous draw's under its patch
        with previous_draw if name.endswith("/categorical_draw") else contextlib.nullcontext():
            jax.block_until_ready(f())
            jax.block_until_ready(f())
    for name, f in fns.items():
        if name.endswith("/categorical_draw"):  # the same tokens either way
            np.testing.assert_array_equal(np.asarray(f().tokens),
                                          np.asarray(fns[name.split("/")[0]]().tokens))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    g = med["greedy"]
    cases = []
    for name, ms in med.items():
        base = name.split("/")[0]
        cases.append({"case": name, "logits": CASES[base][1], "median_ms": ms,
                      "vs_greedy": ms / g, "added_ms": ms - g,
                      "mean_kept_tokens": kept.get(base)})
    return {"vocab": vocab, "rows": ROWS, "num_top": NUM_TOP, "rounds": rounds,
            "cases": cases}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--out", default=str(RESULTS_DIR / "sampling.json"))
    args = ap.parse_args(argv)
    results = []
    for v in args.vocab:
        res = run(v, args.rounds)
        results.append(res)
        print(f"vocab {v}, batch {ROWS}, num_top {NUM_TOP}, {args.rounds} rounds (medians)")
        for c in res["cases"]:
            k = "" if c["mean_kept_tokens"] is None else f"  kept/row {c['mean_kept_tokens']:.0f}"
            print(f"  {c['case']:<32} {c['median_ms']:8.2f} ms  x{c['vs_greedy']:6.2f}"
                  f"  +{c['added_ms']:7.2f} ms{k}")
    command = " ".join(["python -m metrale_jax.bench.sampling"] + (sys.argv[1:] if argv is None
                                                                   else argv))
    path = write_json(args.out, {"results": results}, command)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
