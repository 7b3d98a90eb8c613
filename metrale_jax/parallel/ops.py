"""`ShardedOps`: the kernel set of a tensor-parallel model, each head-parallel op run per
shard with `jax.shard_map`.

XLA's partitioner cannot split a custom call (the CPU paged-attention FFI kernel) or a
Pallas kernel: left to it, their operands would be gathered whole onto every device. Every
op here is independent per head (attention per KV head and its query heads, the SSM scan
per Mamba2 head), so each device runs the very same kernel (or jnp reference) on its own
heads, with no communication: q `[S, Q, H, D]` by H, the pages `[blocks, kv_heads, bs, D]`
by KV head, x/dt/A/state by Mamba2 head; tables, lengths and positions replicated.

Two counts smaller than tp are widened first, as vLLM replicates KV heads: K/V written into
a pool of tp KV heads (`repeat`, so device i holds KV head i * kv_heads // tp, the one its
query heads read) and Mamba2's B/C groups likewise. `ShardedOps` is frozen and hashable
like `KernelOps`: the model keeps it as a static attribute.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from metrale_jax.parallel.specs import REPLICATED, axis_spec
from pallas_kernels.backend import KernelOps


@dataclasses.dataclass(frozen=True)
class ShardedOps:
    inner: KernelOps  # what each shard runs
    mesh: Mesh        # one axis, "tp"

    @property
    def name(self) -> str:
        return f"{self.inner.name}-tp{self.tp}"

    def linear(self, layer, x):
        """Projections stay plain dots under tensor parallelism: XLA partitions them."""
        return layer(x)

    def linear_group(self, layers, x, packed, norm=None):
        x = x if norm is None else norm(x)
        return tuple(layer(x) for layer in layers)

    @staticmethod
    def reads_packed(x, packed, kernel=None) -> bool:
        """No packed copies under tensor parallelism (they are not sharded)."""
        return False

    @property
    def tp(self) -> int:
        return self.mesh.shape["tp"]

    def _per_shard(self, fun, in_axes: tuple, out_axes):
        """`fun` under shard_map: argument i split on dimension in_axes[i] (None:
        replicated), likewise the outputs. Axes count from the end, so one rule serves
        the decode step's [S, H, P] and the scan's [S, Q, H, P]."""
        def specs(axes, arrays):
            if not isinstance(axes, tuple):  # one axis for every array
                axes = (axes,) * len(arrays)
            return tuple(REPLICATED if a is None else axis_spec(x.ndim, a)
                         for a, x in zip(axes, arrays, strict=True))

        def call(*args):
            out_shapes = jax.eval_shape(fun, *args)
            leaves, tree = jax.tree.flatten(out_shapes)
            mapped = jax.shard_map(
                fun, mesh=self.mesh, in_specs=specs(in_axes, args),
                out_specs=jax.tree.unflatten(tree, specs(out_axes, leaves)),
                check_vma=False)  # the FFI call carries no replication rule
            return mapped(*args)
        return call

    # -- attention ---------------------------------------------------------------------

    def write_kv_pages(self, k_pages: Float[Array, "blocks kvh bs hd"],
                       v_pages: Float[Array, "blocks kvh bs hd"], k: Float[Array, "T kv hd"],
                       v: Float[Array, "T kv hd"], slot_mapping: Int[Array, "T"]):
        k, v = _widen(k, k_pages.shape[1], axis=1), _widen(v, v_pages.shape[1], axis=1)
        return self._per_shard(self.inner.write_kv_pages, (-3, -3, -2, -2, None),
                               (-3, -3))(k_pages, v_pages, k, v, slot_mapping)

    def paged_attention(self, q: Float[Array, "S Q H hd"], k_pages, v_pages,
                        block_tables: Int[Array, "S MB"], context_lens: Int[Array, "S"],
                        q_positions: Int[Array, "S Q"], *, scale: float,
                        soft_cap: float | None = None, sliding_window: int | None = None):
        def attend(q, k_pages, v_pages, block_tables, context_lens, q_positions):
            return self.inner.paged_attention(q, k_pages, v_pages, block_tables, context_lens,
                                              q_positions, scale=scale, soft_cap=soft_cap,
                                              sliding_window=sliding_window)
        return self._per_shard(attend, (-2, -3, -3, None, None, None), -2)(
            q, k_pages, v_pages, block_tables, context_lens, q_positions)

    def ragged_paged_attention(self, q: Float[Array, "T H hd"], k_pages, v_pages, layout, *,
                               scale: float, soft_cap: float | None = None,
                               sliding_window: int | None = None):
        def attend(q, k_pages, v_pages, layout):
            return self.inner.ragged_paged_attention(q, k_pages, v_pages, layout, scale=scale,
                                                     soft_cap=soft_cap,
                                                     sliding_window=sliding_window)
        return self._per_shard(attend, (-2, -3, -3, None), -2)(q, k_pages, v_pages, layout)

    # -- Mamba2 (x [.., H, P], dt [.., H], a [H], b/c [.., G, N], state [S, H, P, N]) -------

    def _ssm(self, fun, x, dt, a, b, c, state, out_axes):
        b, c = _widen(b, self.tp, axis=-2), _widen(c, self.tp, axis=-2)
        return self._per_shard(fun, (-2, -1, -1, -2, -2, -3), out_axes)(x, dt, a, b, c, state)

    def ssd_chunk_scan(self, x, dt, a, b, c, init_state, *, chunk_size: int):
        def scan(x, dt, a, b, c, s):
            return self.inner.ssd_chunk_scan(x, dt, a, b, c, s, chunk_size=chunk_size)
        return self._ssm(scan, x, dt, a, b, c, init_state, (-2, -3))

    def ssm_decode_step(self, x, dt, a, b, c, state):
        return self._ssm(self.inner.ssm_decode_step, x, dt, a, b, c, state, (-2, -3))

    def ssd_scan_states(self, x, dt, a, b, c, init_state):
        return self._ssm(self.inner.ssd_scan_states, x, dt, a, b, c, init_state, (-2, -3))

    # -- MTP acceptance: over the whole vocabulary, not per head ---------------------------

    def mtp_accept(self, target_logits, draft_tokens, draft_probs, keys, temperatures):
        args = (target_logits, draft_tokens, draft_probs, keys, temperatures)
        if not self.inner.use_pallas:  # jnp: XLA partitions it like the sampler
            return self.inner.mtp_accept(*args)
        # A Pallas kernel cannot be partitioned: every device runs it on the whole batch.
        return self._per_shard(self.inner.mtp_accept, (None,) * 5, None)(*args)


def _widen(x: jax.Array, count: int, axis: int) -> jax.Array:
    """Repeat each entry of `axis` so it holds `count` (a multiple of what it holds):
    entry i of the result is entry i * n // count of x, as each shard needs."""
    n = x.shape[axis]
    return x if n >= count else jnp.repeat(x, count // n, axis=axis)
