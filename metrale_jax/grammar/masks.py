"""The scheduler's one question to the grammar: the masks for a row it packs."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from metrale_jax.sequence import Sequence


def grammar_masks(seq: Sequence, samples: bool, drafts: Seq[int] = (),
                  ) -> tuple[list[int], np.ndarray | None]:
    """The drafts the row may verify and the packed token masks of the positions it samples,
    [1 + len(drafts kept), width] (mask j: after the row's tokens and drafts 1..j). The
    masks are None when the sequence is unconstrained or the row samples nothing (a
    prefill chunk short of the prompt's end). A constrained row's drafts are cut where the
    grammar rejects one: verification would reject it anyway, so the cut changes nothing
    but the work."""
    if seq.grammar_state is None or not samples:
        return list(drafts), None
    if seq.inflight:
        # The matcher has not seen the token still on the device: the loop must settle
        # before packing a constrained decode (settle.must_settle(grammar=...)).
        raise RuntimeError(f"sequence {seq.request_id}/{seq.index}: grammar mask asked for "
                           f"with {seq.inflight} token(s) not yet read back")
    if not drafts:
        return [], seq.grammar_state.next_mask()[None]
    return seq.grammar_state.check_drafts(drafts)
