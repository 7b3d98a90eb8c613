"""One sequence's grammar state: an llguidance matcher, its token masks and its verdicts.

The scheduler sees only this object (in `Sequence.grammar_state`): it asks for the mask of
the next token when it packs a sampling row, and advances it with every committed token.
The matcher advances only on committed tokens (`Sequence.append`), never on tokens still on
the device, so it always holds exactly `output_ids`: a preemption by recompute keeps it as
it is (the recompute reruns the same tokens; results of steps dispatched before it are
dropped unread), and a swap-out never happens to a constrained sequence.
"""

from __future__ import annotations

import numpy as np


def mask_width(vocab_size: int) -> int:
    """int32 words of a packed token mask: one bit per token id, bit i of word i // 32."""
    return -(-vocab_size // 32)


class GrammarState:
    def __init__(self, matcher, width: int, full_width: int):
        self.matcher = matcher                # llguidance.LLMatcher, in its initial state
        self.width = width                    # words of the mask the device reads
        self.consumed = 0                     # tokens the matcher has taken
        # llguidance fills a mask over its whole vocabulary (at least the model's).
        self._buffer = np.zeros(full_width, np.int32)

    def next_mask(self) -> np.ndarray:
        """[width] int32: the tokens the grammar allows next (bit set = allowed)."""
        self.matcher.unsafe_compute_mask_ptr(self._buffer.ctypes.data, self._buffer.nbytes)
        return self._buffer[:self.width].copy()

    def advance(self, token: int) -> str | None:
        """Take a committed token; the error message when the grammar rejects it."""
        if not self.matcher.consume_token(int(token)):
            return (f"structured output: the grammar rejected token {token} after "
                    f"{self.consumed} tokens ({self.matcher.get_error() or 'no reason given'})")
        self.consumed += 1
        return None

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence stops here)."""
        return self.matcher.is_stopped()
