"""The device-side input of one ragged step: one pytree, every field a padded int array.

Tokens travel flat (`[T]`, T a token bucket) through embeddings, projections and MLPs, where
raggedness costs nothing. Attention and the SSM scan need each sequence's tokens side by side,
so the host also sends a gather map into a padded `[S, Q]` layout (S a sequence bucket, Q the
query bucket: 1 for a pure decode step) and the way back (`token_row`, `token_col`).
Padding tokens write into the null KV block 0; padding rows use the null SSM slot 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    token_ids: Int[Array, "T"]        # [T] flat tokens of every sequence's chunk, then padding
    positions: Int[Array, "T"]        # [T] absolute position of each token in its sequence
    slot_mapping: Int[Array, "T"]     # [T] flat KV slot: block * block_size + offset
    token_row: Int[Array, "T"]        # [T] row of the token in the padded layout
    token_col: Int[Array, "T"]        # [T] column of the token in the padded layout
    gather_index: Int[Array, "S Q"]   # [S, Q] flat token index of each padded cell
    gather_valid: Bool[Array, "S Q"]  # [S, Q] False for padding cells
    context_lens: Int[Array, "S"]     # [S] tokens cached after this step (0 for padding rows)
    block_tables: Int[Array, "S MB"]  # [S, MB] physical KV blocks of each row, 0-padded
    ssm_slots: Int[Array, "S"]        # [S] SSM state slot of each row (0 = null slot)
    ssm_fresh: Bool[Array, "S"]       # [S] True when the row's chunk starts a sequence
    sample_index: Int[Array, "S"]     # [S] flat index of each row's last token this step
    adapter_slots: Int[Array, "S"]    # [S] LoRA slot of each row (0: base model, padding)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.context_lens.shape[0]

    @property
    def query_len(self) -> int:
        return self.gather_index.shape[1]

    def to_padded(self, x: jnp.ndarray) -> jnp.ndarray:
        """Flat `[T, ...]` -> padded `[S, Q, ...]`, padding cells zeroed."""
        padded = x[self.gather_index]
        mask = self.gather_valid.reshape(self.gather_valid.shape + (1,) * (x.ndim - 1))
        return jnp.where(mask, padded, jnp.zeros((), x.dtype))

    def to_flat(self, x: jnp.ndarray) -> jnp.ndarray:
        """Padded `[S, Q, ...]` -> flat `[T, ...]`."""
        return x[self.token_row, self.token_col]
