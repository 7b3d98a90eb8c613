"""One sequence's grammar state: a backend's matcher, its token masks and its verdicts.

The scheduler sees only this object (in `Sequence.grammar_state`): it asks for the masks of
the positions a row samples when it packs it, and advances it with every committed token.
The matcher advances only on committed tokens (`Sequence.append`), never on tokens still on
the device, so it always holds exactly `output_ids`: a preemption by recompute keeps it as
it is (the recompute reruns the same tokens; results of steps dispatched before it are
dropped unread), and a swap-out never happens to a constrained sequence. Checking MTP drafts
consumes them only tentatively and rolls them back before returning.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mask_width(vocab_size: int) -> int:
    """int32 words of a packed token mask: one bit per token id, bit i of word i // 32."""
    return -(-vocab_size // 32)


def allows(mask: np.ndarray, token: int) -> bool:
    """Bit `token` of a packed mask."""
    return 0 <= token < mask.shape[-1] * 32 and bool((mask[token >> 5] >> (token & 31)) & 1)


class GrammarState:
    def __init__(self, matcher, width: int, full_width: int):
        self.matcher = matcher                # a backend's Matcher (grammar/backend.py)
        self.width = width                    # words of the mask the device reads
        self.consumed = 0                     # tokens the matcher has taken
        # A backend fills a mask over its whole vocabulary (at least the model's).
        self._buffer = np.zeros(full_width, np.int32)

    def next_mask(self) -> np.ndarray:
        """[width] int32: the tokens the grammar allows next (bit set = allowed)."""
        self.matcher.fill_mask(self._buffer)
        return self._buffer[:self.width].copy()

    def check_drafts(self, drafts: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """For a row that verifies MTP drafts d1..dk: the drafts the grammar allows in a
        row (cut at the first it rejects, and after one that completes it), and the mask
        of every position the row samples, [1 + kept, width]: the mask now, then after
        d1, after d1 d2, ... Each draft is consumed tentatively and all are rolled back,
        so the state is unchanged."""
        masks = [self.next_mask()]
        kept: list[int] = []
        for token in drafts:
            if self.matcher.stopped or not allows(masks[-1], token) \
                    or not self.matcher.accept(int(token)):
                break
            kept.append(int(token))
            # After a draft that completes the grammar the sequence stops: its mask is
            # never read (EOS-only or empty), but every sampled position has one.
            masks.append(self.next_mask())
        self.matcher.rollback(len(kept))
        return kept, np.stack(masks)

    def advance(self, token: int) -> str | None:
        """Take a committed token; the error message when the grammar rejects it."""
        if not self.matcher.accept(int(token)):
            reason = self.matcher.error() or "no reason given"
            return (f"structured output: the grammar rejected token {token} after "
                    f"{self.consumed} tokens ({reason})")
        self.consumed += 1
        return None

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence stops here)."""
        return self.matcher.stopped
