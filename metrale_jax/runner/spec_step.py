"""The speculative step: verify each row's drafts and draft the next ones, in one program.

A decoding row arrives as its last token followed by up to k drafts (`SpecInputs.num_drafts`).
The backbone runs them as one chunk; the target distribution at each of the row's last
n+1 positions (`sampler.target_logits`: the plain step's distribution, bias, penalties,
temperature and filters included) verifies the drafts with the MTP acceptance kernel
(`pallas_kernels/mtp`): greedy rows accept while the draft is the argmax, sampled rows by
rejection sampling, so every emitted token is distributed exactly as plain decoding's. The
Mamba2 layers keep their state after each of the first k+1 positions of every row, and the
row's state after its last accepted token replaces the state after all k+1 (rollback
without recompute). Rejected K/V is left where it is: the host rolls the sequence back by
length, and the next step overwrites those positions.

Then the MTP modules draft (DeepSeek-V3 chaining, greedy): depth d reads depth d-1's output
at every position of the batch and the embedding of the token d+1 places after it, writes
its own K/V there (so later drafts attend over the whole context), and at each row's last
verified position proposes the next draft. Prefill chunks in the same batch fill their MTP
K/V the same way, reading the known prompt tokens past the chunk (`SpecInputs.follow`).
Drafts are only proposals: a poor one costs acceptance, never exactness.

The async pipeline: each step leaves every row's newest token, its k drafts and how many
drafts it accepted in the row's slot (`SlotTables.future`, `.drafts`, `.advance`), so the
host can pack the next speculative step before reading this one back. Such a row is laid
out as if nothing was accepted, and `place_ahead_rows` fills in its tokens and moves it on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from metrale_jax.model.batch import StepBatch
from metrale_jax.model.caches import DeviceCaches
from metrale_jax.model.hybrid import HybridLM
from metrale_jax.model.lora import LoraInputs
from metrale_jax.runner.sampler import (SampleResult, SamplingArrays, raw_logprobs, row_keys,
                                        target_logits, token_ranks)
from metrale_jax.runner.penalties import SamplingTables
from metrale_jax.runner.slot_tables import SlotTables
from metrale_jax.runner.token_mask import TokenMask, apply_token_mask
from pallas_kernels.backend import KernelOps
from pallas_kernels.reductions import first_argmax
from pallas_kernels.scatter import set_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInputs:
    num_drafts: Int[Array, "S"]   # [S] drafts at the end of each row's chunk (0: none)
    samples: Bool[Array, "S"]     # [S] the chunk reaches the sequence's end (it samples)
    follow: Int[Array, "S K"]     # [S, K] known tokens after a chunk that does not sample
                                  # (the prompt goes on), -1 where unknown
    ahead: Bool[Array, "S"]       # [S] the row was packed before the speculative step ahead
                                  # of it was read back (`place_ahead_rows`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecResult:
    accepted: Int[Array, "S"]     # [S] drafts accepted per row
    drafts: Int[Array, "S K"]     # [S, K] the next step's drafts for each row


def place_ahead_rows(batch: StepBatch, sampling: SamplingArrays, spec: SpecInputs,
                     tables: SlotTables, block_size: int,
                     ) -> tuple[StepBatch, SamplingArrays]:
    """Rows the host packed before the speculative step ahead of them was read back (the
    async pipeline): the host laid each out as if that step had accepted no draft, with
    placeholder tokens. Here each such row takes its slot's newest token and drafts, and
    moves `advance[slot]` positions on (its positions, KV slots, context and sampling
    counters), so it runs exactly as the row the host would have packed after reading
    back. `block_size`: the KV pages' (0: no attention layers)."""
    t = batch.num_tokens
    row, col = batch.token_row, batch.token_col
    # A token is its row's own (not padding, which reads row 0) where the gather map agrees.
    own = batch.gather_valid[row, col] & (batch.gather_index[row, col] == jnp.arange(t))
    shift = jnp.where(spec.ahead, tables.advance[batch.ssm_slots], 0)          # [S]
    moved = own & spec.ahead[row]                                              # [T]
    slot = batch.ssm_slots[row]
    run = jnp.concatenate([tables.future[:, None], tables.drafts], axis=1)     # [N, k+1]
    token_ids = jnp.where(moved, run[slot, jnp.minimum(col, run.shape[1] - 1)],
                          batch.token_ids)
    positions = batch.positions + jnp.where(moved, shift[row], 0)
    slot_mapping = batch.slot_mapping
    if block_size:
        page = jnp.take_along_axis(batch.block_tables[row], (positions // block_size)[:, None],
                                   axis=1, mode="clip")[:, 0]
        slot_mapping = jnp.where(moved, page * block_size + positions % block_size,
                                 slot_mapping)
    batch = dataclasses.replace(batch, token_ids=token_ids, positions=positions,
                                slot_mapping=slot_mapping,
                                context_lens=batch.context_lens + shift)
    sampling = dataclasses.replace(sampling, counters=sampling.counters + shift,
                                   history_lens=sampling.history_lens + shift)
    return batch, sampling


def keep_for_ahead_rows(tables: SlotTables, slots: Int[Array, "S"], result: SpecResult,
                        ) -> SlotTables:
    """Each row's next drafts and accepted count into its slot, for a row packed before
    this step is read back (padding rows write the null slot)."""
    return dataclasses.replace(tables, drafts=tables.drafts.at[slots].set(result.drafts),
                               advance=tables.advance.at[slots].set(result.accepted))


def verify_and_draft(model: HybridLM, batch: StepBatch, sampling: SamplingArrays,
                     tables: SamplingTables, spec: SpecInputs, caches: DeviceCaches,
                     mask: TokenMask, *, depth: int, num_top: int,
                     lora: LoraInputs | None = None,
                     ) -> tuple[jax.Array, SampleResult, jax.Array, SpecResult, DeviceCaches]:
    """Inside the jitted step; `mask` holds k+1 positions per row (runner/token_mask.py).
    Returns the backbone's hidden states [T, D], the emitted tokens as a flat [S * (k+1)]
    SampleResult (row s, position j at s * (k+1) + j; -1 past the accepted drafts + 1) with
    their ranks, the SpecResult and the new caches. `lora`: the rows' adapters, applied to
    the backbone (so verification targets the adapted model); the MTP modules draft with
    base weights only (see `HybridLM.mtp_forward`)."""
    k1 = depth + 1
    vocab = model.cfg.vocab_size
    hidden, caches, candidates = model.forward_keeping_states(batch, caches, window=k1,
                                                              lora=lora)

    # The row's last non-draft token and the n drafts after it: positions 0..n of [S, k+1].
    first = batch.sample_index - spec.num_drafts
    cols = jnp.arange(k1, dtype=jnp.int32)
    index = jnp.minimum(first[:, None] + cols[None, :], batch.sample_index[:, None])  # [S, k+1]
    # Grammar masks, one per position (the state after the drafts before it), before the
    # acceptance: greedy and rejection sampling then both verify against the masked target,
    # so a constrained row emits what plain masked decoding would.
    logits = apply_token_mask(model.logits(hidden[index.reshape(-1)]), mask)  # [S*(k+1), V]
    draft_in = jnp.where(cols[None, :depth] < spec.num_drafts[:, None],
                         batch.token_ids[jnp.minimum(first[:, None] + 1 + cols[None, :depth],
                                                     batch.num_tokens - 1)], -1)  # [S, k]
    accepted, tokens = accept_drafts(logits, draft_in, sampling, tables, ops=model.ops,
                                     vocab_size=vocab)
    flat_tokens = tokens.reshape(-1)
    emitted = raw_logprobs(logits, flat_tokens, num_top=num_top, vocab_size=vocab)
    ranks = token_ranks(logits, flat_tokens)

    caches = _roll_back_ssm(caches, candidates, batch.ssm_slots, spec.num_drafts, accepted)
    bonus = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
    drafts, caches = _draft(model, hidden, batch, spec, caches, first + accepted, bonus,
                            depth)
    return hidden, emitted, ranks, SpecResult(accepted, drafts), caches


def accept_drafts(logits: Float[Array, "R V"], drafts: Int[Array, "S K"],
                  sampling: SamplingArrays, tables: SamplingTables, *, ops: KernelOps,
                  vocab_size: int | None = None) -> tuple[Int[Array, "S"], Int[Array, "S K1"]]:
    """Verify each row's drafts (-1: none) against the target logits at its k+1 positions
    (row s, position j at s * (k+1) + j); returns the accepted counts and the emitted
    tokens (-1 past accepted + 1). Position j samples as the row's (j+1)-th next token
    would: the same bias, penalties, temperature and filters, and its own random stream."""
    s, depth = drafts.shape
    k1 = depth + 1
    per_position = jax.tree.map(lambda a: jnp.repeat(a, k1, axis=0), sampling)
    per_position = dataclasses.replace(
        per_position, counters=per_position.counters + jnp.tile(jnp.arange(k1), s))
    target = target_logits(logits, per_position, tables, vocab_size=vocab_size)
    greedy = sampling.temperature <= 0.0
    keys = jax.random.key_data(row_keys(sampling.seeds, sampling.counters))
    # Drafts are greedy: a one-hot draft distribution, so acceptance is min(1, p(d)) and a
    # rejection resamples from p without d. `target` is already tempered and filtered.
    return ops.mtp_accept(target.reshape(s, k1, -1), drafts,
                          jax.nn.one_hot(drafts, target.shape[-1]), keys,
                          jnp.where(greedy, 0.0, 1.0))


def _draft(model: HybridLM, hidden: jax.Array, batch: StepBatch, spec: SpecInputs,
           caches: DeviceCaches, last_verified: Int[Array, "S"], bonus: Int[Array, "S"],
           depth: int) -> tuple[Int[Array, "S K"], DeviceCaches]:
    """The MTP chain over every position of the batch; returns each row's k drafts."""
    t = batch.num_tokens
    real = batch.context_lens > 0
    # Where each row's chain reads a token the batch does not hold: its last verified
    # position (padding rows point past the end and are dropped).
    anchor = jnp.where(real, jnp.where(spec.samples, last_verified, batch.sample_index), t)
    after = lambda d, newest: jnp.where(spec.samples, newest,  # noqa: E731
                                        jnp.maximum(spec.follow[:, d], 0))
    shift = lambda x: jnp.concatenate([x[1:], jnp.zeros((1,), x.dtype)])  # noqa: E731
    # next_ids[p]: the token d+1 places after position p (depth d's input embedding).
    next_ids = shift(batch.token_ids).at[anchor].set(after(0, bonus), mode="drop")
    h, drafts = hidden, []
    for d in range(depth):
        h, normed, caches = model.mtp_forward(d, h, next_ids, batch, caches)
        proposal = model.logits(normed[jnp.minimum(anchor, t - 1)])
        proposal = jnp.where(jnp.arange(proposal.shape[1]) < model.cfg.vocab_size,
                             proposal, -jnp.inf)
        drafts.append(first_argmax(proposal))
        if d + 1 < depth:
            next_ids = shift(next_ids).at[anchor].set(after(d + 1, drafts[-1]), mode="drop")
    return jnp.stack(drafts, axis=1), caches


def _roll_back_ssm(caches: DeviceCaches, candidates: list, slots: Int[Array, "S"],
                   num_drafts: Int[Array, "S"], accepted: Int[Array, "S"]) -> DeviceCaches:
    """A row that verified drafts keeps the state after its last accepted token."""
    if not candidates:
        return caches
    verify = num_drafts > 0
    conv, ssm = list(caches.conv), list(caches.ssm)
    for i, (tails, states) in enumerate(candidates):
        pick = lambda c: jnp.take_along_axis(  # noqa: E731
            c, accepted.reshape((-1,) + (1,) * (c.ndim - 1)), axis=1)[:, 0]
        keep = lambda pool, c: jnp.where(  # noqa: E731
            verify.reshape((-1,) + (1,) * (pool.ndim - 1)), pick(c).astype(pool.dtype),
            pool[slots])
        conv[i] = set_rows(conv[i], slots, keep(conv[i], tails))
        ssm[i] = set_rows(ssm[i], slots, keep(ssm[i], states))
    return dataclasses.replace(caches, conv=tuple(conv), ssm=tuple(ssm))
