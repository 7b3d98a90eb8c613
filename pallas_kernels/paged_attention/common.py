"""Shape checks shared by the paged-attention kernel and its reference, so they cannot drift.

K/V pages are head-major, `[num_blocks, kv_heads, block_size, head_dim]`: one KV head's keys
of a block are contiguous, so attention reads a page as a ready `[block_size, head_dim]` tile.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

from pallas_kernels._pallas import require

# A finite mask value keeps fully masked rows (padding) finite instead of NaN.
MASKED = -1e30


class RaggedLayout(Protocol):
    """How a ragged step lays out its tokens (the engine's `StepBatch` is one): flat tokens
    `[T]`, each row's run of them contiguous, and a gather map into the padded `[S, Q]`
    layout for kernels that want rows side by side."""
    positions: jax.Array       # [T] position of each token in its sequence
    gather_index: jax.Array    # [S, Q] flat token index of each padded cell (row start first)
    gather_valid: jax.Array    # [S, Q] False for padding cells
    block_tables: jax.Array    # [S, MB]
    context_lens: jax.Array    # [S]

    def to_padded(self, x: jax.Array) -> jax.Array: ...

    def to_flat(self, x: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class AttentionDims:
    seqs: int        # S: rows of the padded query layout
    queries: int     # Q: query cells per row
    heads: int       # H: query heads
    kv_heads: int    # KV heads; H // kv_heads query heads share one (GQA)
    head_dim: int
    num_blocks: int
    block_size: int
    max_blocks: int  # MB: width of the block table

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def attention_dims(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                   block_tables: jax.Array, context_lens: jax.Array,
                   q_positions: jax.Array) -> AttentionDims:
    require(q.ndim == 4, f"q: expected [S, Q, heads, head_dim], got shape {q.shape}")
    require(k_pages.ndim == 4, "k_pages: expected [blocks, kv_heads, block_size, head_dim], "
            f"got shape {k_pages.shape}")
    require(v_pages.shape == k_pages.shape,
            f"v_pages: shape {v_pages.shape} differs from k_pages {k_pages.shape}")
    s, nq, h, d = q.shape
    nb, kvh, bs, kd = k_pages.shape
    require(kd == d, f"k_pages: head_dim {kd} differs from q's {d}")
    require(h % kvh == 0, f"q: {h} heads are not a multiple of the {kvh} kv heads")
    require(block_tables.ndim == 2 and block_tables.shape[0] == s,
            f"block_tables: expected [{s}, max_blocks], got shape {block_tables.shape}")
    require(context_lens.shape == (s,),
            f"context_lens: expected [{s}], got shape {context_lens.shape}")
    require(q_positions.shape == (s, nq),
            f"q_positions: expected [{s}, {nq}], got shape {q_positions.shape}")
    return AttentionDims(s, nq, h, kvh, d, nb, bs, block_tables.shape[1])


def kv_write_dims(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                  slot_mapping: jax.Array) -> tuple[int, int, int, int, int]:
    require(k_pages.ndim == 4 and v_pages.shape == k_pages.shape,
            f"k_pages/v_pages: expected equal [blocks, kv_heads, block_size, head_dim], got "
            f"{k_pages.shape} and {v_pages.shape}")
    nb, kvh, bs, d = k_pages.shape
    t = slot_mapping.shape[0]
    require(slot_mapping.ndim == 1, f"slot_mapping: expected [T], got {slot_mapping.shape}")
    for name, x in (("k", k), ("v", v)):
        require(x.shape == (t, kvh, d),
                f"{name}: expected [{t}, {kvh}, {d}] to match the pages, got {x.shape}")
    return t, nb, bs, kvh, d
