"""What the MTP acceptance kernel and its reference share, so the two cannot drift.

Both work on flat rows: request s, position i (0..k) is row s * (k+1) + i; the bonus row
i = k has no draft token (-1) and zero draft probabilities, so "sample from the residual
max(0, p - q)" there is simply "sample from p". Per row, each path computes whether the draft
token is accepted and a candidate token (the residual sample, or the argmax when greedy);
`finish` turns those into the accepted length and the output tokens.

Randomness is a counter-based hash of (request key, position, column), not `jax.random`, so
the kernel draws its Gumbel noise tile by tile without a [rows, vocab] noise array, and the
reference draws exactly the same numbers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt32

from pallas_kernels._pallas import require


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlatRows:
    logits: Float[Array, "R V"]      # target logits, row = (request, position)
    draft_probs: Float[Array, "R V"]  # q; zeros on the bonus row
    draft: Int[Array, "R"]           # draft token of the row, -1 on the bonus row
    inv_temp: Float[Array, "R"]      # 1 / temperature; 1 for greedy rows
    greedy: Int[Array, "R"]          # 1 where temperature == 0
    seed0: UInt32[Array, "R"]        # the request's key words
    seed1: UInt32[Array, "R"]
    position: Int[Array, "R"]        # i: keeps each position's noise independent


def flatten_rows(target_logits: Float[Array, "S K1 V"], draft_tokens: Int[Array, "S K"],
                 draft_probs: Float[Array, "S K V"], keys: jax.Array,
                 temperatures: Float[Array, "S"]) -> FlatRows:
    require(target_logits.ndim == 3,
            f"target_logits: expected [S, k+1, vocab], got shape {target_logits.shape}")
    s, k1, v = target_logits.shape
    require(k1 >= 1, "target_logits: needs at least one position")
    require(draft_tokens.shape == (s, k1 - 1),
            f"draft_tokens: expected [{s}, {k1 - 1}], got shape {draft_tokens.shape}")
    require(draft_probs.shape == (s, k1 - 1, v),
            f"draft_probs: expected [{s}, {k1 - 1}, {v}], got shape {draft_probs.shape}")
    require(temperatures.shape == (s,),
            f"temperatures: expected [{s}], got shape {temperatures.shape}")
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.key_data(keys)
    require(keys.shape[0] == s and keys.ndim == 2 and keys.shape[1] >= 2,
            f"keys: expected {s} PRNG keys or raw key data [{s}, 2], got shape {keys.shape}")
    keys = keys.astype(jnp.uint32)
    per_row = lambda t: jnp.repeat(t, k1, axis=0)
    greedy = temperatures <= 0
    return FlatRows(
        logits=target_logits.astype(jnp.float32).reshape(s * k1, v),
        draft_probs=jnp.pad(draft_probs.astype(jnp.float32),
                            ((0, 0), (0, 1), (0, 0))).reshape(s * k1, v),
        draft=jnp.pad(draft_tokens.astype(jnp.int32), ((0, 0), (0, 1)),
                      constant_values=-1).reshape(-1),
        inv_temp=per_row(jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temperatures))
                         .astype(jnp.float32)),
        greedy=per_row(greedy.astype(jnp.int32)),
        seed0=per_row(keys[:, 0]), seed1=per_row(keys[:, 1]),
        position=jnp.tile(jnp.arange(k1, dtype=jnp.int32), s))


def _fmix32(h):
    # MurmurHash3's finaliser: every input bit flips each output bit with probability ~1/2.
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(seed0, seed1, position, column):
    """A uniform in (0, 1) per (key, position, column); broadcasts like its arguments."""
    counter = position.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + column.astype(jnp.uint32)
    h = _fmix32(seed0 ^ _fmix32(seed1 ^ _fmix32(counter)))
    # 24 bits, through int32: exact in float32 and no unsigned-to-float conversion needed.
    return (h >> 8).astype(jnp.int32).astype(jnp.float32) * (2.0 ** -24) + 2.0 ** -25


def gumbel(seed0, seed1, position, column):
    return -jnp.log(-jnp.log(uniform(seed0, seed1, position, column)))


def accept_rule(rows: FlatRows, p_draft: Float[Array, "R"], q_draft: Float[Array, "R"],
                argmax: Int[Array, "R"], vocab: int) -> Bool[Array, "R"]:
    """Greedy: the draft is the argmax. Sampled: accept with probability min(1, p/q)."""
    # The column `vocab` is never a token, so this uniform is independent of the Gumbels.
    u = uniform(rows.seed0, rows.seed1, rows.position, jnp.full_like(rows.draft, vocab))
    sampled = (rows.draft >= 0) & (u * q_draft <= p_draft)
    return jnp.where(rows.greedy == 1, argmax == rows.draft, sampled)


def finish(accept: Int[Array, "R"], candidate: Int[Array, "R"], draft_tokens: Int[Array, "S K"],
           ) -> tuple[Int[Array, "S"], Int[Array, "S K1"]]:
    """Accepted length n = drafts before the first rejection; output = n drafts, then the
    candidate at position n (the residual sample, or the bonus token when n == k); -1 after."""
    s, k = draft_tokens.shape
    accept = accept.reshape(s, k + 1)[:, :k].astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
    candidate = candidate.reshape(s, k + 1)
    cols = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    drafts = jnp.pad(draft_tokens.astype(jnp.int32), ((0, 0), (0, 1)), constant_values=-1)
    n = accepted[:, None]
    tokens = jnp.where(cols < n, drafts, jnp.where(cols == n, candidate, -1))
    return accepted, tokens.astype(jnp.int32)
