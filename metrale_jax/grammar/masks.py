"""The scheduler's one question to the grammar: the mask for a row it packs."""

from __future__ import annotations

import numpy as np

from metrale_jax.sequence import Sequence


def grammar_mask(seq: Sequence, samples: bool) -> np.ndarray | None:
    """The packed token mask of the token this row samples; None when the sequence is
    unconstrained or the row samples nothing (a prefill chunk short of the prompt's end)."""
    if seq.grammar_state is None or not samples:
        return None
    if seq.inflight:
        # The matcher has not seen the token still on the device: the loop must settle
        # before packing a constrained decode (settle.must_settle(grammar=...)).
        raise RuntimeError(f"sequence {seq.request_id}/{seq.index}: grammar mask asked for "
                           f"with {seq.inflight} token(s) not yet read back")
    return seq.grammar_state.next_mask()
