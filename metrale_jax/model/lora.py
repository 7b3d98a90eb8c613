"""Batched multi-LoRA inside the step: every token gets its own row's adapter.

The adapters sit in device slots 1..L (L = max_loras, R = max_lora_rank; slot 0, no adapter,
has no storage): per target `B [L, R, out]` with the scaling folded in, and per group of
targets reading one input (q/k/v, gate/up, or a projection alone) `A [in, G, L, R]` (see
runner/lora_slots.py). Each token carries its row's slot. A target then adds
`(x @ A[:, slot]) @ B[slot]` per token.

How: against every slot at once, then masked. `x @ A` as one dense matmul gives
`[T, L*R]` per member (A's layout makes that a free reshape), a 0/1 mask keeps each token's
own slot's R columns, and one dense matmul with B `[L*R, out]` (free reshape too) sums back.
The work is T*L*R*(in+out) whatever the mix of adapters, as GEMMs and a multiply, with no
copy of the weights. Measured on the 2-core CPU (L=4, R=16; base = the [T, D] @ [D, D]
projection itself; a first version of this masked form, which also computed slot 0):

  D     T    base    per-token gather (A[slots] einsum)   masked GEMMs   lax.ragged_dot
  256   16   113us    87us                                115us          166us
  256   128  369us   701us                                165us          970us
  256   512  2.2ms   4.7ms                                0.7ms          4.1ms
  1024  16   1.5ms   0.3ms                                0.3ms          0.7ms
  1024  128  5.6ms   4.2ms                                0.9ms          4.0ms
  1024  512  19ms    69ms                                 2.4ms          14ms

The gather materialises `[T, in, R]` per projection; ragged_dot needs a sort and falls back
to a dense-per-group loop on XLA:CPU. At decode sizes on a small model each of these
matmuls is a YNNPACK fusion of 15-50us, so the count matters as much as the flops: the
members of a group share one `x @ A`, and slot 0 (no adapter) is neither stored nor computed
(a fifth of the work at L=4). Together they took the built-in model's batch-16 decode with
4 adapters on every target from 0.80x to 0.90x of the base step (0.76x to 0.92x delivered
through `LLM`; `python -m benchmarks.lora_step`). A block-diagonal B per group would also
save the per-member `@ B` calls, but multiplies their flops by the group size (untried).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraInputs:
    """What the backbone needs for a LoRA step (an explicit argument, never a global)."""

    a: dict[str, Float[Array, "I G L R"]]  # group path -> [in, members, L, R]
    b: dict[str, Float[Array, "L R O"]]    # target path -> [L, R, out], scaling folded in
    mask: Float[Array, "T LR"]             # [T, L*R] 1 on the R columns of the token's slot

    @classmethod
    def for_tokens(cls, a: dict, b: dict, token_slots: Int[Array, "T"]) -> "LoraInputs":
        """`token_slots`: [T] the adapter slot of each token's row (0: none, all zeros)."""
        num, r = next(iter(b.values())).shape[:2]
        dtype = next(iter(b.values())).dtype
        hit = token_slots[:, None] == jnp.arange(1, num + 1, dtype=token_slots.dtype)  # [T, L]
        return cls(a, b, jnp.repeat(hit.astype(dtype), r, axis=1))

    def block(self, index: int) -> "BlockLora | None":
        """The adapters of backbone block `index`: groups and targets by their own names."""
        prefix = f"blocks.{index}.mixer."

        def mine(d: dict) -> dict:
            return {p[len(prefix):]: x for p, x in d.items() if p.startswith(prefix)}

        a = mine(self.a)
        return BlockLora(a, mine(self.b), self.mask) if a else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockLora:
    a: dict[str, Float[Array, "I G L R"]]  # group name (qkv, gate_up, ...) -> see LoraInputs
    b: dict[str, Float[Array, "L R O"]]    # target name (q_proj, ...) -> see LoraInputs
    mask: Float[Array, "T LR"]             # see LoraInputs


def group_deltas(lora: BlockLora | None, group: str, x: Float[Array, "T I"],
                 members: tuple[str, ...]) -> tuple[Float[Array, "T _"] | None, ...]:
    """Per member target of `group` (in the group's order, lora.targets), the tokens' adapter
    outputs `x[t] @ A[:, slot_t] @ B[slot_t]`; Nones without adapters. One matmul against
    every slot's A of every member, then per member its columns, the other slots' masked
    out, and one matmul with its B over every slot."""
    if lora is None or group not in lora.a:
        return (None,) * len(members)
    a = lora.a[group]
    d_in, g, num, r = a.shape
    if g != len(members):
        raise ValueError(f"LoRA group {group}: {g} members on the device, {members} asked")
    h = x @ a.reshape(d_in, g * num * r).astype(x.dtype)           # [T, G*L*R]
    mask = lora.mask.astype(x.dtype)
    out = []
    for i, name in enumerate(members):
        hi = h[:, i * num * r:(i + 1) * num * r] * mask             # [T, L*R]
        out.append(hi @ lora.b[name].reshape(num * r, -1).astype(x.dtype))
    return tuple(out)


def project(linear: nnx.Linear, x: Float[Array, "T I"], delta: Float[Array, "T O"] | None,
            ops) -> Float[Array, "T O"]:
    """`linear(x)` through the module's `ops` (its KernelOps, static: small-batch matmuls
    may run as a custom call), plus the tokens' adapter output `delta` when there is one."""
    y = ops.linear(linear, x).astype(linear.dtype)  # 16-bit layers accumulate in f32
    return y if delta is None else y + delta.astype(y.dtype)


def project_group(linears: tuple[nnx.Linear, ...], x: Float[Array, "T I"],
                  deltas: tuple[Float[Array, "T _"] | None, ...], ops, packed, norm=None,
                  ) -> tuple[Float[Array, "T _"], ...]:
    """`project` for layers over one input; `packed`: their kernels' packed copy side by
    side (model/packing.py), or None (`KernelOps.linear_group`). `norm`: the block's
    pre-norm, applied to `x` first (inside the projection's call where the kernels can)."""
    ys = [y.astype(layer.dtype) for y, layer in zip(ops.linear_group(linears, x, packed, norm),
                                                     linears)]
    return tuple(y if d is None else y + d.astype(y.dtype) for y, d in zip(ys, deltas))
