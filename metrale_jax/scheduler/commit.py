"""Reading a step's results back: commit sampled tokens and apply the stop rules.

`commit_step` changes sequences only; it returns the ones it touched and the core reports
them (finished ones are released first). Logprob entries are left undecoded: turning token
ids into text is the front's job, off the engine thread.
"""

from __future__ import annotations

import dataclasses

from metrale_jax.scheduler.lanes import PackedRow
from metrale_jax.scheduler.memory import Memory
from metrale_jax.sequence import Sequence, position_logprobs
from metrale_jax.types import RowResult


@dataclasses.dataclass
class Committed:
    """What one step's read-back did: the sequences it touched, the tokens it committed to
    requests, and (speculative steps) drafts verified and accepted per depth."""

    touched: list[Sequence]
    tokens: int = 0
    drafted: list[int] = dataclasses.field(default_factory=list)   # [k] rows with a d-th draft
    accepted: list[int] = dataclasses.field(default_factory=list)  # [k] of which accepted


def commit_step(results: list[RowResult], packed: list[PackedRow], memory: Memory,
                spec_depth: int = 0) -> Committed:
    """Apply a step's results; `spec_depth` > 0 for a speculative step's."""
    out = Committed([], drafted=[0] * spec_depth, accepted=[0] * spec_depth)
    for p, result in zip(packed, results):
        seq = p.seq
        if p.samples and seq.epoch == p.epoch:
            seq.inflight -= 1
        if seq.epoch != p.epoch or seq.finished:
            continue  # preempted since, or a token past a stop: not part of the output
        if seq.prompt_logprobs is not None and result.prompt_logprobs is not None:
            _add_prompt_logprobs(seq, p, result)
        if p.samples:
            before = len(seq.output_ids)
            for emitted in [result, *result.following]:
                if seq.finished:
                    break  # never past a stop: the rest of the run is dropped
                _append(seq, emitted)
            out.tokens += len(seq.output_ids) - before
            if spec_depth:
                _settle_drafts(seq, p, result, memory, out)
            memory.commit_blocks(seq)
            memory.publish_staged(seq)
        out.touched.append(seq)
    memory.flush_copies()
    return out


def _append(seq: Sequence, result: RowResult) -> None:
    top = None
    if seq.logprobs is not None:
        top = position_logprobs(result.top_ids, result.top_logprobs, seq.params.logprobs,
                                result.token, result.logprob, result.rank)
    seq.append(result.token, result.logprob, top)


def _settle_drafts(seq: Sequence, p: PackedRow, result: RowResult, memory: Memory,
                   out: Committed) -> None:
    """After verification: the accepted drafts' K/V and SSM state are the sequence's now;
    blocks taken for rejected positions go back; the new drafts are kept."""
    accepted = len(result.following)
    for d in range(p.row.num_drafts):
        out.drafted[d] += 1
        out.accepted[d] += d < accepted
    seq.num_computed += accepted
    seq.drafts, seq.drafts_at = list(result.drafts), len(seq.output_ids)
    if p.row.num_drafts:
        # Deferred from dispatch: the state is final now, unless a row packed ahead is in
        # flight (the slot's SSM state then moves on before a copy would run): no snapshot.
        if memory.commit_blocks(seq) and not seq.inflight:
            memory.snapshot_boundary(seq)
        memory.trim(seq)


def _add_prompt_logprobs(seq: Sequence, p: PackedRow, result: RowResult) -> None:
    n = seq.params.prompt_logprobs
    for i, target in enumerate(p.row.targets):
        if target >= 0:
            seq.prompt_logprobs.append(position_logprobs(
                result.prompt_top_ids[i], result.prompt_top_logprobs[i], n, target,
                float(result.prompt_logprobs[i]), int(result.prompt_ranks[i])))
