"""Variants compiled beside serving (runner/background_warmup.py), with jobs that only
record themselves: order, readiness, a failure that stops the rest, and close."""

from __future__ import annotations

import threading

from metrale_jax.runner.background_warmup import BackgroundCompile


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
