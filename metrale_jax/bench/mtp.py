"""MTP speculative decoding, side by side: delivered tokens/s with speculation off, on, and
gated (the MTP gate on auto), per batch size, on one model, greedy.

Each mode gets its own engine (off: no MTP pages, the plain step only). Every engine warms
up (every variant compiled, as `metrale serve` does: a compile inside a measured tick would
also mislead the gate) and runs the workload once, then the modes take turns for `rounds`
rounds, so a slow moment of a shared machine lands on all of them; a mode's figure is its
best round. A round repeats the workload until it has run `min_round_s` (at batch 1 one
workload is ~0.1 s, where a stray millisecond is a percent, and a gate probe of a few ticks
lands in one round and not the next: one round moved gated / on between 0.79 and 0.97).
Prompts
are real text (the built-in model writes Shakespeare; random ids would draft nothing
useful). Acceptance per draft depth comes from the engine's counters.
"""

from __future__ import annotations

import time

from metrale_jax.request import SamplingParams

MODES = {"off": None, "on": "on", "gated": "auto"}
PROMPTS = ("ROMEO:\n", "JULIET:\nO Romeo, Romeo", "KING HENRY:\nOnce more unto the breach",
           "HAMLET:\nTo be, or not to be", "First Citizen:\nBefore we proceed any further",
           "MACBETH:\nIs this a dagger", "PORTIA:\nThe quality of mercy", "LEAR:\nBlow, winds")


def _engine(model: str | None, batch: int, max_len: int, depth: int, gate: str | None):
    from metrale_jax.engine import LLMEngine

    spec = None if gate is None else {"method": "mtp", "num_speculative_tokens": depth,
                                      "gate": gate}
    return LLMEngine(model, max_batch_size=batch, max_seq_len=max_len,
                     max_tokens_per_tick=max(256, batch * (depth + 1)), enable_swap=False,
                     speculative_config=spec)


def _run(engine, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    reqs = [engine.make_request({"prompt_token_ids": p}, SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True)) for p in prompts]
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    while not all(r.finished for r in reqs):
        engine.step()
    engine.drain()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.sequences[0].output_ids) for r in reqs)
    return elapsed, tokens


def _round(engine, prompts: list[list[int]], output_len: int,
           min_round_s: float) -> tuple[float, int]:
    """The workload, again and again until `min_round_s` have passed: (seconds, tokens)."""
    elapsed = tokens = 0
    while elapsed < min_round_s or not tokens:
        e, t = _run(engine, prompts, output_len)
        elapsed, tokens = elapsed + e, tokens + t
    return elapsed, tokens


def _acceptance(before: dict, after: dict, depth: int) -> list[float | None]:
    out = []
    for d in range(depth):
        drafted = after.get(f"spec_decode_num_drafts_per_pos_{d}", 0) - \
            before.get(f"spec_decode_num_drafts_per_pos_{d}", 0)
        accepted = after.get(f"spec_decode_num_accepted_tokens_per_pos_{d}", 0) - \
            before.get(f"spec_decode_num_accepted_tokens_per_pos_{d}", 0)
        out.append(round(accepted / drafted, 4) if drafted else None)
    return out


def mtp_benchmark(model: str | None, batches: list[int], output_len: int, rounds: int,
                  depth: int, min_round_s: float = 1.0) -> dict:
    from metrale_jax.loader.resolve import load_tokenizer

    tok = load_tokenizer(model)
    encoded = [tok.encode(p) for p in PROMPTS]
    rows = []
    for batch in batches:
        prompts = [encoded[i % len(encoded)] for i in range(batch)]
        max_len = max(len(p) for p in prompts) + output_len + depth + 2
        engines = {m: _engine(model, batch, max_len, depth, g) for m, g in MODES.items()}
        for engine in engines.values():
            engine.runner.warmup(progress=False)
            _run(engine, prompts, output_len)
        best = {m: 0.0 for m in MODES}
        every = {m: [] for m in MODES}
        acceptance = {}
        for _ in range(rounds):
            for mode, engine in engines.items():
                before = dict(engine.core.tel.counters())
                elapsed, tokens = _round(engine, prompts, output_len, min_round_s)
                best[mode] = max(best[mode], tokens / elapsed)
                every[mode].append(round(tokens / elapsed, 1))
                if mode != "off":
                    acceptance[mode] = _acceptance(before, engine.core.tel.counters(), depth)
        gate = engines["gated"].core.gate
        better = max(best["on"], best["off"])
        rows.append({"batch": batch, "tok_s": {m: round(v, 1) for m, v in best.items()},
                     "on_over_off": round(best["on"] / best["off"], 3),
                     "gated_over_best": round(best["gated"] / better, 3),
                     "rounds_tok_s": every,
                     # The same ratios round by round (each round runs the modes in turn):
                     # how far the best-round figures above are from noise.
                     "round_ratios": {
                         "on_over_off": [round(n / f, 3) for n, f in zip(every["on"],
                                                                         every["off"])],
                         "gated_over_best": [round(g / max(n, f), 3) for g, n, f in zip(
                             every["gated"], every["on"], every["off"])]},
                     "acceptance_per_depth": acceptance,
                     "gate_figures": gate.figures(batch)})
        for engine in engines.values():
            engine.close()
    return {"output_len": output_len, "rounds": rounds, "min_round_s": min_round_s,
            "num_speculative_tokens": depth, "rows": rows}
