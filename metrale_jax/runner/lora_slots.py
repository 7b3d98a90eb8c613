"""The LoRA device slots: every adapter the step can apply, stacked per target projection.

Per target (`lora.targets.target_paths`): `A [in, L+1, R]` and `B [L+1, R, out]`, L =
`LoraConfig.max_loras`, R = `max_lora_rank` (A stacked on its middle axis so that the step
reads `[in, (L+1)*R]` by a free reshape: one matmul against every slot, model/lora.py).
Slot 0 stays all zeros: a row on it runs the base model. An adapter of rank r < R fills its
slot's first r columns of A and first r rows of B (the rest stay zero, adding nothing), with
its scaling folded into B, so the step computes `x @ A[:, slot] @ B[slot]` and nothing else.

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
from metrale_jax.lora.targets import model_targets
from metrale_jax.lora.weights import LoraError, LoraWeights
from metrale_jax.model.lora import LoraInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraSlots:
    a: dict[str, Float[Array, "I L1 R"]]   # target path -> [in, max_loras+1, R]
    b: dict[str, Float[Array, "L1 R O"]]   # target path -> [max_loras+1, R, out], scaled

    def inputs(self, token_slots: Int[Array, "T"]) -> LoraInputs:
        """What the backbone reads in a LoRA step."""
        return LoraInputs.for_tokens(self.a, self.b, token_slots)


def allocate_lora_slots(cfg: ModelConfig, lora: LoraConfig) -> LoraSlots:
    """All slots zero, in the model's dtype."""
    n, r, dtype = lora.max_loras + 1, lora.max_lora_rank, jnp.dtype(cfg.dtype)
    targets = model_targets(cfg)
    return LoraSlots(a={p: jnp.zeros((t.d_in, n, r), dtype) for p, t in targets.items()},
                     b={p: jnp.zeros((n, r, t.d_out), dtype) for p, t in targets.items()})


def write_slot(slots: LoraSlots, slot: Int[Array, ""], a: dict[str, Float[Array, "I R"]],
               b: dict[str, Float[Array, "R O"]]) -> LoraSlots:
    """One slot of every target from the host (jitted with `slots` donated)."""
    return LoraSlots(a={p: x.at[:, slot].set(a[p].astype(x.dtype)) for p, x in slots.a.items()},
                     b={p: x.at[slot].set(b[p].astype(x.dtype)) for p, x in slots.b.items()})


def slot_arrays(cfg: ModelConfig, lora: LoraConfig, weights: LoraWeights | None,
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The host arrays `write_slot` takes: the adapter padded to rank R, scaling folded into
    B; zeros for targets it leaves alone (all zeros for `weights` None: an unload). Raises
    `LoraError` when the adapter does not fit this model or `lora`."""
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
