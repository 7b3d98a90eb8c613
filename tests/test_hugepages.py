"""runner/hugepages.py: which stretches of memory get advised (neighbouring buffers merged;
a large run gets the huge pages over its ends, inside its mapping; a small one only whole
pages inside it), and that advising leaves every value where it was."""

from __future__ import annotations

import jax
import numpy as np

from metrale_jax.runner import hugepages
from metrale_jax.runner.hugepages import GAP, HUGE_PAGE


class _Buffer:
    def __init__(self, start: int, nbytes: int):
        self.start, self.nbytes = start, nbytes

    def unsafe_buffer_pointer(self) -> int:
        return self.start


def test_stretches_merge_neighbours_and_keep_whole_pages(monkeypatch):
    base = 1000 * HUGE_PAGE
    # Five 1 MiB buffers side by side from just past a page edge (one whole huge page
    # inside), one far away and too small for a page of its own, one big buffer starting
    # past a page edge.
    spans = [(base + 100 + i * ((1 << 20) + 64), 1 << 20) for i in range(5)]
    spans += [(base + 50 * HUGE_PAGE, 1 << 20), (base + 80 * HUGE_PAGE + 4096, 5 * HUGE_PAGE)]
    monkeypatch.setattr(hugepages, "_buffers", lambda tree: list(spans))
    monkeypatch.setattr(hugepages, "_mappings", lambda: [])  # no mapping known: inside only
    got = hugepages._stretches(None)
    assert got == [(base + HUGE_PAGE, base + 2 * HUGE_PAGE),
                   (base + 81 * HUGE_PAGE, base + 85 * HUGE_PAGE)]
    # Further apart than GAP: not one stretch.
    spans[:] = [(base, HUGE_PAGE + 4096), (base + HUGE_PAGE + 4096 + GAP + 1, HUGE_PAGE)]
    assert hugepages._stretches(None) == [(base, base + HUGE_PAGE)]


def test_advise_keeps_the_values():
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(n).astype(np.float32) for n in (3 << 20, 1 << 16, 5 << 18)]
    arrays = [jax.device_put(a) for a in host]
    collapsed = hugepages.advise(arrays)
    over = sum(-(-a.nbytes // HUGE_PAGE) + 1 for a in host) * HUGE_PAGE
    assert collapsed % HUGE_PAGE == 0 and collapsed <= over
    for a, h in zip(arrays, host):
        np.testing.assert_array_equal(np.asarray(a), h)
    assert hugepages.advise(arrays, budget=0) == 0  # advised, nothing collapsed


def test_large_runs_get_the_pages_over_their_ends_inside_their_mapping(monkeypatch):
    base = 1000 * HUGE_PAGE
    # A 5 MiB buffer from 1 MiB past a page edge: 3 pages over it, 1 whole page inside...
    big = (base + (1 << 20), 5 << 20)
    # ...a small one, and a large one whose mapping starts just before it.
    small = (base + 20 * HUGE_PAGE + 100, 1 << 19)
    edge = (base + 40 * HUGE_PAGE + (1 << 20), 3 << 20)
    monkeypatch.setattr(hugepages, "_buffers", lambda tree: [big, small, edge])
    monkeypatch.setattr(hugepages, "_mappings", lambda: [
        (base - HUGE_PAGE, base + 30 * HUGE_PAGE),
        (base + 40 * HUGE_PAGE + 4096, base + 50 * HUGE_PAGE)])
    assert hugepages._stretches(None) == [
        (base, base + 3 * HUGE_PAGE),  # over both ends
        (base + 41 * HUGE_PAGE, base + 42 * HUGE_PAGE)]  # not before its mapping starts


def test_the_process_mappings_hold_its_arrays():
    a = jax.device_put(np.ones(3 << 20, np.float32))
    start = a.addressable_shards[0].data.unsafe_buffer_pointer()
    assert any(lo <= start and start + a.nbytes <= hi for lo, hi in hugepages._mappings())
