"""Reading a step's results back: commit sampled tokens, apply stop rules, report."""

from __future__ import annotations

from typing import TYPE_CHECKING

from metrale_jax.runner.model_runner import StepHandle
from metrale_jax.scheduler.lanes import PackedRow
from metrale_jax.sequence import position_logprobs

if TYPE_CHECKING:
    from metrale_jax.scheduler.core import SchedulerCore


def process_step(core: "SchedulerCore", handle: StepHandle, packed: list[PackedRow]) -> None:
    results = core.runner.collect(handle)
    touched = []
    for p, result in zip(packed, results):
        seq = p.seq
        if p.samples and seq.epoch == p.epoch:
            seq.inflight -= 1
        if seq.epoch != p.epoch or seq.finished:
            continue  # preempted since, or a token past a stop: not part of the output
        if seq.prompt_logprobs is not None and result.prompt_logprobs is not None:
            _add_prompt_logprobs(core, seq, p, result)
        if p.samples:
            top = None
            if seq.logprobs is not None:
                top = position_logprobs(result.top_ids, result.top_logprobs,
                                        seq.params.logprobs, result.token, result.logprob,
                                        result.rank, core.tokenizer)
            seq.append(result.token, result.logprob, top, core.tokenizer)
            core.commit_blocks(seq)
        touched.append(seq)
    for seq in touched:
        if seq.finished:
            core.finish(seq)
        else:
            core.emit(seq)


def _add_prompt_logprobs(core: "SchedulerCore", seq, p: PackedRow, result) -> None:
    n = seq.params.prompt_logprobs
    for i, target in enumerate(p.row.targets):
        if target >= 0:
            seq.prompt_logprobs.append(position_logprobs(
                result.prompt_top_ids[i], result.prompt_top_logprobs[i], n, target,
                float(result.prompt_logprobs[i]), int(result.prompt_ranks[i]), core.tokenizer))
