"""The decode step against its yardsticks: `metrale bench step`.

Three figures for one batch-B decode step at context C, on the same weights, in one run:

* the engine's step: the jitted ragged step the tick loop dispatches (paged K/V, its own
  block-table bucket, sampling with top-n logprobs), timed from dispatch to tokens on the host;
* the dense ceiling: the same model code with attention swapped for a plain `dot_general`
  over a contiguous head-major cache `[B, kv_heads, L, head_dim]` per layer, the fastest
  layout XLA has for it; paging, block tables and the ragged layout cost nothing there;
* the read-bandwidth floor: the bytes a decode step must read (every weight once, each row's
  K/V) over this machine's measured streaming read bandwidth.

Beside them, the engine's step with every row sampling at temperature 0.8, top-p 0.9 and
top-k 50 (the filters' cost), and a scaling table: the engine's step at several real
contexts, each with the block-table width its context fills and with the widest one, to show
that the cost follows the real context rather than the padded width.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.bench.overhead import BLOCK, make_engine
from metrale_jax.bench.roofline import decode_cost, peak_bandwidth
from metrale_jax.loader.resolve import load
from metrale_jax.model.caches import DeviceCaches, kv_cache_dtype
from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.inputs import RowChunk, build_step_batch
from metrale_jax.runner.penalties import history_width
from metrale_jax.runner.sampler import make_sampling_arrays
from metrale_jax.runner.slot_tables import allocate_slot_tables
from metrale_jax.runner.step import StepOptions, StepRunner
from metrale_jax.types import RowSampling
from pallas_kernels.backend import KernelOps

# Timed steps per figure, repeated in interleaved rounds; medians.
ROUNDS = 3


def _filtered():
    # No logprobs: the greedy rows ask for none either, so the two differ by the filters only.
    return RowSampling(temperature=0.8, top_p=0.9, top_k=50, seed=1, logprobs=False)


def _median_step_s(run, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class EngineStep:
    """The engine's own jitted step on its own caches, at one (batch, context, width)."""

    def __init__(self, engine, batch: int, context: int, table_blocks: int | None = None,
                 sampling=None):
        """`table_blocks`: the block-table width (default: the engine's own bucket);
        `sampling`: every row's `RowSampling` (default: greedy)."""
        self.runner = engine.runner
        bs = engine.engine_config.block_size
        owned = -(-(context + 1) // bs)
        rows = [RowChunk([7], context, list(range(1 + i * owned, 1 + (i + 1) * owned)), i + 1)
                for i in range(batch)]
        shape = (self.runner.ladders.shape_for(batch, batch, 1, owned) if table_blocks is None
                 else StepShape(batch, batch, 1, max(table_blocks, owned)))
        self.shape = shape
        self.arrays = build_step_batch(rows, shape, bs)
        rows_sampling = [sampling] * batch if sampling is not None else []
        self.sampling = make_sampling_arrays(rows_sampling, shape.rows)
        self.options = StepOptions(num_top=engine.engine_config.max_logprobs)
        self()  # compile outside the timed window

    def __call__(self) -> None:
        r = self.runner
        out, r.caches, r.tables = r.step(self.arrays, self.sampling, None, r.caches, r.tables,
                                         self.options)
        np.asarray(out.sampled.tokens)


class DenseStep:
    """The same model and sampler with attention over contiguous head-major streams."""

    def __init__(self, model, engine_config, batch: int, context: int):
        cfg = model.cfg
        # One "block" per row, as wide as the stream: slot_mapping then says (row, position).
        length = context + 1
        ops = DenseOps()
        for block in model.blocks:
            if block.kind == "A":
                block.mixer.ops = ops
        self.step = StepRunner(model)
        # Plain XLA's own K/V dtype (float32 on the CPU, where its bf16 mat-vecs are slow).
        kv_dt = jnp.dtype(kv_cache_dtype(
            cfg, dataclasses.replace(engine_config, kernel_backend="xla")))
        stream = (batch, cfg.num_kv_heads, length, cfg.head_dim)
        kv = tuple((jnp.zeros(stream, kv_dt), jnp.zeros(stream, kv_dt))
                   for _ in cfg.attention_layers)
        slots = batch + 1
        conv = tuple(jnp.zeros((slots, cfg.conv_kernel - 1, cfg.conv_dim), cfg.dtype)
                     for _ in cfg.mamba_layers)
        ssm = tuple(jnp.zeros((slots, cfg.mamba_num_heads, cfg.mamba_head_dim,
                               cfg.ssm_state_size), jnp.float32) for _ in cfg.mamba_layers)
        self.caches = jax.device_put(DeviceCaches(kv=kv, conv=conv, ssm=ssm))
        self.tables = jax.device_put(allocate_slot_tables(
            slots, slots, history_width(engine_config.max_seq_len), engine_config.max_logit_bias))
        rows = [RowChunk([7], context, [i], i + 1) for i in range(batch)]
        self.arrays = build_step_batch(rows, StepShape(batch, batch, 1, 1), length)
        self.sampling = make_sampling_arrays([], batch)
        self.options = StepOptions(num_top=engine_config.max_logprobs)
        self()

    def __call__(self) -> None:
        out, self.caches, self.tables = self.step(self.arrays, self.sampling, None, self.caches,
                                                  self.tables, self.options)
        np.asarray(out.sampled.tokens)


@dataclasses.dataclass(frozen=True)
class DenseOps(KernelOps):
    """Attention over `[rows, kv_heads, L, head_dim]` streams: row r's "block table" is [r]
    and its block is the whole stream, so slot_mapping = r * L + position."""

    def write_kv_pages(self, k_cache, v_cache, k, v, slot_mapping):
        length = k_cache.shape[2]
        row, pos = slot_mapping // length, slot_mapping % length
        return (k_cache.at[row, :, pos].set(k.astype(k_cache.dtype)),
                v_cache.at[row, :, pos].set(v.astype(v_cache.dtype)))

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, q_positions,
                        *, scale, soft_cap=None, sliding_window=None):
        s, nq, h, d = q.shape
        kvh = k_cache.shape[1]
        qg = q.astype(jnp.float32).reshape(s, kvh, h // kvh, d) * scale  # decode: nq == 1
        scores = jnp.einsum("skgd,skld->skgl", qg, k_cache.astype(jnp.float32))
        visible = jnp.arange(k_cache.shape[2])[None, :] < context_lens[:, None]
        scores = jnp.where(visible[:, None, None], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("skgl,skld->skgd", probs, v_cache.astype(jnp.float32))
        return out.reshape(s, nq, h, d).astype(q.dtype)


def step_benchmark(model: str | None, batch: int, context: int, steps: int,
                   scaling_contexts: tuple[int, ...], dtype: str | None = None) -> dict:
    """Engine step, dense ceiling and bandwidth floor in interleaved rounds; scaling table."""
    engine = make_engine(model, batch, False, dtype=dtype)
    try:
        cfg = engine.model_config
        widest = engine.engine_config.max_blocks_per_seq
        dense = DenseStep(load(model, dtype).model, engine.engine_config, batch, context)
        ours = EngineStep(engine, batch, context)
        filtered = EngineStep(engine, batch, context, sampling=_filtered())
        runs = {"engine": [], "dense": [], "filtered": []}
        for _ in range(ROUNDS):
            runs["engine"].append(_median_step_s(ours, steps))
            runs["dense"].append(_median_step_s(dense, steps))
            runs["filtered"].append(_median_step_s(filtered, steps))
        engine_s, dense_s, filtered_s = (float(np.median(v)) for v in runs.values())
        bandwidth = peak_bandwidth()
        cost = decode_cost(cfg, batch, context)
        floor_s = cost["bytes"] / bandwidth["read_bytes_per_s"]
        scaling = []
        for ctx in scaling_contexts:
            exact, wide = EngineStep(engine, batch, ctx, 0), EngineStep(engine, batch, ctx, widest)
            # exact: the blocks the context fills; widest: max_seq_len's (as the engine pads)
            t_exact = float(np.median([_median_step_s(exact, steps) for _ in range(2)]))
            t_wide = float(np.median([_median_step_s(wide, steps) for _ in range(2)]))
            scaling.append({"context": ctx, "exact_table_blocks": exact.shape.max_blocks,
                            "exact_ms": round(t_exact * 1e3, 2), "widest_table_blocks":
                            wide.shape.max_blocks, "widest_ms": round(t_wide * 1e3, 2),
                            "widest_over_exact": round(t_wide / t_exact, 3)})
    finally:
        engine.close()
    return {"batch": batch, "context": context, "block_size": BLOCK,
            "model_dtype": cfg.dtype, "engine_step_ms": round(engine_s * 1e3, 2),
            "engine_table_blocks": ours.shape.max_blocks,
            "dense_ceiling_ms": round(dense_s * 1e3, 2),
            "bandwidth_floor_ms": round(floor_s * 1e3, 2),
            "engine_over_dense": round(engine_s / dense_s, 3),
            "engine_over_floor": round(engine_s / floor_s, 3),
            "filtered_step_ms": round(filtered_s * 1e3, 2),
            "filtered_over_greedy": round(filtered_s / engine_s, 3),
            "filtered_sampling": "every row temperature 0.8, top_p 0.9, top_k 50",
            "step_bytes": cost["bytes"], "read_bytes_per_s": bandwidth["read_bytes_per_s"],
            "steps_per_round": steps, "rounds": ROUNDS, "scaling": scaling}

