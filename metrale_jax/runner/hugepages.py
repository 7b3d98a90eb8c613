"""Back the large CPU buffers (weights, KV pages, SSM pools) with transparent huge pages.

A decode step of a few rows streams every weight once: on this kind of machine it is bound
by how fast memory reads, and with 4 KiB pages the prefetchers stop at every page edge and
the TLB misses every 4 KiB (~50k pages for a 200 MB model). XLA:CPU allocates through
malloc, which leaves transparent huge pages off where the system's setting is "madvise"
(the common default), so large arrays are advised here, once, after they are placed: each
2 MiB-aligned stretch inside a buffer is marked MADV_HUGEPAGE and collapsed now
(MADV_COLLAPSE, Linux 6.1+) rather than whenever khugepaged gets to it. Nothing changes but
where the bytes sit; a kernel or platform without the calls is left as it is.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import jax

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
# A collapse copies the pages (~300 MB/s here): past this, advised buffers are left to
# khugepaged, so a large model does not hold up the start. Small models gain the most.
COLLAPSE_BUDGET = 2 << 30
# Buffers this close are one stretch (malloc's headers and alignment padding in between).
GAP = 64 << 10


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advise(tree, budget: int = COLLAPSE_BUDGET) -> int:
    """Advise the CPU buffers of `tree`, collapsing at most `budget` bytes now; returns the
    bytes collapsed (0 where the system does not). Buffers smaller than a huge page (a
    0.5 MB layer) sit side by side in malloc's heap: neighbours closer than GAP are merged
    into one stretch first, so they are covered too."""
    madvise = _madvise()
    if madvise is None:
        return 0
    collapsed = 0
    for lo, hi in _stretches(tree):
        madvise(lo, hi - lo, MADV_HUGEPAGE)
        if collapsed + hi - lo <= budget and madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            collapsed += hi - lo
    if collapsed:
        logger.debug("collapsed %d MiB into huge pages", collapsed >> 20)
    return collapsed


def _buffers(tree) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU buffer of `tree`."""
    spans = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform == "cpu" and shard.data.nbytes:
                spans.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return spans


def _stretches(tree) -> list[tuple[int, int]]:
    """The whole huge pages inside runs of CPU buffers lying within GAP of each other."""
    merged: list[list[int]] = []
    for start, size in sorted(_buffers(tree)):
        end = start + size
        if merged and start <= merged[-1][1] + GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out = []
    for start, end in merged:
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = end // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            out.append((lo, hi))
    return out
