"""The LoRA device slots: every adapter the step can apply, stacked per target.

Slots are numbered 1..L (L = `LoraConfig.max_loras`); slot 0, "no adapter", takes no
storage and no work: a row on it runs the base model (its mask columns are all zero). Device
index `slot - 1` holds slot `slot`. R = `max_lora_rank`.

Per target, `B [L, R, out]`. A is stacked per group of targets that read one input (q/k/v,
gate/up, or a projection alone: `lora.targets.model_groups`): `A [in, G, L, R]`, the members'
A matrices side by side, so the step computes `x @ A` for the group with one matmul (a free
reshape to `[in, G*L*R]`: model/lora.py) and each member's `@ B` on its contiguous columns.
An adapter of rank r < R fills its slot's first r columns of A and first r rows of B (the
rest stay zero, adding nothing), with its scaling folded into B, so the step computes
`x @ A[:, slot] @ B[slot]` and nothing else.

A load or an unload is one jitted write of one whole slot (every target; zeros where the
adapter has none), with the slots donated: one fixed shape, compiled once at warm-up. The
runner issues it between steps; JAX orders it after every step already dispatched (they read
the donated buffers first), so a step in flight never sees half an adapter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from metrale_jax.config import ModelConfig
from metrale_jax.lora.config import LoraConfig
from metrale_jax.lora.targets import model_groups, model_targets
from metrale_jax.lora.weights import LoraError, LoraWeights
from metrale_jax.model.lora import LoraInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraSlots:
    a: dict[str, Float[Array, "I G L R"]]  # group path -> [in, members, max_loras, R]
    b: dict[str, Float[Array, "L R O"]]    # target path -> [max_loras, R, out], scaled

    def inputs(self, token_slots: Int[Array, "T"]) -> LoraInputs:
        """What the backbone reads in a LoRA step."""
        return LoraInputs.for_tokens(self.a, self.b, token_slots)


def allocate_lora_slots(cfg: ModelConfig, lora: LoraConfig) -> LoraSlots:
    """All slots zero, in the model's dtype."""
    n, r, dtype = lora.max_loras, lora.max_lora_rank, jnp.dtype(cfg.dtype)
    return LoraSlots(
        a={p: jnp.zeros((g.d_in, len(g.members), n, r), dtype)
           for p, g in model_groups(cfg).items()},
        b={p: jnp.zeros((n, r, t.d_out), dtype) for p, t in model_targets(cfg).items()})


def write_slot(slots: LoraSlots, index: Int[Array, ""], a: dict[str, Float[Array, "I G R"]],
               b: dict[str, Float[Array, "R O"]]) -> LoraSlots:
    """Device index `index` (= slot - 1) of every target from the host (jitted with `slots`
    donated). An index past the last slot writes nothing (warm-up compiles it that way)."""
    return LoraSlots(
        a={p: x.at[:, :, index].set(a[p].astype(x.dtype), mode="drop")
           for p, x in slots.a.items()},
        b={p: x.at[index].set(b[p].astype(x.dtype), mode="drop") for p, x in slots.b.items()})


def slot_arrays(cfg: ModelConfig, lora: LoraConfig, weights: LoraWeights | None,
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The host arrays `write_slot` takes: per group A `[in, G, R]`, per target B `[R, out]`,
    the adapter padded to rank R, scaling folded into B; zeros for targets it leaves alone
    (all zeros for `weights` None: an unload). Raises `LoraError` when the adapter does not
    fit this model or `lora`."""
    a, b = _target_arrays(cfg, lora, weights)
    return ({p: np.stack([a[t.path] for t in g.members], axis=1)
             for p, g in model_groups(cfg).items()}, b)


def _target_arrays(cfg: ModelConfig, lora: LoraConfig, weights: LoraWeights | None,
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per target: A `[in, R]` and B `[R, out]` (scaled), zeros where `weights` has none."""
    targets, rank = model_targets(cfg), lora.max_lora_rank
    a = {p: np.zeros((t.d_in, rank), np.float32) for p, t in targets.items()}
    b = {p: np.zeros((rank, t.d_out), np.float32) for p, t in targets.items()}
    if weights is None:
        return a, b
    name = weights.name
    for path, (wa, wb) in weights.targets.items():
        if path not in targets:
            raise LoraError(f"LoRA adapter {name!r}: {path} is not a target of this model")
        t, r = targets[path], np.shape(wa)[-1]
        if r > rank:
            raise LoraError(f"LoRA adapter {name!r}: rank {r} at {path} exceeds "
                            f"max_lora_rank {rank}")
        if np.shape(wa) != (t.d_in, r) or np.shape(wb) != (r, t.d_out):
            raise LoraError(f"LoRA adapter {name!r}: {path} has A {np.shape(wa)} and B "
                            f"{np.shape(wb)}, the model needs [{t.d_in}, r] and [r, {t.d_out}]")
        a[path][:, :r] = wa
        b[path][:r] = np.asarray(wb, np.float32) * np.float32(weights.scaling)
    return a, b
