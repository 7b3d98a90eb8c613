"""Grammar token masks on the device: packed int32 bits -> -inf on disallowed logits.

A step always takes a `TokenMask` of fixed shape ([rows bucket * positions, ceil(V/32)],
fixed by the vocabulary), so constrained and unconstrained batches run the same compiled
step. `positions` is 1 for the plain step and k+1 for the speculative one, which verifies up
to k drafts per row: row s, position j at s * positions + j, each with the mask of the state
after the row's drafts before j (a row's positions past its drafts are off). A batch with no
constrained row passes a constant kept on the device (`MaskSource.none`): nothing is built
or sent on the host, and the device skips the masking under a traced cond. A constrained
batch's masks travel in the same `device_put` as the step's packed inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from metrale_jax.grammar.matcher import mask_width


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenMask:
    bits: Int[Array, "R W"]   # [rows * positions, ceil(V/32)] bit i of word i // 32: token
                              # i allowed
    on: Bool[Array, "R"]      # the position is constrained (others ignore their bits)


def pack_masks(masks: Sequence[np.ndarray | None], num_rows: int, width: int,
               positions: int = 1) -> TokenMask | None:
    """Host arrays for a batch's rows (padded to `num_rows`), each row's masks [n, width]
    (n <= positions; a [width] mask is one position), None when no row has a mask."""
    if all(m is None for m in masks):
        return None
    bits = np.full((num_rows * positions, width), -1, np.int32)
    on = np.zeros((num_rows * positions,), np.bool_)
    for i, m in enumerate(masks):
        if m is None:
            continue
        m = m.reshape(-1, m.shape[-1])
        if m.shape[1] != width or not 1 <= m.shape[0] <= positions:
            raise ValueError(f"row {i}: token masks of shape {m.shape}, expected (n, {width}) "
                             f"with 1 <= n <= {positions}")
        start = i * positions
        bits[start:start + len(m)], on[start:start + len(m)] = m, True
    return TokenMask(bits, on)


class MaskSource:
    """The device constant for unconstrained batches, one per (rows bucket, positions)."""

    def __init__(self, vocab_size: int):
        self.width = mask_width(vocab_size)
        self._none: dict[int, TokenMask] = {}

    def none(self, num_rows: int, positions: int = 1) -> TokenMask:
        n = num_rows * positions
        if n not in self._none:
            self._none[n] = jax.device_put(TokenMask(
                np.full((n, self.width), -1, np.int32), np.zeros((n,), np.bool_)))
        return self._none[n]

    def for_rows(self, masks: Sequence[np.ndarray | None], num_rows: int,
                 positions: int = 1) -> TokenMask:
        """The device constant, or the rows' masks still on the host: the step sends them
        in its one input transfer, with the batch (`StepRunner.__call__`)."""
        host = pack_masks(masks, num_rows, self.width, positions)
        return self.none(num_rows, positions) if host is None else host


def allowed_tokens(bits: Int[Array, "R W"], vocab: int) -> Bool[Array, "R V"]:
    """Unpack bits to one bool per token id; ids past W * 32 are disallowed."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    unpacked = ((bits[:, :, None] >> shifts) & 1).astype(bool)  # [R, W, 32]
    flat = unpacked.reshape(bits.shape[0], -1)[:, :vocab]
    if flat.shape[1] < vocab:
        flat = jnp.pad(flat, ((0, 0), (0, vocab - flat.shape[1])))
    return flat


def apply_token_mask(logits: Float[Array, "R V"], mask: TokenMask) -> Float[Array, "R V"]:
    """Disallowed tokens of constrained rows become -inf. A row whose mask allows nothing
    (a matcher in error) is left as it is: the host then rejects what it samples and fails
    that request, instead of the whole row turning NaN. Skipped when no row is constrained."""

    def masked(x):
        allowed = allowed_tokens(mask.bits, x.shape[1])
        on = mask.on & jnp.any(allowed, axis=-1)  # [R]
        return jnp.where(on[:, None] & ~allowed, -jnp.inf, x).astype(x.dtype)

    return jax.lax.cond(jnp.any(mask.on), masked, lambda x: x, logits)
