"""Clocks. The engine reads time only through a `Clock`, so tests inject a fake one and
never sleep."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """Advances only when told to (or by `step` on every read, to give phases a duration)."""

    def __init__(self, start: float = 0.0, step: float = 0.0):
        self.t = start
        self.step = step

    def now(self) -> float:
        self.t += self.step
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
