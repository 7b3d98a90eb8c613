"""Host side of the speculative step: the rows' draft layout going down, the emitted runs
coming back (numpy only)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metrale_jax.runner.spec_step import SpecInputs
from metrale_jax.types import RowResult, ScheduledRow


def spec_inputs(rows: Sequence[ScheduledRow], num_rows: int, depth: int) -> SpecInputs:
    """Per row: how many drafts end its chunk, whether it samples, the known tokens after
    it, and whether it was packed ahead (padding rows: no drafts, not sampling)."""
    num_drafts = np.zeros(num_rows, np.int32)
    samples = np.zeros(num_rows, np.bool_)
    follow = np.full((num_rows, depth), -1, np.int32)
    ahead = np.zeros(num_rows, np.bool_)
    for i, r in enumerate(rows):
        if r.num_drafts > depth or r.num_drafts >= len(r.tokens):
            raise ValueError(f"row {i}: {r.num_drafts} drafts in a chunk of {len(r.tokens)} "
                             f"tokens (at most {depth}, after at least one known token)")
        if r.ahead and not (r.num_drafts == depth and len(r.tokens) == depth + 1):
            raise ValueError(f"row {i}: a row packed ahead is one token and {depth} drafts, "
                             f"got {len(r.tokens)} tokens with {r.num_drafts} drafts")
        num_drafts[i] = r.num_drafts
        ahead[i] = r.ahead
        samples[i] = not len(r.follow)
        known = list(r.follow)[:depth]
        follow[i, :len(known)] = known
    return SpecInputs(num_drafts=num_drafts, samples=samples, follow=follow, ahead=ahead)


def unpack_speculative(rows: Sequence[ScheduledRow], s, ranks, prompt, spec,
                       ) -> list[RowResult]:
    """Each row's emitted run: `token` first, then `following` (the accepted drafts went
    on), each with its logprob, rank and top-n; and the next step's drafts."""
    k1 = spec.drafts.shape[1] + 1
    results = []
    for i, _ in enumerate(rows):
        run = [RowResult(token=int(s.tokens[j]), logprob=float(s.logprobs[j]),
                         rank=int(ranks[j]), top_ids=s.top_ids[j],
                         top_logprobs=s.top_logprobs[j])
               for j in range(i * k1, i * k1 + int(spec.accepted[i]) + 1)]
        head = run[0]
        head.following = run[1:]
        head.drafts = [int(t) for t in spec.drafts[i]]
        results.append(head)
    add_prompt_scores(rows, results, prompt)
    return results


def add_prompt_scores(rows: Sequence[ScheduledRow], results: list[RowResult], prompt) -> None:
    """Prompt logprobs of the rows that asked for them, sliced out of the flat scores."""
    if prompt is None:
        return
    cursor = 0
    for r, res in zip(rows, results):
        n = len(r.tokens)
        if len(r.targets):
            span = slice(cursor, cursor + n)
            res.prompt_logprobs = prompt.target_logprobs[span]
            res.prompt_ranks = prompt.target_ranks[span]
            res.prompt_top_ids = prompt.top_ids[span]
            res.prompt_top_logprobs = prompt.top_logprobs[span]
        cursor += n
