"""Engine overhead: decode tokens/s delivered through the tick loop against the bare jitted
step at the same batch and context, pipeline on and off.

The three are interleaved round by round so the machine's noise hits them alike; medians.
The bare step gets its inputs from the host every step and is pipelined the way the engine
is (step N+1 dispatched before step N's tokens are read), with no scheduling in between:
the ratio is what the scheduler, detokenizer and bookkeeping cost.
"""

from __future__ import annotations

import time

import numpy as np

from metrale_jax.runner.inputs import RowChunk, build_step_batch
from metrale_jax.runner.sampler import make_sampling_arrays
from metrale_jax.runner.step import StepOptions

# Decoding from 520 to at most 900 tokens keeps one block-table bucket (64 blocks of 16):
# no compilation inside the timed windows. Models built for fewer than 1024 positions get
# both scaled down alike.
CONTEXT = 520
END = 900
SEQ = 1024
BLOCK = 16


def span(engine) -> tuple[int, int]:
    """(context every row starts decoding at, the most tokens a row may reach)."""
    scale = min(1.0, engine.engine_config.max_seq_len / SEQ)
    return int(CONTEXT * scale), int(END * scale)


def make_engine(model: str | None, batch: int, pipeline: bool, **overrides):
    """An engine with room for `batch` sequences of SEQ tokens each."""
    from metrale_jax.engine import LLMEngine

    return LLMEngine(model, max_batch_size=max(batch, 1), max_tokens_per_tick=SEQ,
                     max_seq_len=SEQ, block_size=BLOCK,
                     num_kv_blocks=max(batch, 1) * SEQ // BLOCK + 1, enable_pipeline=pipeline,
                     **overrides)


def decoding_engine(model: str | None, batch: int) -> tuple[object, list]:
    """An engine with `batch` sequences all decoding from the same context."""
    from metrale_jax.request import SamplingParams

    engine = make_engine(model, batch, True)
    context, end = span(engine)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=end - context, ignore_eos=True)
    reqs = [engine.make_request({"prompt_token_ids": [3 + (i + j) % (vocab - 3)
                                                      for j in range(context)]}, params)
            for i in range(batch)]
    for r in reqs:
        engine.submit(r)
    while len(engine.core.active) < batch or engine.core.prefilling:
        engine.step()
    return engine, reqs


def engine_decode_tps(engine, reqs: list, pipeline: bool, ticks: int) -> float:
    """Tokens/s over `ticks` ticks with the pipeline lever set (switching it compiles
    nothing); the first ticks after the switch are not timed."""
    engine.levers.set(pipeline_enabled=pipeline)
    for _ in range(3):
        engine.step()
    count = lambda: sum(len(s.output_ids) for r in reqs for s in r.sequences)  # noqa: E731
    start_tokens = count()
    t0 = time.perf_counter()
    for _ in range(ticks):
        engine.step()
    engine.drain()
    return (count() - start_tokens) / (time.perf_counter() - t0)


class BareStep:
    """The jitted step alone at the engine's shapes, on its own caches."""

    def __init__(self, model: str | None, batch: int):
        self.engine = make_engine(model, batch, False)
        runner = self.engine.runner
        context, end = span(self.engine)
        # Each row owns the blocks its context fills, as the engine's sequences do; the table
        # is padded to the bucket that covers `end` with the null block, as the engine's is
        # (gathering real blocks costs more than gathering the null block again).
        owned, bucket = -(-(context + 1) // BLOCK), -(-end // BLOCK)
        rows = [RowChunk([7], context, list(range(1 + i * owned, 1 + (i + 1) * owned)), i + 1)
                for i in range(batch)]
        shape = runner.ladders.shape_for(batch, batch, 1, bucket)
        self.batch, self.context = batch, context
        # Host arrays, sent every step as the engine sends its own (one packed transfer).
        self.arrays = build_step_batch(rows, shape, BLOCK)
        self.sampling = make_sampling_arrays([], shape.rows)
        self.options = StepOptions(num_top=self.engine.engine_config.max_logprobs)
        self.tokens_per_s(3)

    def tokens_per_s(self, steps: int) -> float:
        runner = self.engine.runner
        t0 = time.perf_counter()
        previous = None
        for _ in range(steps):
            out, runner.caches, runner.tables = runner.step(
                self.arrays, self.sampling, None, runner.caches, runner.tables, self.options)
            if previous is not None:
                np.asarray(previous.sampled.tokens)
            previous = out
        np.asarray(previous.sampled.tokens)
        return self.batch * steps / (time.perf_counter() - t0)

    def close(self) -> None:
        self.engine.close()


def overhead(model: str | None, batch: int, ticks: int, rounds: int) -> dict:
    """Bare step, engine with the pipeline on, engine with it off; medians of `rounds`."""
    bare = BareStep(model, batch)
    context, end = span(bare.engine)
    if 3 + 2 * rounds * (ticks + 3) > end - context:
        bare.close()
        raise ValueError(f"{rounds} rounds of {ticks} ticks decode past {end} tokens, where "
                         f"this model's block-table bucket ends; use fewer")
    engine, reqs = decoding_engine(model, batch)
    runs: dict[str, list[float]] = {"bare": [], "on": [], "off": []}
    try:
        for _ in range(rounds):
            runs["bare"].append(bare.tokens_per_s(ticks))
            runs["on"].append(engine_decode_tps(engine, reqs, True, ticks))
            runs["off"].append(engine_decode_tps(engine, reqs, False, ticks))
    finally:
        engine.close()
        bare.close()
    med = {k: float(np.median(v)) for k, v in runs.items()}
    return {"batch": batch, "context_tokens": context,
            "bare_step_tokens_per_s": round(med["bare"], 1),
            "engine_tokens_per_s_pipeline_on": round(med["on"], 1),
            "engine_tokens_per_s_pipeline_off": round(med["off"], 1),
            "ratio_pipeline_on": round(med["on"] / med["bare"], 3),
            "ratio_pipeline_off": round(med["off"] / med["bare"], 3),
            "rounds": rounds, "ticks_per_round": ticks}
