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

from flax import nnx

from pallas_kernels.cpu import packed_matmul

logger = logging.getLogger(__name__)


class PackedKernel(nnx.Variable):
    """A linear layer's kernel in `packed_matmul.pack`'s layout: `[N/32, K, 32]` (f32) or
    `[N/32, K/2, 64]` (bf16)."""


def pack_linears(*modules: nnx.Module, budget: int | None = None) -> int:
    """Give every `nnx.Linear` inside `modules` whose kernel the packed matmul takes
    (`packed_matmul.packs`) its packed copy as `.packed`; the bytes the copies take. With a
    `budget` (bytes) the copies would exceed, none is made (a warning says so): the layers
    then keep their unpacked paths."""
    layers = [node for module in modules for _, node in nnx.iter_graph(module)
              if isinstance(node, nnx.Linear) and packed_matmul.packs(node.kernel[...])]
    need = sum(packed_matmul.packed_bytes(layer.kernel[...]) for layer in layers)
    if budget is not None and need > budget:
        logger.warning("not packing the weights for the CPU decode kernel: the copies "
                       "(%.1f GB) would not fit in %.1f GB; decode runs ~1.3-1.8x slower",
                       need / 1e9, budget / 1e9)
        return 0
    for layer in layers:
        layer.packed = PackedKernel(packed_matmul.pack(layer.kernel[...]))
    return need


def memory_budget() -> int | None:
    """Half of the memory the system has available now (None where it does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return None
