"""Back the large CPU buffers (weights, KV pages, SSM pools) with transparent huge pages.

A decode step of a few rows streams every weight once: on this kind of machine it is bound
by how fast memory reads, and with 4 KiB pages the prefetchers stop at every page edge and
the TLB misses every 4 KiB (~50k pages for a 200 MB model). XLA:CPU allocates through
malloc, which leaves transparent huge pages off where the system's setting is "madvise"
(the common default), so large arrays are advised here, once, after they are placed: the
2 MiB-aligned pages over a buffer are marked MADV_HUGEPAGE and collapsed now
(MADV_COLLAPSE, Linux 6.1+) rather than whenever khugepaged gets to it. Nothing changes but
where the bytes sit; a kernel or platform without the calls is left as it is.

Why the pages *over* a buffer, not only those inside it: malloc places an 8 MB buffer
anywhere, so keeping to whole pages inside left up to 4 MiB of it (a quarter of a 49M
Llama's logits head, half of a 1.6 MB layer) on 4 KiB pages. A huge page reaching past a
buffer's ends into its neighbours' memory (still inside the same mapping) changes nothing
for them either.
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
# A stretch this large gets the huge pages over its ends too (see above); a smaller one
# only whole pages inside (a collapse copies 2 MiB for it).
OVER_ENDS = 1 << 20


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
    """The huge pages over runs of CPU buffers lying within GAP of each other: for a run of
    at least OVER_ENDS bytes, every page it touches that lies inside one mapping of this
    process (`_mappings`); for a shorter one, the whole pages inside it."""
    merged: list[list[int]] = []
    for start, size in sorted(_buffers(tree)):
        end = start + size
        if merged and start <= merged[-1][1] + GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    mappings = _mappings() if any(e - s >= OVER_ENDS for s, e in merged) else []
    out = []
    for start, end in merged:
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = end // HUGE_PAGE * HUGE_PAGE
        if end - start >= OVER_ENDS:
            for m_lo, m_hi in mappings:
                if m_lo <= start and end <= m_hi:
                    lo = max(start // HUGE_PAGE * HUGE_PAGE, -(-m_lo // HUGE_PAGE) * HUGE_PAGE)
                    hi = min(-(-end // HUGE_PAGE) * HUGE_PAGE, m_hi // HUGE_PAGE * HUGE_PAGE)
                    break
        if hi > lo:
            out.append((lo, hi))
    return out


def _mappings() -> list[tuple[int, int]]:
    """This process's private writable anonymous mappings (the heap's included), adjacent
    ones joined; empty where /proc/self/maps cannot be read."""
    spans: list[list[int]] = []
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p" or fields[4] != "0":
            continue
        if len(fields) > 5 and fields[5] != "[heap]":
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if spans and spans[-1][1] == lo:
            spans[-1][1] = hi
        else:
            spans.append([lo, hi])
    return [tuple(span) for span in spans]
