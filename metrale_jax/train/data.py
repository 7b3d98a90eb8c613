"""Token streams and the window sampler: which tokens each training step sees.

A split is one flat token stream (works joined by EOS). A training example is a window of
`seq_len + 1 + mtp_depths` tokens: the inputs, the next-token targets, and one more token per
MTP depth. Epoch `e` cuts the stream into non-overlapping windows from a random offset and
visits them in a random order, both drawn from `(seed, e)`; so the batch at any `position`
(windows consumed so far) is a pure function of `(seed, position)`, and resuming needs only
the position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from metrale_jax.tokenizer import Tokenizer


def token_stream(texts: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """Every text encoded and followed by EOS, as one int32 array."""
    eos = tokenizer.eos_token_id
    parts = []
    for text in texts:
        parts.append(np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32))
        parts.append(np.asarray([eos], np.int32))
    return np.concatenate(parts)


@dataclasses.dataclass
class WindowSampler:
    stream: np.ndarray  # [N] int32 tokens of the training split
    window: int         # tokens per example: seq_len + 1 + mtp depths
    seed: int

    def __post_init__(self) -> None:
        if len(self.stream) < 2 * self.window:
            raise ValueError(f"training stream of {len(self.stream)} tokens is too short for "
                             f"windows of {self.window}")
        # One window of slack for the random offset.
        self.per_epoch = (len(self.stream) - self.window) // self.window
        self._epoch, self._starts = -1, None

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.window))
            starts = offset + self.window * np.arange(self.per_epoch)
            self._epoch, self._starts = epoch, rng.permutation(starts)
        return self._starts

    def batch(self, position: int, batch_size: int) -> np.ndarray:
        """[batch_size, window] tokens: windows `position .. position + batch_size - 1`."""
        rows = []
        for p in range(position, position + batch_size):
            start = self._epoch_starts(p // self.per_epoch)[p % self.per_epoch]
            rows.append(self.stream[start:start + self.window])
        return np.stack(rows)


def eval_windows(stream: np.ndarray, window: int, batch_size: int,
                 max_batches: int | None = None) -> list[np.ndarray]:
    """The validation stream cut into consecutive windows (a fixed set), batched; the last
    partial batch is dropped."""
    n = (len(stream) - 1) // window  # windows overlap by nothing; the tail is dropped
    windows = np.stack([stream[i * window:(i + 1) * window] for i in range(n)])
    batches = [windows[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
    return batches[:max_batches] if max_batches is not None else batches
