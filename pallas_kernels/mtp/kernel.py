"""Pallas (Triton) fused speculative-decoding acceptance.

One program takes `block_rows` flat rows (request, position) and streams the vocabulary in
`block_v` tiles twice: pass 1 keeps an online max/sum of the tempered logits, the argmax and
the logit and draft probability of the draft token; pass 2 draws the residual sample
argmax(log max(0, p - q) + Gumbel) with noise hashed per tile, so neither probabilities nor
noise are ever materialised at [rows, vocab]. The tiny [S, k+1] epilogue (first rejection,
output tokens) is `common.finish`, shared with the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels._pallas import next_pow2, require, round_up, triton_params
from pallas_kernels.mtp.common import FlatRows, accept_rule, finish, flatten_rows, gumbel

_BIG = 2 ** 30


def _online_argmax(values, cols, best_val, best_idx):
    # First index of the maximum, like jnp.argmax: earlier tiles win ties.
    tile_max = jnp.max(values, axis=1)
    tile_idx = jnp.min(jnp.where(values == tile_max[:, None], cols, _BIG), axis=1)
    better = tile_max > best_val
    return jnp.where(better, tile_max, best_val), jnp.where(better, tile_idx, best_idx)


def _accept_kernel(logits_ref, q_ref, draft_ref, inv_t_ref, greedy_ref, seed0_ref, seed1_ref,
                   pos_ref, accept_ref, cand_ref, *, vocab: int, block_v: int):
    rows = draft_ref.shape[0]
    draft, inv_t = draft_ref[...], inv_t_ref[...]
    seed0, seed1, pos = seed0_ref[...], seed1_ref[...], pos_ref[...]
    steps = logits_ref.shape[1] // block_v
    neg_inf = jnp.full((rows,), -jnp.inf, jnp.float32)

    def tile(j):
        cols = j * block_v + jax.lax.broadcasted_iota(jnp.int32, (rows, block_v), 1)
        x = logits_ref[:, pl.ds(j * block_v, block_v)] * inv_t[:, None]
        x = jnp.where(cols < vocab, x, -jnp.inf)  # the padded vocabulary tail
        return cols, x, q_ref[:, pl.ds(j * block_v, block_v)]

    def pass1(j, carry):
        m, total, best_val, best_idx, x_draft, q_draft = carry
        cols, x, q = tile(j)
        m_next = jnp.maximum(m, jnp.max(x, axis=1))
        total = total * jnp.exp(m - m_next) + jnp.sum(jnp.exp(x - m_next[:, None]), axis=1)
        best_val, best_idx = _online_argmax(x, cols, best_val, best_idx)
        at_draft = cols == draft[:, None]
        x_draft += jnp.sum(jnp.where(at_draft, x, 0.0), axis=1)
        q_draft += jnp.sum(jnp.where(at_draft, q, 0.0), axis=1)
        return m_next, total, best_val, best_idx, x_draft, q_draft

    zeros = jnp.zeros((rows,), jnp.float32)
    first = jnp.zeros((rows,), jnp.int32)
    m, total, _, argmax, x_draft, q_draft = jax.lax.fori_loop(
        0, steps, pass1, (neg_inf, zeros, neg_inf, first, zeros, zeros))
    p_draft = jnp.where(draft >= 0, jnp.exp(x_draft - m) / total, 0.0)
    rows_view = FlatRows(None, None, draft, inv_t, greedy_ref[...], seed0, seed1, pos)
    accept = accept_rule(rows_view, p_draft, q_draft, argmax, vocab)

    def pass2(j, carry):
        cols, x, q = tile(j)
        residual = jnp.maximum(jnp.exp(x - m[:, None]) / total[:, None] - q, 0.0)
        score = jnp.log(residual) + gumbel(seed0[:, None], seed1[:, None], pos[:, None], cols)
        return _online_argmax(score, cols, *carry)

    _, sample = jax.lax.fori_loop(0, steps, pass2, (neg_inf, first))
    accept_ref[...] = accept.astype(jnp.int32)
    cand_ref[...] = jnp.where(greedy_ref[...] == 1, argmax, sample)


@functools.partial(jax.jit, static_argnames=("block_rows", "block_v", "num_warps", "num_stages",
                                             "interpret"))
def mtp_accept(
    target_logits: Float[Array, "S K1 V"],
    draft_tokens: Int[Array, "S K"],
    draft_probs: Float[Array, "S K V"],
    keys: jax.Array,
    temperatures: Float[Array, "S"],
    *,
    block_rows: int = 8,
    block_v: int = 1024,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[Int[Array, "S"], Int[Array, "S K1"]]:
    """Same contract as `reference.mtp_accept`; tiling: `block_rows` flat rows per program,
    `block_v` vocabulary columns per inner step."""
    rows = flatten_rows(target_logits, draft_tokens, draft_probs, keys, temperatures)
    r, v = rows.logits.shape
    require(block_rows >= 1 and block_v >= 1,
            f"block_rows={block_rows}, block_v={block_v}: must be >= 1")
    if not interpret:
        for name, size in (("block_rows", block_rows), ("block_v", block_v)):
            require(size & (size - 1) == 0, f"{name}={size}: a Triton tile must be a power of 2")
    block_v = min(block_v, next_pow2(v))
    rp, vp = round_up(r, block_rows), round_up(v, block_v)
    pad_rows = lambda t: jnp.pad(t, [(0, rp - r)] + [(0, 0)] * (t.ndim - 1))
    matrix = lambda t: jnp.pad(t, ((0, rp - r), (0, vp - v)))
    inputs = [matrix(rows.logits), matrix(rows.draft_probs)] + [
        pad_rows(t) for t in (rows.draft, rows.inv_temp, rows.greedy, rows.seed0, rows.seed1,
                              rows.position)]
    wide = pl.BlockSpec((block_rows, vp), lambda i: (i, 0))
    row = pl.BlockSpec((block_rows,), lambda i: (i,))
    accept, candidate = pl.pallas_call(
        functools.partial(_accept_kernel, vocab=v, block_v=block_v),
        grid=(rp // block_rows,),
        in_specs=[wide, wide] + [row] * 6,
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((rp,), jnp.int32)] * 2,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="mtp_accept",
    )(*inputs)
    return finish(accept[:r], candidate[:r], draft_tokens)
