"""One host->device transfer per step: the step's small input arrays travel packed.

A ragged step has ~25 small input arrays (the batch layout, the sampling values). Moving
them one by one costs ~50-70 us each on the host's critical path, milliseconds a tick at
large batches; packed into one byte buffer they move in one transfer and are viewed back
inside the jitted step at static offsets (the `Layout` is part of the compile key, and it
only changes when the bucket does).
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
    # Per leaf: (byte offset in the buffer, shape, dtype name).
    entries: tuple[tuple[int, tuple[int, ...], str], ...]
    nbytes: int


# Every leaf starts on a multiple of this, so the device can view its bytes as its dtype.
ALIGN = 8
BUFFER = "bytes"


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
    """Cached: `dtype.name` costs microseconds, and a step packs ~25 leaves on the host's
    critical path."""
    return dtype.name


def pack(tree: Any) -> tuple[dict[str, np.ndarray], Layout]:
    """The leaves of `tree` (numpy or scalars) as one flat uint8 buffer: each transfer
    costs ~50-70 us of host time whatever its size, so one buffer for all dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    hosts = [np.asarray(leaf) for leaf in leaves]
    entries, offset = [], 0
    for host in hosts:
        entries.append((offset, host.shape, _dtype_name(host.dtype)))
        offset += -(-host.nbytes // ALIGN) * ALIGN
    buffer = np.zeros(offset, np.uint8)
    for (start, _, _), host in zip(entries, hosts):
        buffer[start:start + host.nbytes] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    return {BUFFER: buffer}, Layout(treedef, tuple(entries), offset)


def unpack(buffers: dict[str, jax.Array], layout: Layout) -> Any:
    """Inside the jit: static slices of the byte buffer viewed back as the original leaves."""
    data = buffers[BUFFER]
    leaves = []
    for offset, shape, name in layout.entries:
        dtype = jnp.dtype(name)
        size = int(np.prod(shape, dtype=np.int64))
        raw = jax.lax.slice_in_dim(data, offset, offset + size * dtype.itemsize)
        if dtype == jnp.bool_:
            leaf = raw != 0
        elif dtype.itemsize == 1:
            leaf = jax.lax.bitcast_convert_type(raw, dtype)
        else:
            leaf = jax.lax.bitcast_convert_type(raw.reshape(size, dtype.itemsize), dtype)
        leaves.append(leaf.reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)
