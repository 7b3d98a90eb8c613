"""Packed copies of the linear layers' kernels for the CPU decode matmul.

A decode step streams every weight once, and on the CPU how fast it does depends on the
order of the reads: `pallas_kernels/cpu/packed_matmul.py` reads kernels packed into
contiguous column blocks ~1.3-1.8x faster than the model's `[in, out]` layout. The copy
sits beside the kernel (prefill chunks keep reading the kernel through XLA's dots), so it
costs the weights' memory once more, and it is made once, when the runner takes the model
(if the copies fit in half the available memory): a kernel changed afterwards must be
packed again.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.cpu import packed_matmul

logger = logging.getLogger(__name__)


class PackedKernel(nnx.Variable):
    """A linear layer's kernel in `packed_matmul.pack`'s layout: `[N/32, K, 32]` (f32) or
    `[N/32, K/2, 64]` (bf16)."""


def pack_linears(*modules: nnx.Module, budget: int | None = None,
                 tied_head: nnx.Module | None = None) -> int:
    """Give packed copies to the kernels inside `modules` that the packed matmul takes
    (`packed_matmul.packs`); the bytes the copies take.

    * A module's `PACK_GROUPS` (attribute name -> its linear layers over one input, e.g.
      q/k/v) get one copy of their kernels side by side, as that attribute: a decode step
      then streams them in one call.
    * Every other `nnx.Linear` gets its own, as `.packed`.
    * `tied_head`: a model whose logits read its embedding transposed gets that as
      `.logits_packed`.

    With a `budget` (bytes) the copies would exceed, none is made (a warning says so): the
    layers then keep their unpacked paths."""
    copies = _group_copies(modules)
    grouped = {id(layer) for _, _, layers in copies for layer in layers}
    copies += [(node, "packed", (node,)) for module in modules
               for _, node in nnx.iter_graph(module)
               if isinstance(node, nnx.Linear) and id(node) not in grouped]
    kernels = [(owner, name, _side_by_side(layers)) for owner, name, layers in copies]
    if tied_head is not None:
        kernels.append((tied_head, "logits_packed", tied_head.embed.embedding[...].T))
    kernels = [(owner, name, w) for owner, name, w in kernels if packed_matmul.packs(w)]
    need = sum(packed_matmul.packed_bytes(w) for _, _, w in kernels)
    if budget is not None and need > budget:
        logger.warning("not packing the weights for the CPU decode kernel: the copies "
                       "(%.1f GB) would not fit in %.1f GB; decode runs ~1.3-1.8x slower",
                       need / 1e9, budget / 1e9)
        return 0
    for owner, name, w in kernels:
        setattr(owner, name, PackedKernel(packed_matmul.pack(w)))
    return need


def _group_copies(modules) -> list[tuple[nnx.Module, str, tuple[nnx.Linear, ...]]]:
    """The `PACK_GROUPS` present in `modules`: all members there, one dtype and input width."""
    out = []
    for module in modules:
        for _, node in nnx.iter_graph(module):
            for name, members in getattr(type(node), "PACK_GROUPS", {}).items():
                layers = tuple(getattr(node, m, None) for m in members)
                if (all(isinstance(layer, nnx.Linear) for layer in layers)
                        and len({(layer.kernel.shape[0], layer.kernel[...].dtype)
                                 for layer in layers}) == 1):
                    out.append((node, name, layers))
    return out


def _side_by_side(layers: tuple[nnx.Linear, ...]) -> jax.Array:
    if len(layers) == 1:
        return layers[0].kernel[...]
    return jnp.concatenate([layer.kernel[...] for layer in layers], axis=1)


def memory_budget() -> int | None:
    """Half of the memory the system has available now (None where it does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return None
