"""Host <-> device: pick a bucket, pack rows, run the jitted step, read results back.

The runner owns the device caches and the compiled step; it knows nothing of requests.
A caller hands it `ScheduledRow`s (a chunk of one sequence plus its sampling settings) and
gets numpy `RowResult`s per row: the contract in `metrale_jax.types`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.config import EngineConfig
from metrale_jax.model.caches import (DeviceCaches, allocate_caches, kv_cache_dtype,
                                      num_kv_blocks)
from metrale_jax.model.hybrid import HybridLM
from metrale_jax.runner.buckets import BucketLadders, CompileCounter, StepShape
from metrale_jax.runner.inputs import build_step_batch
from metrale_jax.runner.progress import WarmupProgress
from metrale_jax.runner.sampler import make_sampling_arrays, needs_penalties
from metrale_jax.runner.step import StepOptions, StepRunner
from metrale_jax.runner.swap import gather_sequence, scatter_sequence
from metrale_jax.types import RowResult, ScheduledRow, StepHandle


def _copy_slots(caches: DeviceCaches, src: jax.Array, dst: jax.Array) -> DeviceCaches:
    return dataclasses.replace(
        caches, conv=tuple(c.at[dst].set(c[src]) for c in caches.conv),
        ssm=tuple(s.at[dst].set(s[src]) for s in caches.ssm))


def _ceil_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length() if n > 0 else 0


class ModelRunner:
    def __init__(self, model: HybridLM, engine: EngineConfig, counter: CompileCounter | None = None,
                 num_snapshot_slots: int = 0):
        self.engine = engine
        self.model_config = model.cfg
        self.ladders = BucketLadders.from_config(engine)
        model.use_kernels(engine.kernel_backend)  # before the split: the choice is static
        self.step = StepRunner(model, counter)
        self.num_blocks = num_kv_blocks(model.cfg, engine)
        # Slot 0 is the null slot, then one per running sequence (its SSM state and its
        # future-token cell), then the SSM snapshot slots.
        self.num_seq_slots = engine.max_batch_size + 1
        self.num_slots = self.num_seq_slots + (num_snapshot_slots if self.has_ssm else 0)
        self._allocate_caches()
        self._copy_slots = jax.jit(_copy_slots, donate_argnums=(0,))

    def _allocate_caches(self) -> None:
        # Committed to the device like every step's outputs: jit keys its cache on that, so
        # fresh arrays would make the first shape compile twice (once more mid-serving).
        cfg, engine, device = self.model_config, self.engine, jax.devices()[0]
        self.caches = jax.device_put(allocate_caches(
            cfg, self.num_blocks, engine.block_size,
            self.num_slots if self.has_ssm else 1, kv_cache_dtype(cfg, engine)), device)
        self.future = jax.device_put(jnp.zeros((self.num_slots,), jnp.int32), device)

    def recover(self) -> bool:
        """After a step raised: True when the caches were lost and are now re-allocated
        empty, False when they are intact. They are lost when the failed step consumed them
        (donated buffers deleted) or produced them (reading them raises the step's error)."""
        leaves = jax.tree.leaves((self.caches, self.future))
        try:
            if not any(leaf.is_deleted() for leaf in leaves):
                jax.block_until_ready(leaves)
                return False
        except Exception:  # noqa: BLE001 - any runtime error here means the state is gone
            pass
        self._allocate_caches()
        return True

    @property
    def has_ssm(self) -> bool:
        return bool(self.model_config.mamba_layers)

    @property
    def counter(self) -> CompileCounter:
        return self.step.counter

    def shape_for(self, rows: Sequence[ScheduledRow]) -> StepShape:
        bs = self.engine.block_size
        return self.ladders.shape_for(
            num_tokens=sum(len(r.tokens) for r in rows), num_rows=len(rows),
            widest_chunk=max(len(r.tokens) for r in rows),
            most_blocks=max(-(-r.end // bs) for r in rows))

    def run(self, rows: Sequence[ScheduledRow]) -> list[RowResult]:
        return self.collect(self.dispatch(rows))

    def dispatch(self, rows: Sequence[ScheduledRow]) -> "StepHandle":
        """Start the step on the device and return at once (JAX dispatches asynchronously)."""
        shape = self.shape_for(rows)
        batch = build_step_batch(rows, shape, self.engine.block_size)
        samplings = [r.sampling for r in rows]
        penalties = needs_penalties(samplings)
        history = max((len(s.prompt_ids) + len(s.output_ids) for s in samplings if
                       s.uses_penalties), default=0)
        bias = max((len(s.logit_bias) for s in samplings), default=0)
        sampling = make_sampling_arrays(samplings, shape.rows, _ceil_pow2(history) if penalties
                                        else 0, _ceil_pow2(bias))
        want_prompt = any(len(r.targets) for r in rows)
        targets = None
        if want_prompt:
            flat = np.full(shape.tokens, -1, np.int32)
            cursor = 0
            for r in rows:
                if len(r.targets):
                    flat[cursor:cursor + len(r.targets)] = r.targets
                cursor += len(r.tokens)
            targets = flat
        options = StepOptions(num_top=self.engine.max_logprobs, penalties=penalties)
        out, self.caches, self.future = self.step(batch, sampling, targets, self.caches,
                                                  self.future, options)
        for leaf in jax.tree.leaves(self._wanted(rows, out)):
            leaf.copy_to_host_async()  # start the read-back while the host plans ahead
        return StepHandle(list(rows), out)

    @staticmethod
    def _wanted(rows: Sequence[ScheduledRow], out) -> tuple:
        """What the host reads back: prompt scores only when some row asked for them."""
        return out.sampled, out.ranks, out.prompt if any(len(r.targets) for r in rows) else None

    def collect(self, handle: "StepHandle") -> list[RowResult]:
        """Wait for a dispatched step and unpack its results per row."""
        sampled, ranks, prompt = jax.device_get(self._wanted(handle.rows, handle.out))
        return self._unpack(handle.rows, sampled, ranks, prompt)

    def gather(self, blocks: Sequence[int], slot: int | None) -> dict[str, np.ndarray]:
        """One sequence's KV pages (and SSM slot) copied to the host, for a spill."""
        return gather_sequence(self.caches, blocks, slot)

    def scatter(self, arrays, blocks: Sequence[int], slot: int | None) -> None:
        """A spilled sequence's state written back into (new) blocks and slot."""
        self.caches = scatter_sequence(self.caches, arrays, blocks, slot)

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy SSM conv/state rows `src` -> `dst` (snapshots), ordered after every step
        already dispatched."""
        if self.has_ssm and len(src):
            self.caches = self._copy_slots(self.caches, jnp.asarray(src, jnp.int32),
                                           jnp.asarray(dst, jnp.int32))

    @staticmethod
    def _unpack(rows: Sequence[ScheduledRow], s, ranks, prompt) -> list[RowResult]:
        results, cursor = [], 0
        for i, r in enumerate(rows):
            n = len(r.tokens)
            res = RowResult(token=int(s.tokens[i]), logprob=float(s.logprobs[i]),
                            rank=int(ranks[i]),
                            top_ids=s.top_ids[i], top_logprobs=s.top_logprobs[i])
            if prompt is not None and len(r.targets):
                span = slice(cursor, cursor + n)
                res.prompt_logprobs = prompt.target_logprobs[span]
                res.prompt_ranks = prompt.target_ranks[span]
                res.prompt_top_ids = prompt.top_ids[span]
                res.prompt_top_logprobs = prompt.top_logprobs[span]
            results.append(res)
            cursor += n
        return results

    def warmup(self, shapes: Sequence[StepShape] | None = None, *, progress: bool = True,
               ) -> int:
        """Compile the step for `shapes` (default: every bucket combination) with a batch of
        padding only, showing progress; returns how many shapes were compiled."""
        shapes = list(shapes) if shapes is not None else self.warmup_shapes()
        with WarmupProgress(len(shapes), enabled=progress) as bar:
            for shape in shapes:
                empty = build_step_batch([], shape, self.engine.block_size)
                sampling = make_sampling_arrays([], shape.rows, 0, 0)
                out, self.caches, self.future = self.step(
                    empty, sampling, None,
                    self.caches, self.future, StepOptions(num_top=self.engine.max_logprobs))
                jax.block_until_ready(out.sampled.tokens)
                bar.advance()
        return len(shapes)

    def warmup_shapes(self) -> list[StepShape]:
        lad = self.ladders
        shapes = list(lad.decode_shapes())
        for q in lad.query:
            if q == 1:
                continue
            for t in lad.tokens:
                for s in lad.prefill_rows:
                    if t >= q and t >= s:
                        shapes.extend(StepShape(t, s, q, b) for b in lad.blocks)
        return shapes
