"""Host <-> device: pick a bucket, pack rows, run the jitted step, read results back.

The runner owns the device caches, the per-slot tables (runner/slot_tables.py) and the
compiled programs; it knows nothing of requests. A caller hands it `ScheduledRow`s (a chunk
of one sequence plus its sampling settings) and gets numpy `RowResult`s per row: the contract
in `metrale_jax.types`. Every program it can run has a fixed set of shapes, all compiled by
`warmup` and counted by the `CompileCounter`: the step per bucket, the slot-table writes, the
snapshot copy, the swap buckets and, with LoRA on, the adapter-slot write and the LoRA variant
of every step. Nothing compiles on the tick loop: `metrale serve` compiles some of them on a
thread beside serving (runner/background_warmup.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from metrale_jax.config import EngineConfig
from metrale_jax.model.caches import (DeviceCaches, allocate_caches, kv_cache_dtype,
                                      num_kv_blocks)
from metrale_jax.model.hybrid import HybridLM
from metrale_jax.model.packing import memory_budget, pack_linears
from metrale_jax.parallel.placement import TensorParallel
from metrale_jax.runner import hugepages
from metrale_jax.runner.background_warmup import BackgroundCompile, ReadyShapes
from metrale_jax.runner.buckets import BucketLadders, CompileCounter, StepShape, serve_first
from metrale_jax.runner.inputs import build_step_batch
from metrale_jax.runner.lora_slots import allocate_lora_slots, slot_arrays, write_slot
from metrale_jax.runner.program_store import ProgramStore
from metrale_jax.runner.progress import WarmupProgress
from metrale_jax.runner.penalties import history_width
from metrale_jax.runner.sampler import make_sampling_arrays
from metrale_jax.runner.slot_tables import (SlotBook, SlotWrite, allocate_slot_tables,
                                            write_bias, write_history)
from metrale_jax.runner.spec_rows import add_prompt_scores, spec_inputs, unpack_speculative
from metrale_jax.runner.step import StepOptions, StepRunner, abstract
from metrale_jax.runner.swap import block_bucket, gather_sequence, scatter_sequence, warm_buckets
from metrale_jax.types import RowResult, ScheduledRow, StepHandle

if TYPE_CHECKING:
    from metrale_jax.lora.weights import LoraWeights

# Slot copies travel in groups of this many pairs, padded with null copies 0 -> 0: one
# compiled program for any number of copies (the scheduler asks for one at a time).
COPY_WIDTH = 4


def _copy_slots(caches: DeviceCaches, src: jax.Array, dst: jax.Array) -> DeviceCaches:
    return dataclasses.replace(
        caches, conv=tuple(c.at[dst].set(c[src]) for c in caches.conv),
        ssm=tuple(s.at[dst].set(s[src]) for s in caches.ssm))


class ModelRunner:
    def __init__(self, model: HybridLM, engine: EngineConfig, counter: CompileCounter | None = None,
                 num_snapshot_slots: int = 0, devices: Sequence[jax.Device] | None = None):
        """`devices`: the device group this runner owns (data parallel: one engine per
        group); None: the first `tensor_parallel_size` devices."""
        self.engine = engine
        self.model_config = model.cfg
        self.ladders = BucketLadders.from_config(engine)
        ops = model.use_kernels(engine.kernel_backend)  # before the split: the choice is static
        # Tensor parallel (None: one device, today's path untouched): the kernels then run
        # per shard, and parameters, caches and tables live on the mesh.
        self.placement = TensorParallel.for_engine(engine.parallel, model.cfg, devices)
        if self.placement is not None:
            ops = model.use_ops(self.placement.kernel_ops(ops))
        model.logits_sharding = self.placement.replicated if self.placement else None
        # Speculative decoding drafts with the MTP modules, whose attention layers then get
        # KV pages too (same blocks, more layers); off, they get none.
        spec = engine.speculative
        if spec is not None:
            spec.check_model(model.cfg.num_mtp_modules, "the model")
        self.spec_depth = spec.num_speculative_tokens if spec is not None else 0
        # Decode rows on the CPU kernels read packed copies of the kernels (one device:
        # the copies are not sharded); the MTP modules' only while speculation can run.
        self.packed_bytes = 0
        if getattr(ops, "cpu_kernels", False) and self.placement is None:
            modules = [model.blocks, *([model.lm_head] if hasattr(model, "lm_head") else []),
                       *([model.mtp] if self.spec_depth else [])]
            tied = model if model.cfg.tie_word_embeddings else None
            self.packed_bytes = pack_linears(*modules, budget=memory_budget(), tied_head=tied)
        self._later: BackgroundCompile | None = None  # variants compiling beside serving
        self._ready: ReadyShapes | None = None  # what is compiled, while they do
        self.step = StepRunner(model, counter, store=ProgramStore.from_setting(
            engine.program_cache),
            store_tag=f"{model.cfg!r} {ops!r} packed={self.packed_bytes}",
            placement=self.placement)
        self.num_blocks = num_kv_blocks(model.cfg, engine, with_mtp=self.spec_depth > 0)
        # Slot 0 is the null slot, then one per running sequence (its SSM state and its
        # future-token cell), then the SSM snapshot slots.
        self.num_seq_slots = engine.max_batch_size + 1
        self.num_slots = self.num_seq_slots + (num_snapshot_slots if self.has_ssm else 0)
        self._width = history_width(engine.max_seq_len)
        self._allocate_caches()
        self._copy_slots = self._donating(_copy_slots, self._cache_shardings())
        self._write_history = self._donating(write_history, self._replicated())
        self._write_bias = self._donating(write_bias, self._replicated())
        self._init_lora()

    def _donating(self, fun, out_shardings):
        """`fun` jitted with its first argument donated; under tensor parallelism with its
        outputs' shardings declared, so they stay where the step expects them."""
        if out_shardings is None:
            return jax.jit(fun, donate_argnums=(0,))
        return jax.jit(fun, donate_argnums=(0,), out_shardings=out_shardings)

    def _cache_shardings(self):
        return None if self.placement is None else self.placement.cache_shardings(self.caches)

    def _replicated(self):
        return None if self.placement is None else self.placement.replicated

    def _on_devices(self, tree):
        """Host arrays committed where the runner keeps them: device 0, or every device of
        the mesh (tensor parallel; caches go through `placement.place_caches` instead)."""
        if self.placement is None:
            return jax.device_put(tree, jax.devices()[0])
        return self.placement.replicate(tree)

    def _init_lora(self) -> None:
        """With `engine.lora`: the adapter slots, all zero (runner/lora_slots.py). They are
        no step's donated output, so a failed step never loses them."""
        self.lora_slots = None
        if self.engine.lora is not None:
            self.lora_slots = self._on_devices(
                allocate_lora_slots(self.model_config, self.engine.lora))
            self._write_lora = self._donating(write_slot, self._replicated())

    @property
    def max_loras(self) -> int:
        """Adapter slots besides slot 0 (0: LoRA off)."""
        return self.engine.lora.max_loras if self.engine.lora is not None else 0

    def load_adapter(self, slot: int, weights: "LoraWeights") -> None:
        """Copy an adapter into device slot `slot` (1..max_loras), replacing what it held;
        ordered after every step dispatched before it. `LoraError` when it does not fit."""
        self._check_adapter_slot(slot)
        self._write_adapter(slot, weights)

    def unload_adapter(self, slot: int) -> None:
        """Zero device slot `slot`: a row that names it would run the base model."""
        self._check_adapter_slot(slot)
        self._write_adapter(slot, None)

    def _check_adapter_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"adapter slot {slot}: must be in 1..{self.max_loras}"
                             + ("" if self.max_loras else " (LoRA is off: engine.lora is None)"))

    def _write_adapter(self, slot: int, weights: "LoraWeights | None") -> None:
        a, b = slot_arrays(self.model_config, self.engine.lora, weights)  # checks first
        self.counter.record(("write_lora",))
        self.lora_slots = self._write_lora(self.lora_slots, np.int32(slot - 1), a, b)

    def _allocate_caches(self) -> None:
        # Committed to the device like every step's outputs: jit keys its cache on that, so
        # fresh arrays would make the first shape compile twice (once more mid-serving).
        cfg, engine, place = self.model_config, self.engine, self.placement
        caches = allocate_caches(
            cfg, self.num_blocks, engine.block_size,
            self.num_slots if self.has_ssm else 1, kv_cache_dtype(cfg, engine),
            with_mtp=self.spec_depth > 0,
            kv_heads=place.stored_kv_heads if place is not None else None)
        self.caches = (jax.device_put(caches, jax.devices()[0]) if place is None
                       else place.place_caches(caches))
        # Advised, not collapsed: collapsing the freshly zeroed pools runs at ~80 MB/s here
        # (3 s of start-up for the built-in model's 256 MiB), and a decode step reads a
        # small part of them; khugepaged collapses them in the background.
        hugepages.advise(self.caches, budget=0)
        self.tables = self._on_devices(allocate_slot_tables(
            self.num_slots, self.num_seq_slots, self._width, engine.max_logit_bias,
            self.spec_depth))
        # What the host believes each slot's history and bias hold: nothing, now.
        self.book = SlotBook(self.num_seq_slots, self._width, engine.max_logit_bias)

    def recover(self) -> bool:
        """After a step raised: True when the caches were lost and are now re-allocated
        empty, False when they are intact. They are lost when the failed step consumed them
        (donated buffers deleted) or produced them (reading them raises the step's error)."""
        leaves = jax.tree.leaves((self.caches, self.tables))
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

    def shape_for(self, rows: Sequence[ScheduledRow], speculative: bool = False) -> StepShape:
        bs = self.engine.block_size
        return self.ladders.shape_for(
            num_tokens=sum(len(r.tokens) for r in rows), num_rows=len(rows),
            widest_chunk=max(len(r.tokens) for r in rows),
            most_blocks=max(-(-r.reach // bs) for r in rows), speculative=speculative)

    def run(self, rows: Sequence[ScheduledRow], speculative: bool = False) -> list[RowResult]:
        return self.collect(self.dispatch(rows, speculative))

    def _options(self, speculative: bool, lora: bool = False) -> StepOptions:
        return StepOptions(num_top=self.engine.max_logprobs,
                           spec_depth=self.spec_depth if speculative else 0, lora=lora)

    def _uses_lora(self, rows: Sequence[ScheduledRow]) -> bool:
        """Whether the step needs the LoRA variant: some row names an adapter slot."""
        slots = [r.adapter_slot for r in rows]
        bad = [s for s in slots if not 0 <= s <= self.max_loras]
        if bad:
            raise ValueError(f"adapter slot {bad[0]}: must be in 0..{self.max_loras}")
        return any(slots)

    def dispatch(self, rows: Sequence[ScheduledRow], speculative: bool = False,
                 ) -> "StepHandle":
        """Start the step on the device and return at once (JAX dispatches asynchronously).
        `speculative`: the step that verifies the rows' drafts and drafts again."""
        if speculative and not self.spec_depth:
            raise ValueError("a speculative step needs speculative decoding configured")
        shape = self.shape_for(rows, speculative)
        lora = self._uses_lora(rows)
        if self._ready is not None:  # shapes still compile beside serving
            if self._later.ready.is_set():
                self._ready = None
            else:
                shape = self._ready.fit(shape, speculative, lora)
        batch = build_step_batch(rows, shape, self.engine.block_size)
        for write in self.book.plan(rows):
            self._write_slot(write)
        sampling = make_sampling_arrays([r.sampling for r in rows], shape.rows,
                                        slots=[r.ssm_slot for r in rows],
                                        history_lens=[r.end for r in rows])
        targets = None
        if any(len(r.targets) for r in rows):
            flat = np.full(shape.tokens, -1, np.int32)
            cursor = 0
            for r in rows:
                if len(r.targets):
                    flat[cursor:cursor + len(r.targets)] = r.targets
                cursor += len(r.tokens)
            targets = flat
        spec = spec_inputs(rows, shape.rows, self.spec_depth) if speculative else None
        mask = self.step.masks.for_rows([r.token_mask for r in rows], shape.rows,
                                        self.spec_depth + 1 if speculative else 1)
        out, self.caches, self.tables = self.step(
            batch, sampling, targets, self.caches, self.tables,
            self._options(speculative, lora), spec, mask,
            self.lora_slots if lora else None)
        for leaf in jax.tree.leaves(self._wanted(rows, out)):
            leaf.copy_to_host_async()  # start the read-back while the host plans ahead
        return StepHandle(list(rows), out, speculative)

    @staticmethod
    def _wanted(rows: Sequence[ScheduledRow], out) -> tuple:
        """What the host reads back: prompt scores only when some row asked for them."""
        return (out.sampled, out.ranks,
                out.prompt if any(len(r.targets) for r in rows) else None, out.spec)

    def collect(self, handle: "StepHandle") -> list[RowResult]:
        """Wait for a dispatched step and unpack its results per row."""
        sampled, ranks, prompt, spec = jax.device_get(self._wanted(handle.rows, handle.out))
        if spec is not None:
            return unpack_speculative(handle.rows, sampled, ranks, prompt, spec)
        return self._unpack(handle.rows, sampled, ranks, prompt)

    def _write_slot(self, write: SlotWrite) -> None:
        """A host write into one slot's tables, ordered before the step by data dependence."""
        slot = np.int32(write.slot)
        if write.history is not None:
            self.counter.record(("write_history",))
            self.tables = self._write_history(self.tables, slot, write.history)
        if write.bias_ids is not None:
            self.counter.record(("write_bias",))
            self.tables = self._write_bias(self.tables, slot, write.bias_ids, write.bias_values)

    def gather(self, blocks: Sequence[int], slot: int | None) -> dict[str, np.ndarray]:
        """One sequence's KV pages (and SSM slot) copied to the host, for a spill."""
        self.counter.record(("swap", block_bucket(len(blocks)), slot is not None))
        return gather_sequence(self.caches, blocks, slot, self.placement)

    def scatter(self, arrays, blocks: Sequence[int], slot: int | None) -> None:
        """A spilled sequence's state written back into (new) blocks and slot."""
        self.counter.record(("swap", block_bucket(len(blocks)), slot is not None))
        self.caches = scatter_sequence(self.caches, arrays, blocks, slot, self.placement)

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy SSM conv/state rows `src` -> `dst` (snapshots), ordered after every step
        already dispatched; in groups of COPY_WIDTH pairs, padded with null copies."""
        if not self.has_ssm:
            return
        for i in range(0, len(src), COPY_WIDTH):
            pairs = np.zeros((2, COPY_WIDTH), np.int32)
            group = slice(i, i + COPY_WIDTH)
            pairs[0, :len(src[group])], pairs[1, :len(dst[group])] = src[group], dst[group]
            self.counter.record(("copy_slots",))
            self.caches = self._copy_slots(self.caches, pairs[0], pairs[1])

    @staticmethod
    def _unpack(rows: Sequence[ScheduledRow], s, ranks, prompt) -> list[RowResult]:
        results = [RowResult(token=int(s.tokens[i]), logprob=float(s.logprobs[i]),
                             rank=int(ranks[i]), top_ids=s.top_ids[i],
                             top_logprobs=s.top_logprobs[i]) for i in range(len(rows))]
        add_prompt_scores(rows, results, prompt)
        return results

    def warmup(self, shapes: Sequence[StepShape] | None = None, *, progress: bool = True,
               speculative_later: bool = False, serve_early: bool = False,
               hold: threading.Event | None = None) -> int:
        """Compile the step for `shapes` (default: every bucket combination) with a batch of
        padding only, then every other program serving can run, showing progress; returns
        how many step variants were compiled (with LoRA on, each shape twice).
        `speculative_later`: the speculative variants compile on a thread of their own
        after this returns (`speculation_ready` says when they are done).
        `serve_early`: of the plain shapes only `serve_first`'s compile now, the others on
        that thread (before the speculative ones); until a batch's own shape is ready, it
        runs padded in a ready shape that covers it. `hold`: that thread starts once it is
        set (tests). On a mesh (tensor parallel) everything compiles now: its steps are
        not compiled ahead."""
        variants = (self._with_lora([(shape, False) for shape in shapes])
                    if shapes is not None else self.warmup_variants())
        if self.placement is not None:
            speculative_later = serve_early = False
        speculative_later = speculative_later or serve_early
        first = set(serve_first([v[0] for v in variants if not v[1]])) if serve_early else set()
        later = [v for v in variants
                 if (v[1] and speculative_later) or (serve_early and v[0] not in first)]
        variants = [v for v in variants if v not in later]
        with WarmupProgress(len(variants) + 1, enabled=progress) as bar:
            for shape, speculative, lora in variants:
                empty = build_step_batch([], shape, self.engine.block_size)
                spec = spec_inputs([], shape.rows, self.spec_depth) if speculative else None
                out, self.caches, self.tables = self.step(
                    empty, make_sampling_arrays([], shape.rows), None, self.caches,
                    self.tables, self._options(speculative, lora), spec, None,
                    self.lora_slots if lora else None)
                jax.block_until_ready(out.sampled.tokens)
                bar.advance()
            self._warm_side_programs()
            bar.advance()
        if later:
            self._ready = ReadyShapes(variants) if serve_early else None
            self._compile_later(later, hold)
        return len(variants)

    @property
    def speculation_ready(self) -> bool:
        """Whether the speculative step can run without compiling (always, unless its
        variants still compile beside serving: `warmup(speculative_later=True)`)."""
        return self._later is None or self._later.ready.is_set()

    @property
    def compiling(self) -> int:
        """Step variants still to compile beside serving (0: every one is ready)."""
        return self._later.left if self._later is not None else 0

    def _compile_later(self, variants: list[tuple[StepShape, bool, bool]],
                       hold: threading.Event | None) -> None:
        """Compile `variants` on a thread, from the caches' and tables' shapes taken now
        (the tick loop replaces those arrays at every step)."""
        shapes = abstract((self.caches, self.tables, self.lora_slots))
        ready = self._ready

        def job(shape: StepShape, speculative: bool, lora: bool):
            def compile_one() -> None:
                caches, tables, slots = shapes
                self.step.precompile(
                    build_step_batch([], shape, self.engine.block_size),
                    make_sampling_arrays([], shape.rows), caches, tables,
                    self._options(speculative, lora),
                    spec_inputs([], shape.rows, self.spec_depth) if speculative else None,
                    slots if lora else None)
                if ready is not None:
                    ready.add((shape, speculative, lora))
            return compile_one

        what = ("step variants" if any(not v[1] for v in variants)
                else "speculative step variants")
        self._later = BackgroundCompile([job(*v) for v in variants], what, hold=hold)

    def close(self) -> None:
        """Stop compiling in the background, if anything still does."""
        if self._later is not None:
            self._later.close()

    def _warm_side_programs(self) -> None:
        """The programs beside the step, run on padding so they change nothing: the slot
        table writes (into the null slot 0, which no row reads from), the snapshot copy
        (null copies 0 -> 0) and every swap bucket (null block reads, dropped writes)."""
        self._write_slot(SlotWrite(
            0, history=np.full(self.book.history_len, -1, np.int32),
            bias_ids=np.full(self.book.bias_len, -1, np.int32),
            bias_values=np.zeros(self.book.bias_len, np.float32)))
        self.copy_slots([0], [0])
        if self.lora_slots is not None:  # a write past the last slot: dropped
            self.counter.record(("write_lora",))
            a, b = slot_arrays(self.model_config, self.engine.lora, None)
            self.lora_slots = self._write_lora(self.lora_slots, np.int32(self.max_loras), a, b)
        # Spills and session tails move a hybrid's state with its blocks; the prefix tier
        # also moves blocks alone.
        states = {self.has_ssm} | ({False} if self.engine.prefix_tier.enabled else set())
        for with_state in sorted(states):
            self.caches, buckets = warm_buckets(self.caches, self.engine.max_blocks_per_seq,
                                                with_state=with_state,
                                                placement=self.placement)
            for b in buckets:
                self.counter.record(("swap", b, with_state))
        jax.block_until_ready((self.caches, self.tables, self.lora_slots))

    def warmup_shapes(self) -> list[StepShape]:
        """The plain step's shapes."""
        lad = self.ladders
        return lad.decode_shapes() + self._prefill_shapes()

    def warmup_variants(self) -> list[tuple[StepShape, bool, bool]]:
        """Every (shape, speculative, lora) the engine can run: the plain step's shapes, and
        with speculation on, the speculative step for its own decode shapes and for every
        shape a batch with prefill chunks can take (such a batch may carry drafts too); with
        LoRA on, each of them also with adapters."""
        plain = [(shape, False) for shape in self.warmup_shapes()]
        if self.spec_depth:
            spec = self.ladders.spec_decode_shapes() + self._prefill_shapes()
            plain += [(shape, True) for shape in spec]
        return self._with_lora(plain)

    def _with_lora(self, variants: list[tuple[StepShape, bool]],
                   ) -> list[tuple[StepShape, bool, bool]]:
        """Each (shape, speculative) without LoRA and, with LoRA on, with it too."""
        flags = (False, True) if self.lora_slots is not None else (False,)
        return [(shape, spec, lora) for lora in flags for shape, spec in variants]

    def _prefill_shapes(self) -> list[StepShape]:
        lad, shapes = self.ladders, []
        for q in lad.query:
            if q == 1:
                continue
            for t in lad.tokens:
                for s in lad.prefill_rows:
                    if t >= q and t >= s:
                        shapes.extend(StepShape(t, s, q, b) for b in lad.blocks)
        return shapes
