"""Token sampling on the device: pure jnp, jittable, one row per sequence.

Every per-request knob is an array so that changing a request's temperature
(or any other value) reuses the compiled program; only the shapes (rows S,
vocab V) and the static arguments of `sample` select a program. Penalties and logit
bias read per-slot device tables of fixed widths (runner/penalties.py), each under a
traced cond, so no request feature is a shape or a static switch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from metrale_jax.runner.penalties import (SamplingTables, apply_slot_bias, penalize,
                                          penalty_counts, uses_penalties)
from metrale_jax.types import RowSampling
from pallas_kernels.reductions import first_argmax

_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters; see `make_sampling_arrays` for defaults."""

    temperature: Float[Array, "S"]  # 0.0 = greedy
    top_k: Int[Array, "S"]  # <= 0 = off
    top_p: Float[Array, "S"]  # >= 1.0 = off
    min_p: Float[Array, "S"]  # 0.0 = off
    seeds: Int[Array, "S"]  # uint32
    counters: Int[Array, "S"]  # tokens this request has sampled so far
    repetition_penalty: Float[Array, "S"]  # 1.0 = off
    presence_penalty: Float[Array, "S"]  # 0.0 = off
    frequency_penalty: Float[Array, "S"]  # 0.0 = off
    slots: Int[Array, "S"]  # the row's slot in the SamplingTables (0: padding)
    history_lens: Int[Array, "S"]  # history[slot, :len] is the row's prompt + output
    prompt_lens: Int[Array, "S"]  # the first prompt_len of those are prompt
    bias_on: Bool[Array, "S"]  # the row adds its slot's logit-bias entries
    logprobs_on: Bool[Array, "S"]  # the row reports logprobs (its token's, rank, top)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    tokens: Int[Array, "S"]
    logprobs: Float[Array, "S"]  # raw model logprob of `tokens`
    top_ids: Int[Array, "S K"]
    top_logprobs: Float[Array, "S K"]  # sorted descending


def needs_filters(rows: Sequence[RowSampling]) -> bool:
    """Value for `sample(apply_filters=...)`."""
    return any(r.uses_filters for r in rows)


def make_sampling_arrays(
    rows: Sequence[RowSampling], num_rows: int, slots: Sequence[int] = (),
    history_lens: Sequence[int] = (),
) -> SamplingArrays:
    """Packs rows into numpy arrays padded to `num_rows` (padding rows are greedy
    with everything off, in slot 0). `slots`: each row's slot in the SamplingTables
    (default: row i in slot i + 1, as `host_tables` lays them out); `history_lens`: the
    length of each row's history there (default: its prompt + output ids)."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows do not fit in {num_rows}")
    n = len(rows)

    def col(name: str, default, dtype) -> np.ndarray:
        out = np.full((num_rows,), default, dtype=dtype)
        out[:n] = [getattr(r, name) for r in rows]
        return out

    def per_row(values, dtype) -> np.ndarray:
        out = np.zeros((num_rows,), dtype=dtype)
        out[:n] = np.fromiter(values, dtype, n)
        return out

    seeds = np.zeros((num_rows,), dtype=np.uint32)
    seeds[:n] = [r.seed & 0xFFFFFFFF for r in rows]
    return SamplingArrays(
        temperature=col("temperature", 0.0, np.float32),
        top_k=col("top_k", 0, np.int32),
        top_p=col("top_p", 1.0, np.float32),
        min_p=col("min_p", 0.0, np.float32),
        seeds=seeds,
        counters=col("counter", 0, np.int32),
        repetition_penalty=col("repetition_penalty", 1.0, np.float32),
        presence_penalty=col("presence_penalty", 0.0, np.float32),
        frequency_penalty=col("frequency_penalty", 0.0, np.float32),
        slots=per_row(slots if len(slots) else range(1, n + 1), np.int32),
        history_lens=per_row(history_lens if len(history_lens) else
                             (len(r.prompt_ids) + len(r.output_ids) for r in rows), np.int32),
        prompt_lens=per_row((len(r.prompt_ids) for r in rows), np.int32),
        bias_on=per_row((bool(r.logit_bias) for r in rows), np.bool_),
        logprobs_on=per_row((r.logprobs for r in rows), np.bool_),
    )


def host_tables(rows: Sequence[RowSampling], history_len: int, bias_len: int,
                ) -> SamplingTables:
    """SamplingTables for `rows` laid out as `make_sampling_arrays` defaults them (row i in
    slot i + 1, slot 0 empty), histories and biases written: for tests and benchmarks that
    sample without a runner. Overflowing a width is an error, never a silent cut."""
    history = np.full((len(rows) + 1, history_len), -1, np.int32)
    bias_ids = np.full((len(rows) + 1, bias_len), -1, np.int32)
    bias_values = np.zeros((len(rows) + 1, bias_len), np.float32)
    for i, r in enumerate(rows, start=1):
        n = len(r.prompt_ids) + len(r.output_ids)
        if n > history_len:
            raise ValueError(f"row {i - 1}: history {n} > {history_len}")
        history[i, :n] = list(itertools.chain(r.prompt_ids, r.output_ids))
        if len(r.logit_bias) > bias_len:
            raise ValueError(f"row {i - 1}: {len(r.logit_bias)} biases > {bias_len}")
        bias_ids[i, :len(r.logit_bias)] = list(r.logit_bias.keys())
        bias_values[i, :len(r.logit_bias)] = list(r.logit_bias.values())
    return SamplingTables(history, bias_ids, bias_values)


# Sampling filters without a full sort.
#
# `filter_logits_reference` is the old definition: sort the row, keep the prefix that
# min_p, top_k and then top_p (on the renormalized remainder) allow, and keep every token
# tied with the last kept value. Its result is a per-row value threshold. The fast version
# computes the same threshold from the top `candidates + 1` values of each row
# (`lax.top_k`), which hold the whole sorted prefix the reference looks at whenever the
# pre-top_p set fits in `candidates` tokens; it then runs the reference's own arithmetic
# (softmax over the same prefix, cumsum) on that short prefix. A row whose pre-top_p set is
# larger (top_k off or > candidates, with a loose min_p) is still exact without a sort when
#   - top_p is off and top_k is off: the kept set is {x >= max + log(min_p)};
#   - top_k is off and the top `candidates` tokens already hold top_p of the mass (the
#     normalizer is then a sum over the full row, no order needed);
# and otherwise ("slow" rows: the nucleus is wider than the candidates, or
# candidates < top_k < V) the threshold comes from an exact bisection over the float32 bit
# patterns of the row (32 passes; no sort), run only when some row needs it.

FILTER_CANDIDATES = 64
_BISECT_STEPS = 32  # int32 keys: the interval halves each step, so 32 steps pin one float


def _float_key(x: Float[Array, "..."]) -> Int[Array, "..."]:
    """int32 key with the order of the float32 values (-0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _key_float(key: Int[Array, "..."]) -> Float[Array, "..."]:
    bits = jnp.where(key >= 0, key, key ^ jnp.int32(0x7FFFFFFF))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _mid(lo: Int[Array, "S"], hi: Int[Array, "S"]) -> Int[Array, "S"]:
    """floor((lo + hi) / 2) without int32 overflow; lo < mid < hi unless hi <= lo + 1."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def filter_logits_reference(
    scaled: Float[Array, "S V"],
    top_k: Int[Array, "S"],
    top_p: Float[Array, "S"],
    min_p: Float[Array, "S"],
) -> Float[Array, "S V"]:
    """The definition the fast `filter_logits` reproduces (one full sort per row):
    min_p, then top_k, then top_p on the renormalized remainder; excluded
    logits become -inf. Every filter keeps a prefix of the descending order, so
    one sort suffices and the result is a per-row value threshold (tokens tied
    with the last kept value are kept too)."""
    vocab = scaled.shape[1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    pos = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))[:, None]
    # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p); log(0) = -inf keeps all.
    min_logit = sorted_desc[:, :1] + jnp.log(min_p)[:, None]
    keep = (pos < k) & (sorted_desc >= min_logit)
    probs = jax.nn.softmax(jnp.where(keep, sorted_desc, _NEG_INF), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p >= 1 is "off": float cumsum can reach 1.0 before the tail ends.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep |= pos == 0
    last = jnp.sum(keep, axis=-1, keepdims=True) - 1
    threshold = jnp.take_along_axis(sorted_desc, last, axis=-1)
    return jnp.where(scaled >= threshold, scaled, _NEG_INF)



def _bisect_thresholds(
    scaled: Float[Array, "S V"],
    k: Int[Array, "S"],
    top_p: Float[Array, "S"],
    min_logit: Float[Array, "S"],
    row_max: Float[Array, "S"],
) -> Float[Array, "S"]:
    """The reference's threshold for every row, by bisection over float32 keys.

    The kept set is {x >= T}. Before top_p it is the first n0 = min(k, #{x >= min_logit})
    sorted positions; its lowest value L is the k-th largest value (found as the largest t
    with #{x >= t} >= k) when top_k binds, else min_logit works as the cut. top_p keeps
    position i iff the mass before it is < top_p, and ties with the last kept value are kept,
    so T is the smallest t in [L, max] with mass{x > t} < top_p (max when there is none):
    mass{x > t} is a fixed-order sum of non-negative terms, monotone in t, and only changes at
    row values, so bisection over the int32 keys ends exactly on a row value (or on L)."""
    # Keys of +0.0 for every value that compares equal to zero (-0.0, and subnormals
    # where the platform flushes them), so that key order is the float comparison order.
    keys = _float_key(jnp.where(scaled == 0.0, 0.0, scaled))  # [S, V]
    n_min = jnp.sum(scaled >= min_logit[:, None], axis=-1)  # [S]
    by_k = k < n_min  # [S] top_k, not min_p, ends the pre-top_p set

    def kth_largest(_) -> Float[Array, "S"]:
        lo = jnp.min(keys, axis=-1)  # #{x >= lo} = V >= k
        hi = jnp.max(keys, axis=-1) + 1  # #{x >= hi} = 0 < k

        def step(_, bounds):
            lo, hi = bounds
            mid = _mid(lo, hi)
            # mid == lo once hi == lo + 1: converged, keep the bounds.
            ok = (jnp.sum(keys >= mid[:, None], axis=-1) >= k) | (mid == lo)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi))
        return _key_float(lo)

    t_k = jax.lax.cond(jnp.any(by_k), kth_largest, lambda _: row_max, None)  # [S]
    lower = jnp.where(by_k, t_k, min_logit)  # [S]
    e = jnp.exp(scaled - row_max[:, None])  # [S, V]
    above_k = scaled > t_k[:, None]
    # The reference's top_k set holds only k of the values tied at T_k.
    ties = (k - jnp.sum(above_k, axis=-1)).astype(e.dtype)
    z_k = jnp.sum(jnp.where(above_k, e, 0.0), axis=-1) + ties * jnp.exp(t_k - row_max)
    z_min = jnp.sum(jnp.where(scaled >= min_logit[:, None], e, 0.0), axis=-1)
    probs = e / jnp.where(by_k, z_k, z_min)[:, None]  # [S, V]

    def step(_, bounds):
        lo, hi = bounds
        mid = _mid(lo, hi)
        ok = jnp.sum(jnp.where(keys > mid[:, None], probs, 0.0), axis=-1) < top_p
        ok &= mid != lo  # converged (hi == lo + 1): keep the bounds
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    # Invariant: hi is the answer if no smaller key is; keys in (lo, hi) are untested.
    lower_key = _float_key(jnp.where(lower == 0.0, 0.0, lower))
    _, hi = jax.lax.fori_loop(
        0, _BISECT_STEPS, step, (lower_key - 1, jnp.max(keys, axis=-1))
    )
    return jnp.where(top_p >= 1.0, lower, _key_float(hi))


def _filter_thresholds(
    scaled: Float[Array, "S V"],
    top_k: Int[Array, "S"],
    top_p: Float[Array, "S"],
    min_p: Float[Array, "S"],
    candidates: int,
) -> tuple[Float[Array, "S"], Float[Array, "S W"], Int[Array, "S W"], Bool[Array, "S"]]:
    """Per-row threshold T of `filter_logits_reference` (kept set = {x >= T}), the top W =
    min(candidates + 1, V) values and ids of each row, and whether every kept token is among
    those candidates."""
    n_rows, vocab = scaled.shape
    cap = max(1, min(candidates, vocab))
    width = min(cap + 1, vocab)
    # [S, W] descending, = the sort's prefix. The barrier keeps XLA from moving uses of
    # the result into the conds below, which would stop it from matching the sort it
    # expands top_k into back to its TopK kernel (CPU): a full sort, 30-50x slower. One
    # barrier per output: a single barrier over top_k's tuple crashes XLA:CPU's TopK
    # decomposer in a program over several devices (tensor parallel; jax 0.10.2).
    vals, ids = jax.lax.top_k(scaled, width)
    vals, ids = jax.lax.optimization_barrier(vals), jax.lax.optimization_barrier(ids)
    pos = jnp.arange(width)[None, :]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))  # [S]
    min_logit = vals[:, 0] + jnp.log(min_p)  # [S]
    keep0 = (pos < k[:, None]) & (vals >= min_logit[:, None])  # [S, W] pre-top_p prefix
    p_off = top_p >= 1.0  # [S]
    k_off = k >= vocab  # [S]
    if width > cap:
        overflow = keep0[:, cap]  # the pre-top_p set has more than `cap` tokens
    else:
        overflow = jnp.zeros((n_rows,), bool)
    # Rows whose pre-top_p set is {x >= min_logit} but larger than the candidates: the
    # normalizer is a full-row sum (its order differs from the sort's; rounding only).
    wide_p = overflow & k_off & ~p_off  # [S]

    def full_norm(_) -> Float[Array, "S"]:
        e = jnp.exp(scaled - vals[:, :1])
        return jnp.sum(jnp.where(scaled >= min_logit[:, None], e, 0.0), axis=-1)

    z = jax.lax.cond(
        jnp.any(wide_p), full_norm, lambda _: jnp.ones((n_rows,), scaled.dtype), None
    )
    # Where the pre-top_p set fits, this is the reference's arithmetic on its prefix.
    probs = jax.nn.softmax(jnp.where(keep0, vals, _NEG_INF), axis=-1)  # [S, W]
    probs = jnp.where(wide_p[:, None], jnp.exp(vals - vals[:, :1]) / z[:, None], probs)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep0 & ((mass_before < top_p[:, None]) | p_off[:, None])
    keep |= pos == 0
    last = jnp.sum(keep, axis=-1, keepdims=True) - 1
    threshold = jnp.take_along_axis(vals, last, axis=-1)[:, 0]  # [S]
    # top_k and top_p off: {x >= min_logit}, however many tokens that is.
    threshold = jnp.where(overflow & k_off & p_off, min_logit, threshold)
    if width > cap:
        # The nucleus may run past the candidates, or top_k cuts beyond them.
        slow = overflow & (~k_off | (~p_off & keep[:, cap]))  # [S]
        threshold = jax.lax.cond(
            jnp.any(slow),
            lambda thr: jnp.where(
                slow, _bisect_thresholds(scaled, k, top_p, min_logit, vals[:, 0]), thr
            ),
            lambda thr: thr,
            threshold,
        )
        in_candidates = vals[:, cap] < threshold
    else:
        in_candidates = jnp.ones((n_rows,), bool)
    return threshold, vals, ids.astype(jnp.int32), in_candidates


def filter_logits(
    scaled: Float[Array, "S V"],
    top_k: Int[Array, "S"],
    top_p: Float[Array, "S"],
    min_p: Float[Array, "S"],
    *,
    candidates: int = FILTER_CANDIDATES,
) -> Float[Array, "S V"]:
    """min_p, then top_k, then top_p on the renormalized remainder; excluded logits
    become -inf; tokens tied with the last kept value are kept. Same kept set as
    `filter_logits_reference`, without sorting the vocabulary: see `_filter_thresholds`.
    `candidates` (static) is how many top values per row the fast path looks at."""
    threshold, _, _, _ = _filter_thresholds(scaled, top_k, top_p, min_p, candidates)
    return jnp.where(scaled >= threshold[:, None], scaled, _NEG_INF)


def row_keys(seeds: Int[Array, "S"], counters: Int[Array, "S"]) -> Array:
    """Keys depend only on (seed, counter), not on batch layout."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(
        seeds.astype(jnp.uint32), counters
    )


def _top_logprobs(
    logp: Float[Array, "S V"], num_top: int
) -> tuple[Float[Array, "S K"], Int[Array, "S K"]]:
    if num_top == 0:
        n = logp.shape[0]
        return jnp.zeros((n, 0), logp.dtype), jnp.zeros((n, 0), jnp.int32)
    vals, ids = jax.lax.top_k(logp, num_top)
    return vals, ids.astype(jnp.int32)


def _mask_vocab(logits: Array, vocab_size: int | None) -> Float[Array, "S V"]:
    # bf16 logits lose too much in log_softmax/cumsum; work in f32.
    logits = logits.astype(jnp.float32)
    if vocab_size is None or vocab_size >= logits.shape[1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[1]) < vocab_size, logits, _NEG_INF)


def sample(
    logits: Float[Array, "S V"],
    params: SamplingArrays,
    tables: SamplingTables | None = None,
    *,
    num_top: int,
    apply_filters: bool = True,
    vocab_size: int | None = None,
) -> SampleResult:
    """Choose one token per row. Static: num_top, apply_filters, vocab_size (columns
    >= vocab_size are padding and never chosen). Logit bias, penalties and (with
    apply_filters) the filters each run only when some row asks for them (traced conds),
    so one compiled step serves every batch; bias and penalties read `tables` through
    each row's slot (None: no row may use them). Returned logprobs are raw."""
    logits = _mask_vocab(logits, vocab_size)
    processed = logits if tables is None else bias_and_penalties(logits, params, tables)
    greedy_tokens = first_argmax(processed)
    is_greedy = params.temperature <= 0.0

    def draw(_):
        temp = jnp.where(is_greedy, 1.0, params.temperature)[:, None]
        scaled = processed / temp  # [S, V]
        keys = row_keys(params.seeds, params.counters)

        def plain(_):
            drawn = gumbel_max(keys, scaled)
            return jnp.where(is_greedy, greedy_tokens, drawn)

        if not apply_filters:
            return plain(None)
        # Only sampled rows that ask for a filter are filtered; the others get neutral
        # values (threshold -inf), so their draw is the unfiltered one: the same token
        # `plain` draws, which a batch where no row filters takes without filtering.
        filters = ~is_greedy & (
            (params.top_k > 0) | (params.top_p < 1.0) | (params.min_p > 0.0)
        )

        def filtered(_):
            threshold, vals, ids, in_candidates = _filter_thresholds(
                scaled,
                jnp.where(filters, params.top_k, 0),
                jnp.where(filters, params.top_p, 1.0),
                jnp.where(filters, params.min_p, 0.0),
                FILTER_CANDIDATES,
            )
            # A filtered row whose kept set lies inside its candidates draws among them
            # (the same softmax over the same kept logits, W noise values instead of V);
            # which path a row takes depends only on that row, so draws stay independent
            # of the batch.
            short = filters & in_candidates  # [S]
            kept = jnp.where(vals >= threshold[:, None], vals, _NEG_INF)  # [S, W]
            pick = gumbel_max(keys, kept)[:, None]
            short_tokens = jnp.take_along_axis(ids, pick, axis=-1)[:, 0]
            full = ~is_greedy & ~short

            def full_draw(_):
                masked = jnp.where(scaled >= threshold[:, None], scaled, _NEG_INF)
                return gumbel_max(keys, masked)

            full_tokens = jax.lax.cond(
                jnp.any(full), full_draw, lambda _: greedy_tokens, None
            )
            drawn = jnp.where(short, short_tokens, full_tokens)
            return jnp.where(is_greedy, greedy_tokens, drawn)

        return jax.lax.cond(jnp.any(filters), filtered, plain, None)

    # An all-greedy batch (the common case) skips the filters and the noise.
    tokens = jax.lax.cond(
        jnp.all(is_greedy), lambda _: greedy_tokens, draw, operand=None
    )
    # Logprobs only for a batch where some row reports them (`logprobs_on`); else zeros.
    chosen, top_vals, top_ids = jax.lax.cond(
        jnp.any(params.logprobs_on), functools.partial(_logprobs, num_top=num_top),
        functools.partial(_no_logprobs, num_top=num_top), logits, tokens)
    return SampleResult(
        tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_vals
    )


def _logprobs(logits: Float[Array, "S V"], tokens: Int[Array, "S"], *, num_top: int):
    """Each row's raw logprob of its token and its top `num_top`: log_softmax's terms and
    order of ops, its [S, V] result made only for the top."""
    shifted_max = jnp.max(logits, axis=-1, keepdims=True)  # [S, 1]
    shifted_lse = jnp.log(jnp.sum(jnp.exp(logits - shifted_max), axis=-1))  # [S]
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    chosen = (picked - shifted_max[:, 0]) - shifted_lse
    top_vals, top_ids = _top_logprobs((logits - shifted_max) - shifted_lse[:, None], num_top)
    return chosen, top_vals, top_ids


def _no_logprobs(logits: Float[Array, "S V"], tokens: Int[Array, "S"], *, num_top: int):
    rows = logits.shape[0]
    return (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, num_top), jnp.float32),
            jnp.zeros((rows, num_top), jnp.int32))


def gumbel_max(keys: Array, logits: Float[Array, "S V"]) -> Int[Array, "S"]:
    """`jax.vmap(jax.random.categorical)(keys, logits)`, token for token: the same Gumbel
    noise from each row's key added to its logits, the first maximum taken by
    `first_argmax` rather than argmax's paired reduction (at 64 rows x 8k columns on
    XLA:CPU, 1.8 against 5.4 ms: a sampled batch paid that on every step). A seeded
    request's stream is what it was."""
    noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[1:], logits.dtype))(keys)
    return first_argmax(noise + logits)


def target_logits(logits: Float[Array, "R V"], params: SamplingArrays,
                  tables: SamplingTables, *, vocab_size: int | None = None,
                  ) -> Float[Array, "R V"]:
    """The logits each row's token is drawn from: bias and penalties applied, and for
    sampled rows divided by the temperature and filtered (-inf outside the kept set). A
    greedy row's argmax is `sample`'s greedy token and a sampled row's softmax is the
    distribution `sample` draws from: what speculative acceptance verifies drafts against."""
    processed = bias_and_penalties(_mask_vocab(logits, vocab_size), params, tables)
    is_greedy = params.temperature <= 0.0
    scaled = processed / jnp.where(is_greedy, 1.0, params.temperature)[:, None]
    filters = ~is_greedy & ((params.top_k > 0) | (params.top_p < 1.0) | (params.min_p > 0.0))

    def filtered(x):
        threshold, _, _, _ = _filter_thresholds(
            x, jnp.where(filters, params.top_k, 0), jnp.where(filters, params.top_p, 1.0),
            jnp.where(filters, params.min_p, 0.0), FILTER_CANDIDATES)
        return jnp.where(x >= threshold[:, None], x, _NEG_INF)

    return jax.lax.cond(jnp.any(filters), filtered, lambda x: x, scaled)


def raw_logprobs(logits: Float[Array, "R V"], chosen: Int[Array, "R"], *, num_top: int,
                 vocab_size: int | None = None) -> SampleResult:
    """What a row reports for a token chosen elsewhere (speculative acceptance): its raw
    logprob and the raw top-n."""
    logp = jax.nn.log_softmax(_mask_vocab(logits, vocab_size), axis=-1)
    safe = jnp.clip(chosen, 0, logp.shape[1] - 1)
    top_vals, top_ids = _top_logprobs(logp, num_top)
    return SampleResult(tokens=chosen, logprobs=jnp.take_along_axis(logp, safe[:, None],
                                                                    axis=-1)[:, 0],
                        top_ids=top_ids, top_logprobs=top_vals)


def token_ranks(logits: Float[Array, "N V"], chosen: Int[Array, "N"]) -> Int[Array, "N"]:
    """vLLM's rank: 1 + the number of tokens strictly more likely than the chosen one."""
    picked = jnp.take_along_axis(logits, jnp.clip(chosen, 0)[:, None], axis=-1)
    return 1 + jnp.sum(logits > picked, axis=-1).astype(jnp.int32)


def bias_and_penalties(logits: Float[Array, "S V"], params: SamplingArrays,
                        tables: SamplingTables) -> Float[Array, "S V"]:
    """Logit bias, then penalties on the biased logits (as before: bias first)."""
    logits = jax.lax.cond(
        jnp.any(params.bias_on),
        lambda x: apply_slot_bias(x, tables, params.slots, params.bias_on),
        lambda x: x, logits)
    penalized = uses_penalties(params.repetition_penalty, params.presence_penalty,
                               params.frequency_penalty)  # [S]

    def apply(x):
        seen, out = penalty_counts(tables.history, params.slots,
                                   jnp.where(penalized, params.history_lens, 0),
                                   params.prompt_lens, x.shape[1])
        return penalize(x, seen, out, params.repetition_penalty, params.presence_penalty,
                        params.frequency_penalty)

    return jax.lax.cond(jnp.any(penalized), apply, lambda x: x, logits)


def logprobs_of(
    logits: Float[Array, "N V"],
    targets: Int[Array, "N"],
    *,
    num_top: int,
    vocab_size: int | None = None,
) -> tuple[Float[Array, "N"], Int[Array, "N K"], Float[Array, "N K"]]:
    """Raw log_softmax logprob of each target (0.0 where target < 0) and the
    num_top best (ids, logprobs), sorted descending. For prompt logprobs."""
    logp = jax.nn.log_softmax(_mask_vocab(logits, vocab_size), axis=-1)
    safe = jnp.clip(targets, 0, logp.shape[1] - 1)
    target_lp = jnp.take_along_axis(logp, safe[:, None], axis=-1)[:, 0]
    target_lp = jnp.where(targets >= 0, target_lp, 0.0)
    top_vals, top_ids = _top_logprobs(logp, num_top)
    return target_lp, top_ids, top_vals
