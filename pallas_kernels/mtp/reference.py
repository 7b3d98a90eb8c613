"""jnp reference for fused speculative-decoding acceptance (greedy and rejection sampling).

Leviathan et al. / Chen et al.: draft token d at position i, sampled from q_i, is accepted
with probability min(1, p_i(d) / q_i(d)); on the first rejection the token is drawn from the
normalised residual max(0, p_i - q_i) and the rest is dropped; if all k are accepted a bonus
token is drawn from p_k. Each emitted token is then distributed exactly as the target's p.
Greedy rows (temperature 0) accept while the draft equals the target argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.mtp.common import accept_rule, finish, flatten_rows, gumbel
from pallas_kernels.reductions import first_argmax


def mtp_accept(
    target_logits: Float[Array, "S K1 V"],
    draft_tokens: Int[Array, "S K"],
    draft_probs: Float[Array, "S K V"],
    keys: jax.Array,
    temperatures: Float[Array, "S"],
) -> tuple[Int[Array, "S"], Int[Array, "S K1"]]:
    """Returns (accepted drafts per request [S], output tokens [S, k+1], -1 past n+1)."""
    rows = flatten_rows(target_logits, draft_tokens, draft_probs, keys, temperatures)
    v = rows.logits.shape[1]
    p = jax.nn.softmax(rows.logits * rows.inv_temp[:, None], axis=-1)
    argmax = first_argmax(rows.logits)  # jnp.argmax's token, without its slow CPU form
    safe = jnp.clip(rows.draft, 0)[:, None]
    p_draft = jnp.take_along_axis(p, safe, axis=1)[:, 0]
    q_draft = jnp.take_along_axis(rows.draft_probs, safe, axis=1)[:, 0]
    accept = accept_rule(rows, p_draft, q_draft, argmax, v)
    # Only the row at the first rejection (or the bonus row) is ever sampled: draw there alone.
    k1 = draft_tokens.shape[1] + 1
    first_reject = jnp.sum(jnp.cumprod(accept.reshape(-1, k1)[:, :-1], axis=1), axis=1)
    row = jnp.arange(first_reject.shape[0]) * k1 + first_reject
    cols = jnp.arange(v, dtype=jnp.int32)[None, :]
    noise = gumbel(rows.seed0[row, None], rows.seed1[row, None], rows.position[row, None], cols)
    residual = jnp.maximum(p[row] - rows.draft_probs[row], 0.0)
    sample = first_argmax(jnp.log(residual) + noise)
    candidate = jnp.where(rows.greedy == 1, argmax, jnp.zeros_like(argmax).at[row].set(sample))
    return finish(accept, candidate, draft_tokens)
