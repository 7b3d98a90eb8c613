"""Token sampling on the device: pure jnp, jittable, one row per sequence.

Every per-request knob is an array so that changing a request's temperature
(or any other value) reuses the compiled program; only the shapes (rows S,
vocab V, history P, bias B) and the static flags of `sample` select a program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from metrale_jax.types import RowSampling

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
    history_ids: Int[Array, "S P"]  # prompt + output ids, -1 padded
    history_is_output: Bool[Array, "S P"]
    bias_ids: Int[Array, "S B"]  # -1 padded
    bias_values: Float[Array, "S B"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    tokens: Int[Array, "S"]
    logprobs: Float[Array, "S"]  # raw model logprob of `tokens`
    top_ids: Int[Array, "S K"]
    top_logprobs: Float[Array, "S K"]  # sorted descending


def needs_penalties(rows: Sequence[RowSampling]) -> bool:
    """Value for `sample(apply_penalties=...)`."""
    return any(r.uses_penalties for r in rows)


def needs_filters(rows: Sequence[RowSampling]) -> bool:
    """Value for `sample(apply_filters=...)`."""
    return any(r.uses_filters for r in rows)


def make_sampling_arrays(
    rows: Sequence[RowSampling], num_rows: int, history_len: int, bias_len: int
) -> SamplingArrays:
    """Packs rows into numpy arrays padded to `num_rows` (padding rows are greedy
    with everything off). Histories are only filled for rows that use penalties,
    so `history_len` may be 0 when none do."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows do not fit in {num_rows}")

    def col(name: str, default, dtype) -> np.ndarray:
        out = np.full((num_rows,), default, dtype=dtype)
        out[: len(rows)] = [getattr(r, name) for r in rows]
        return out

    history_ids = np.full((num_rows, history_len), -1, dtype=np.int32)
    history_is_output = np.zeros((num_rows, history_len), dtype=bool)
    bias_ids = np.full((num_rows, bias_len), -1, dtype=np.int32)
    bias_values = np.zeros((num_rows, bias_len), dtype=np.float32)
    for i, r in enumerate(rows):
        if r.uses_penalties:
            n_p, n_o = len(r.prompt_ids), len(r.output_ids)
            if n_p + n_o > history_len:
                # Truncating would silently change repetition-penalty semantics.
                raise ValueError(f"row {i}: history {n_p + n_o} > {history_len}")
            history_ids[i, :n_p] = r.prompt_ids
            history_ids[i, n_p : n_p + n_o] = r.output_ids
            history_is_output[i, n_p : n_p + n_o] = True
        if r.logit_bias:
            if len(r.logit_bias) > bias_len:
                raise ValueError(f"row {i}: {len(r.logit_bias)} biases > {bias_len}")
            bias_ids[i, : len(r.logit_bias)] = list(r.logit_bias.keys())
            bias_values[i, : len(r.logit_bias)] = list(r.logit_bias.values())

    seeds = np.zeros((num_rows,), dtype=np.uint32)
    seeds[: len(rows)] = [r.seed & 0xFFFFFFFF for r in rows]
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
        history_ids=history_ids,
        history_is_output=history_is_output,
        bias_ids=bias_ids,
        bias_values=bias_values,
    )


def _scatter_index(ids: Int[Array, "S N"], vocab: int) -> Int[Array, "S N"]:
    # jnp scatters wrap negative indices even with mode="drop", so route padding
    # (-1) and out-of-vocab ids to index `vocab`, which "drop" then discards.
    return jnp.where((ids >= 0) & (ids < vocab), ids, vocab)


def _row_scatter_add(
    base: Array, ids: Int[Array, "S N"], values: Array
) -> Array:
    rows = jnp.arange(base.shape[0])[:, None]
    return base.at[rows, _scatter_index(ids, base.shape[1])].add(values, mode="drop")


def apply_logit_bias(
    logits: Float[Array, "S V"], ids: Int[Array, "S B"], values: Float[Array, "S B"]
) -> Float[Array, "S V"]:
    if ids.shape[1] == 0:
        return logits
    return _row_scatter_add(logits, ids, values.astype(logits.dtype))


def penalize(
    logits: Float[Array, "S V"], p: SamplingArrays
) -> Float[Array, "S V"]:
    """Repetition (prompt+output, HF/vLLM) then frequency/presence (output, OpenAI)."""
    if p.history_ids.shape[1] == 0:
        return logits
    zeros = jnp.zeros(logits.shape, jnp.int32)
    valid = p.history_ids >= 0
    seen = _row_scatter_add(zeros, p.history_ids, valid.astype(jnp.int32)) > 0
    out_counts = _row_scatter_add(
        zeros, p.history_ids, (valid & p.history_is_output).astype(jnp.int32)
    ).astype(logits.dtype)
    rep = p.repetition_penalty[:, None].astype(logits.dtype)
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalized, logits)
    logits = logits - p.frequency_penalty[:, None] * out_counts
    return logits - p.presence_penalty[:, None] * (out_counts > 0)


def filter_logits(
    scaled: Float[Array, "S V"],
    top_k: Int[Array, "S"],
    top_p: Float[Array, "S"],
    min_p: Float[Array, "S"],
) -> Float[Array, "S V"]:
    """min_p, then top_k, then top_p on the renormalized remainder; excluded
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
    *,
    num_top: int,
    apply_penalties: bool,
    apply_filters: bool,
    vocab_size: int | None = None,
) -> SampleResult:
    """Choose one token per row. Static: num_top, apply_penalties, apply_filters,
    vocab_size (columns >= vocab_size are padding and never chosen). Logit bias
    is applied whenever B > 0. Returned logprobs are raw (pre-processing)."""
    logits = _mask_vocab(logits, vocab_size)
    raw_logp = jax.nn.log_softmax(logits, axis=-1)

    processed = apply_logit_bias(logits, params.bias_ids, params.bias_values)
    if apply_penalties:
        processed = penalize(processed, params)
    greedy_tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    is_greedy = params.temperature <= 0.0

    def draw(_):
        temp = jnp.where(is_greedy, 1.0, params.temperature)[:, None]
        scaled = processed / temp
        if apply_filters:
            scaled = filter_logits(scaled, params.top_k, params.top_p, params.min_p)
        keys = row_keys(params.seeds, params.counters)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(is_greedy, greedy_tokens, drawn)

    # An all-greedy batch (the common case) skips the sort and the noise.
    tokens = jax.lax.cond(
        jnp.all(is_greedy), lambda _: greedy_tokens, draw, operand=None
    )
    chosen = jnp.take_along_axis(raw_logp, tokens[:, None], axis=-1)[:, 0]
    top_vals, top_ids = _top_logprobs(raw_logp, num_top)
    return SampleResult(
        tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_vals
    )


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
