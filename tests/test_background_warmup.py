"""Variants compiled beside serving (runner/background_warmup.py), with jobs that only
record themselves: order, readiness, a failure that stops the rest, a hold, and close; the
shapes compiled first and the covering shape a batch runs in meanwhile."""

from __future__ import annotations

import threading

from metrale_jax.runner.background_warmup import BackgroundCompile, ReadyShapes
from metrale_jax.runner.buckets import StepShape, serve_first


def test_jobs_run_in_order_then_ready():
    done: list[int] = []
    later = BackgroundCompile([lambda i=i: done.append(i) for i in range(5)], "test variants")
    assert later.wait(timeout=30) and later.ready.is_set() and later.error is None
    assert done == [0, 1, 2, 3, 4]


def test_a_failing_job_stops_the_rest_and_never_sets_ready():
    done: list[int] = []

    def broken() -> None:
        raise RuntimeError("no such custom call")

    later = BackgroundCompile([lambda: done.append(0), broken, lambda: done.append(2)],
                              "test variants")
    assert not later.wait(timeout=30)
    assert isinstance(later.error, RuntimeError) and done == [0]
    assert not later.ready.is_set()


def test_close_stops_after_the_job_running_now():
    started, release = threading.Event(), threading.Event()
    done: list[int] = []

    def first() -> None:
        started.set()
        release.wait(timeout=30)
        done.append(0)

    later = BackgroundCompile([first, lambda: done.append(1)], "test variants")
    assert started.wait(timeout=30)
    closer = threading.Thread(target=later.close)
    closer.start()
    assert later._stop.wait(timeout=30)  # asked to stop while the first job still runs
    release.set()
    closer.join(timeout=30)
    assert done == [0] and not later.ready.is_set()


def test_serve_first_keeps_every_decode_shape_and_covers_every_prefill():
    decode = [StepShape(r, r, 1, 64) for r in (1, 2, 4, 8)]
    prefill = [StepShape(t, s, q, 64) for q in (8, 32) for t in (32, 64) for s in (2, 8)
               if t >= q]
    first = serve_first(decode + prefill)
    assert first == decode + [StepShape(64, 8, 32, 64)]
    assert all(any(f.covers(s) for f in first) for s in decode + prefill)
    assert not StepShape(8, 8, 1, 64).covers(StepShape(32, 2, 8, 64))  # a query too wide


def test_ready_shapes_fit_the_smallest_compiled_cover_of_the_same_kind():
    big, small = StepShape(64, 8, 32, 64), StepShape(32, 8, 32, 64)
    decode = StepShape(8, 8, 1, 64)
    ready = ReadyShapes([(big, False, False), (decode, False, False), (small, True, False)])
    assert ready.fit(StepShape(2, 2, 1, 64), False, False) == decode
    assert ready.fit(StepShape(32, 2, 8, 64), False, False) == big  # `small` is speculative
    assert ready.fit(StepShape(32, 2, 8, 64), True, False) == small
    assert ready.fit(StepShape(32, 2, 8, 64), False, True) == StepShape(32, 2, 8, 64)  # none
    ready.add((small, False, False))
    assert ready.fit(StepShape(32, 2, 8, 64), False, False) == small
    assert ready.fit(big, False, False) == big


def test_a_held_thread_compiles_nothing_until_released():
    done: list[int] = []
    hold = threading.Event()
    later = BackgroundCompile([lambda: done.append(0), lambda: done.append(1)], "test variants",
                              hold=hold)
    assert not later.wait(timeout=0.3) and done == [] and later.left == 2
    hold.set()
    assert later.wait(timeout=30) and done == [0, 1] and later.left == 0
