"""One host->device transfer per step: the step's small input arrays travel packed.

A ragged step has ~25 small input arrays (the batch layout, the sampling values). Moving
them one by one costs ~70 us each on the host's critical path, milliseconds a tick at large
batches; packed into one flat buffer per dtype they move in a few transfers and are sliced
apart inside the jitted step at static offsets (the `Layout` is part of the compile key, and
it only changes when the bucket does).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    treedef: Any
    # Per leaf: (buffer dtype name, offset, shape, leaf dtype name).
    entries: tuple[tuple[str, int, tuple[int, ...], str], ...]


@functools.cache
def _carrier(dtype: np.dtype) -> tuple[np.dtype, str, str]:
    """(carrier dtype, its name, the leaf dtype's name): bool travels as uint8, everything
    else in its own dtype. Cached: `dtype.name` costs microseconds, and a step packs ~25
    leaves on the host's critical path."""
    carrier = np.dtype(np.uint8) if dtype == np.bool_ else dtype
    return carrier, carrier.name, dtype.name


def pack(tree: Any) -> tuple[dict[str, np.ndarray], Layout]:
    leaves, treedef = jax.tree.flatten(tree)
    parts: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, int] = {}
    entries = []
    for leaf in leaves:
        host = np.asarray(leaf)
        carrier, key, name = _carrier(host.dtype)
        offset = sizes.get(key, 0)
        parts.setdefault(key, []).append(host.reshape(-1).astype(carrier, copy=False))
        sizes[key] = offset + host.size
        entries.append((key, offset, host.shape, name))
    buffers = {k: np.concatenate(v) if v else np.zeros(0, k) for k, v in parts.items()}
    return buffers, Layout(treedef, tuple(entries))


def unpack(buffers: dict[str, jax.Array], layout: Layout) -> Any:
    """Inside the jit: static slices of the flat buffers back into the original pytree."""
    leaves = []
    for key, offset, shape, dtype in layout.entries:
        size = int(np.prod(shape, dtype=np.int64))
        leaf = jax.lax.slice_in_dim(buffers[key], offset, offset + size).reshape(shape)
        leaves.append(leaf.astype(jnp.dtype(dtype)) if dtype != key else leaf)
    return jax.tree.unflatten(layout.treedef, leaves)
