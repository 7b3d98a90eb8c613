"""The jitted ragged step: pure functions of (parameters, batch, sampling, caches).

The NNX model is split once into a graph definition and its parameter leaves; the step
rebuilds the module inside the trace, so parameters are traced arguments (never closure
constants) and a call costs one flat list of leaves. Caches are donated: XLA updates the
KV pages and SSM slots in place; so are the per-slot tables (runner/slot_tables.py): the
future-token cells, the token history the penalties read and the logit-bias entries.

A step with prefill chunks is two programs dispatched back to back: the forward (the
model, each row's logits, prompt scores) compiled per step shape, and the sampler compiled
per row count only. The sampler (filters, penalties, random draws, top-n logprobs) is half
of a shape's compile time, and the ~16 prefill shapes share 2 row counts: the split takes
a quarter off warm-up for one more dispatch (~0.1 ms) in a step that computes for
milliseconds. A pure decode step, where that dispatch would be a tenth of a small batch's
step, samples inside its one program, as does the speculative step (its acceptance samples
inside the verification).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from metrale_jax.model.batch import StepBatch
from metrale_jax.model.caches import DeviceCaches
from metrale_jax.model.hybrid import HybridLM
from metrale_jax.runner import hugepages
from metrale_jax.runner.buckets import CompileCounter, StepShape
from metrale_jax.runner.lora_slots import LoraSlots
from metrale_jax.runner.program_store import ProgramStore
from metrale_jax.runner.sampler import (SampleResult, SamplingArrays, logprobs_of, sample,
                                        token_ranks)
from metrale_jax.runner.slot_tables import SlotTables, record_tokens
from metrale_jax.runner.spec_step import (SpecInputs, SpecResult, keep_for_ahead_rows,
                                          place_ahead_rows, verify_and_draft)
from metrale_jax.runner.stored_step import StoredStep
from metrale_jax.runner.token_mask import MaskSource, TokenMask, apply_token_mask
from metrale_jax.runner.transfer import Layout, pack, unpack
from pallas_kernels.cpu import build as cpu_build

if TYPE_CHECKING:
    from metrale_jax.parallel.placement import TensorParallel


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static switches of a step; each combination is its own compiled variant. Serving uses
    one (the engine's num_top); every per-request feature is traced, not a switch."""

    num_top: int = 20              # top-n logprobs computed for every row
    # Return each row's last hidden state; off, nothing is copied back.
    return_hidden: bool = False
    # k > 0: the speculative step (runner/spec_step.py): verify up to k drafts per row and
    # draft k more with the MTP modules. 0: the plain step, with no MTP work at all.
    spec_depth: int = 0
    # Apply each row's LoRA adapter (the slots are an argument of the step). Off, the step
    # has no LoRA work at all: the variant of a step whose rows all run the base model.
    lora: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptScores:
    target_logprobs: Float[Array, "T"]  # [T] logprob of the token that follows each position
    target_ranks: Int[Array, "T"]       # [T] 1 + how many tokens are more likely than it
    top_ids: Int[Array, "T N"]          # [T, N]
    top_logprobs: Float[Array, "T N"]   # [T, N]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    # One token per row, with raw logprobs and top-n; a speculative step emits up to k+1
    # per row, flat [S * (k+1)] (row s, position j at s * (k+1) + j; -1 past the run).
    sampled: SampleResult
    ranks: Int[Array, "S"]               # rank of each sampled token in the raw distribution
    hidden: Float[Array, "S D"] | None   # final-normed state of each row's last token, or None
    prompt: PromptScores                 # zeros unless some target is >= 0 (a traced cond)
    spec: SpecResult | None = None       # accepted counts and next drafts (speculative step)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    """What the plain step's forward hands the sampler and the host."""

    logits: Float[Array, "S V"]          # each row's logits at its last token, grammar-masked
    hidden: Float[Array, "S D"] | None   # as StepOutput.hidden
    prompt: PromptScores


# XLA's copy insertion otherwise copies each donated SSM pool twice per layer and step:
# fusions that read a row of the old pool may be scheduled after the in-place row write
# (XLA duplicates the cheap state update into each consumer), and only region analysis sees
# that the schedule it then picks has no such overlap. On the CPU that was ~0.3 ms of a 1 ms
# batch-1 step of the built-in model, and grows with the pool (slots x state size); other
# backends ignore the option.
COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


# The sampler's compile key: its rows and num_top only (no LoRA, no hidden read-back).
def _sampler_options(options: StepOptions) -> StepOptions:
    return StepOptions(num_top=options.num_top)


class StepRunner:
    """Owns the split model and the jitted step; counts compiled variants.

    With a `placement` (tensor parallel, parallel/placement.py) the parameters are put on
    their shardings and the step is jitted with its outputs' shardings declared: the caches
    keep theirs, everything else is replicated. Such a step is not kept in the program
    store (a stored program is lowered for one device)."""

    def __init__(self, model: HybridLM, counter: CompileCounter | None = None,
                 store: ProgramStore | None = None, store_tag: str = "",
                 placement: "TensorParallel | None" = None):
        graphdef, state = nnx.split(model)
        self.model_config = model.cfg
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        self._leaves = [leaf for _, leaf in paths_leaves]
        self.placement = placement
        if placement is not None:
            self._leaves = placement.place_params([p for p, _ in paths_leaves], self._leaves)
        hugepages.advise(self._leaves)
        self.counter = counter or CompileCounter()
        self.masks = MaskSource(model.cfg.vocab_size)
        self._step = functools.partial(_forward, graphdef, treedef)
        self._sample = functools.partial(_sample_rows, vocab_size=model.cfg.vocab_size)
        self._jitted = self._jitted_sample = None
        # Variants compiled ahead of their first call (`precompile`) on a thread beside
        # serving: the step's programs by (layout, options), the sampler's by its own.
        self._compiled: dict[tuple, Callable] = {}
        self._compiled_sample: dict[tuple, Callable] = {}
        if placement is None:
            self._jitted = jax.jit(self._step, static_argnames=("layout", "options"),
                                   donate_argnames=("caches", "tables"),
                                   compiler_options=COMPILER_OPTIONS)
            self._jitted_sample = jax.jit(self._sample, static_argnames=("layout", "options"),
                                          donate_argnames=("tables",),
                                          compiler_options=COMPILER_OPTIONS)
            if store is not None:  # later starts skip tracing
                calls = tuple(cpu_build.TARGETS)
                self._jitted = StoredStep(self._step, self._jitted, store, store_tag,
                                          donated=(2, 3), custom_calls=calls,
                                          compiler_options=COMPILER_OPTIONS)
                self._jitted_sample = StoredStep(self._sample, self._jitted_sample, store,
                                                 f"sampler {store_tag}", donated=(2,),
                                                 compiler_options=COMPILER_OPTIONS)

    def _sharded(self, caches: DeviceCaches):
        """The tensor-parallel programs, jitted once the caches' structure is known: the
        caches keep their shardings, everything else is replicated."""
        if self._jitted is None:
            rep = self.placement.replicated
            self._jitted = jax.jit(
                self._step, static_argnames=("layout", "options"),
                donate_argnames=("caches", "tables"), compiler_options=COMPILER_OPTIONS,
                out_shardings=(rep, self.placement.cache_shardings(caches), rep))
            self._jitted_sample = jax.jit(
                self._sample, static_argnames=("layout", "options"),
                donate_argnames=("tables",), compiler_options=COMPILER_OPTIONS,
                out_shardings=(rep, rep))
        return self._jitted, self._jitted_sample

    @property
    def params(self) -> list[jax.Array]:
        return self._leaves

    def cache_size(self) -> int:
        """Compiled entries of the step's programs, as `jax.jit` counts its own."""
        return len(self._compiled) + sum(f._cache_size() for f in (self._jitted,
                                                                    self._jitted_sample)
                                         if f is not None)

    def __call__(self, batch: StepBatch, sampling: SamplingArrays, targets: jax.Array | None,
                 caches: DeviceCaches, tables: SlotTables, options: StepOptions,
                 spec: SpecInputs | None = None, mask: TokenMask | None = None,
                 lora: LoraSlots | None = None,
                 ) -> tuple[StepOutput, DeviceCaches, SlotTables]:
        """Run one step. `tables.future` holds each slot's latest sampled token on the
        device: a negative token id -f in the batch is read from `future[f]`, and every
        row's sampled token is written to `future[its slot]` (the async pipeline's
        hand-off). Every token of the batch is recorded in its slot's history. With
        `options.spec_depth` > 0, `spec` says where each row's drafts are. `mask`: the rows'
        grammar token masks, k+1 per row in a speculative step (None: no row is
        constrained). `lora`: the adapter slots, with `options.lora` only (rows name theirs
        in `batch.adapter_slots`)."""
        self.counter.record(("step", _shape_of(batch), options))
        targets, mask = self._checked(batch, targets, spec, mask, lora, options)
        forward, sampler = ((self._jitted, self._jitted_sample) if self.placement is None
                            else self._sharded(caches))
        buffers, layout, rows, row_layout, mask = self._inputs(batch, sampling, targets, spec,
                                                               mask, options)
        args = (self._leaves, buffers, caches, tables, mask, lora)
        if rows is None:  # one program: the step samples its rows itself
            return _run(self._compiled, forward, args, layout, options)
        out, caches, tables = _run(self._compiled, forward, args, layout, options)
        sample_options = _sampler_options(options)
        self.counter.record(("sample", batch.num_rows, sample_options))
        (sampled, ranks), tables = _run(self._compiled_sample, sampler,
                                        (out.logits, rows, tables), row_layout, sample_options)
        return StepOutput(sampled=sampled, ranks=ranks, hidden=out.hidden,
                          prompt=out.prompt), caches, tables

    def precompile(self, batch: StepBatch, sampling: SamplingArrays, caches, tables,
                   options: StepOptions, spec: SpecInputs | None = None, lora=None) -> None:
        """Compile the step for this batch's shape and `options` without running it (with
        prefill chunks: its forward and, unless compiled already, its rows' sampler); a
        later call of that variant runs the compiled programs. Safe beside running steps:
        `caches`, `tables` and `lora` are read for their shapes only (pass `abstract(...)`
        of them from the tick loop's thread; a donated array may be gone by the time
        another thread looks)."""
        if self.placement is not None:
            raise ValueError("only a step on one device is compiled ahead")
        self.counter.record(("step", _shape_of(batch), options))
        targets, mask = self._checked(batch, None, spec, None, lora, options)
        buffers, layout, rows, row_layout, mask = self._inputs(batch, sampling, targets, spec,
                                                               mask, options)
        lowered = self._jitted.lower(*abstract((self._leaves, buffers, caches, tables, mask,
                                                lora)), layout=layout, options=options)
        sample_options = _sampler_options(options)
        if rows is not None and self.counter.record(("sample", batch.num_rows, sample_options)):
            self._compiled_sample[(row_layout, sample_options)] = self._jitted_sample.lower(
                lowered.out_info[0].logits, *abstract((rows, tables)), layout=row_layout,
                options=sample_options).compile()
        # Stored last: the tick loop may use the forward once it is here, and its sampler
        # must be compiled by then.
        self._compiled[(layout, options)] = lowered.compile()

    def _inputs(self, batch: StepBatch, sampling: SamplingArrays, targets, spec, mask,
                options: StepOptions):
        """The step's packed inputs on the device: (buffers, layout, rows, row_layout,
        mask), with `rows` None for a one-program step; a plain step with prefill chunks
        samples its rows in a program of their own, from `rows`."""
        if options.spec_depth or not samples_apart(batch):
            buffers, layout = pack((batch, sampling, targets, spec))
            buffers, mask = self._transfer((buffers, mask))
            return buffers, layout, None, None, mask
        buffers, layout = pack((batch, targets))
        rows, row_layout = pack((sampling, batch.ssm_slots))
        # One transfer: the packed inputs and, for a constrained batch, its host masks (the
        # device constant of an unconstrained one is not copied again).
        buffers, rows, mask = self._transfer((buffers, rows, mask))
        return buffers, layout, rows, row_layout, mask

    def _checked(self, batch: StepBatch, targets, spec, mask, lora, options: StepOptions):
        """The step's targets and mask, defaulted, after checking that `spec` and `lora`
        go with `options`."""
        if targets is None:  # nothing to score; the same shape keeps the same variant
            targets = np.full((batch.num_tokens,), -1, np.int32)
        if (spec is not None) != (options.spec_depth > 0):
            raise ValueError("spec inputs go with a speculative step (spec_depth > 0) only")
        if (lora is not None) != options.lora:
            raise ValueError("LoRA slots go with a LoRA step (options.lora) only")
        if mask is None:  # one mask per position a row samples: k+1 in a speculative step
            mask = self.masks.none(batch.num_rows, options.spec_depth + 1)
        return targets, mask

    def _transfer(self, tree):
        if self.placement is None:
            # Host arrays go to the program as they are: its call copies them in C++, where
            # a device_put first costs ~70 us of the host's time a step.
            return tree
        return self.placement.replicate(tree)  # a full copy on every device of the mesh


def _run(compiled: dict, jitted, args: tuple, layout, options):
    """The variant compiled ahead for (layout, options) if there is one, else the jitted
    program (which compiles it on first use)."""
    program = compiled.get((layout, options))
    if program is not None:
        return program(*args)
    return jitted(*args, layout=layout, options=options)


def abstract(tree):
    """Each array of `tree` as its shape, dtype and placement (structs stay as they are)."""
    def struct(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None),
                                    weak_type=bool(getattr(getattr(x, "aval", None),
                                                           "weak_type", False)))
    return jax.tree.map(struct, tree)


def _shape_of(batch: StepBatch) -> StepShape:
    return StepShape(batch.num_tokens, batch.num_rows, batch.query_len,
                     batch.block_tables.shape[1])


def samples_apart(batch: StepBatch) -> bool:
    """Whether a plain step's rows are sampled by a program of their own: steps with
    prefill chunks (a static property of the shape)."""
    return batch.query_len > 1


def _forward(graphdef, treedef, leaves, buffers: dict[str, jax.Array], caches: DeviceCaches,
             tables: SlotTables, mask: TokenMask, lora: LoraSlots | None, *, layout: Layout,
             options: StepOptions,
             ) -> tuple[StepOutput | ForwardOutput, DeviceCaches, SlotTables]:
    """The model over the batch. A step with prefill chunks returns each row's logits for
    `_sample_rows` (the tables' history updated, their future cells not yet); a decode step
    samples here and a speculative one verifies, drafts and samples here, and both return
    the whole StepOutput."""
    inputs = unpack(buffers, layout)
    # A step that samples here carries (batch, sampling, targets, spec); one sampled apart
    # carries (batch, targets): its sampling values go to `_sample_rows`.
    if len(inputs) == 4:
        batch, sampling, targets, spec = inputs
    else:
        batch, targets = inputs
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    if options.spec_depth:
        block_size = caches.kv[0][0].shape[2] if caches.kv else 0
        batch, sampling = place_ahead_rows(batch, sampling, spec, tables, block_size)
    # Tokens still on the device from the previous step arrive as -slot placeholders.
    ids = batch.token_ids
    batch = dataclasses.replace(batch, token_ids=jnp.where(
        ids < 0, tables.future[jnp.maximum(-ids, 0)], ids))
    # Recorded before sampling: a row's penalties see its tokens up to this step's end.
    tables = dataclasses.replace(tables, sampling=dataclasses.replace(
        tables.sampling, history=record_tokens(tables.sampling.history, batch)))
    # Padding tokens read row 0's slot: their outputs are dropped anyway.
    adapters = lora.inputs(batch.adapter_slots[batch.token_row]) if options.lora else None
    if options.spec_depth:
        hidden, sampled, ranks, result, caches = verify_and_draft(
            model, batch, sampling, tables.sampling, spec, caches, mask,
            depth=options.spec_depth, num_top=options.num_top, lora=adapters)
        # The future cell gets each row's last emitted token.
        newest = jnp.take_along_axis(sampled.tokens.reshape(batch.num_rows, -1),
                                     result.accepted[:, None], axis=1)[:, 0]
        tables = keep_for_ahead_rows(dataclasses.replace(
            tables, future=tables.future.at[batch.ssm_slots].set(newest)),
            batch.ssm_slots, result)
    else:
        hidden, caches = model(batch, caches, adapters)
        # Grammar masks before everything that reads the distribution: sampling, the
        # reported logprobs and ranks (as vLLM, whose logprobs are those of the masked
        # logits).
        logits = apply_token_mask(model.logits(hidden[batch.sample_index]), mask)
    prompt = jax.lax.cond(jnp.any(targets >= 0),
                          lambda: _score_prompt(model, hidden, targets, options.num_top),
                          lambda: _no_scores(hidden.shape[0], options.num_top))
    last = hidden[batch.sample_index] if options.return_hidden else None
    if options.spec_depth:
        return StepOutput(sampled=sampled, ranks=ranks, hidden=last, prompt=prompt,
                          spec=result), caches, tables
    if samples_apart(batch):
        return ForwardOutput(logits=logits, hidden=last, prompt=prompt), caches, tables
    (sampled, ranks), tables = _sample_rows(logits, (sampling, batch.ssm_slots), tables,
                                            options=options,
                                            vocab_size=model.cfg.vocab_size)
    return StepOutput(sampled=sampled, ranks=ranks, hidden=last, prompt=prompt), caches, tables


def _sample_rows(logits: Float[Array, "S V"], rows, tables: SlotTables, *,
                 layout: Layout | None = None, options: StepOptions, vocab_size: int,
                 ) -> tuple[tuple[SampleResult, Int[Array, "S"]], SlotTables]:
    """One token per row from the forward's logits; each row's token goes to its future
    cell (the async pipeline's hand-off). `rows`: (SamplingArrays, slots [S]), packed
    when `layout` is given (the sampler's own program)."""
    sampling, slots = rows if layout is None else unpack(rows, layout)
    sampled = sample(logits, sampling, tables.sampling, num_top=options.num_top,
                     apply_filters=True, vocab_size=vocab_size)
    ranks = jax.lax.cond(jnp.any(sampling.logprobs_on), token_ranks,
                         lambda x, t: jnp.zeros_like(t), logits, sampled.tokens)
    tables = dataclasses.replace(tables, future=tables.future.at[slots].set(sampled.tokens))
    return (sampled, ranks), tables


def _score_prompt(model: HybridLM, hidden: Float[Array, "T D"], targets: Int[Array, "T"],
                  num_top: int) -> PromptScores:
    """Prompt logprobs: every position's logits scored against the token that follows it.
    A traced branch, so a request asking for them compiles nothing new."""
    all_logits = model.logits(hidden)
    lp, ids, top = logprobs_of(all_logits, targets, num_top=num_top,
                               vocab_size=model.cfg.vocab_size)
    return PromptScores(lp, token_ranks(all_logits, targets), ids, top)


def _no_scores(t: int, num_top: int) -> PromptScores:
    return PromptScores(jnp.zeros((t,), jnp.float32), jnp.zeros((t,), jnp.int32),
                        jnp.zeros((t, num_top), jnp.int32), jnp.zeros((t, num_top), jnp.float32))
