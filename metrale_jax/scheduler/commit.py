"""Reading a step's results back: commit sampled tokens and apply the stop rules.

`commit_step` changes sequences only; it returns the ones it touched and the core reports
them (finished ones are released first). Logprob entries are left undecoded: turning token
ids into text is the front's job, off the engine thread.
"""

from __future__ import annotations

from metrale_jax.scheduler.lanes import PackedRow
from metrale_jax.scheduler.memory import Memory
from metrale_jax.sequence import Sequence, position_logprobs
from metrale_jax.types import RowResult


def commit_step(results: list[RowResult], packed: list[PackedRow],
                memory: Memory) -> list[Sequence]:
    touched = []
    for p, result in zip(packed, results):
        seq = p.seq
        if p.samples and seq.epoch == p.epoch:
            seq.inflight -= 1
        if seq.epoch != p.epoch or seq.finished:
            continue  # preempted since, or a token past a stop: not part of the output
        if seq.prompt_logprobs is not None and result.prompt_logprobs is not None:
            _add_prompt_logprobs(seq, p, result)
        if p.samples:
            top = None
            if seq.logprobs is not None:
                top = position_logprobs(result.top_ids, result.top_logprobs,
                                        seq.params.logprobs, result.token, result.logprob,
                                        result.rank)
            seq.append(result.token, result.logprob, top)
            memory.commit_blocks(seq)
        touched.append(seq)
    return touched


def _add_prompt_logprobs(seq: Sequence, p: PackedRow, result: RowResult) -> None:
    n = seq.params.prompt_logprobs
    for i, target in enumerate(p.row.targets):
        if target >= 0:
            seq.prompt_logprobs.append(position_logprobs(
                result.prompt_top_ids[i], result.prompt_top_logprobs[i], n, target,
                float(result.prompt_logprobs[i]), int(result.prompt_ranks[i])))
