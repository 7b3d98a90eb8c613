"""Warm-up progress: a bar on a terminal, periodic log lines elsewhere.

Compiling every step variant takes minutes on a cold CPU start; a silent process looks hung.
The clock is injected so tests can drive the log cadence without sleeping.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

logger = logging.getLogger("metrale_jax.warmup")

LOG_EVERY_S = 10.0  # seconds between log lines when there is no terminal


class WarmupProgress:
    """Counts compiled variants; `advance()` after each, `close()` at the end."""

    def __init__(self, total: int, *, enabled: bool = True, stream=None,
                 clock: Callable[[], float] = time.monotonic, log_every_s: float = LOG_EVERY_S):
        self.total, self.done = total, 0
        self._clock, self._log_every = clock, log_every_s
        self._start = self._last_log = clock()
        stream = stream if stream is not None else sys.stderr
        self._bar = None
        self._enabled = enabled
        if enabled and getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="compiling step variants", unit="variant",
                             file=stream, dynamic_ncols=True)
        elif enabled:
            logger.info("warm-up: compiling %d step variants", total)

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
            return
        now = self._clock()
        if self._enabled and now - self._last_log >= self._log_every:
            self._last_log = now
            logger.info("warm-up: %d/%d step variants compiled in %.0f s", self.done,
                        self.total, now - self._start)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._enabled:
            logger.info("warm-up: %d step variants ready in %.1f s", self.done, self.elapsed)

    def __enter__(self) -> "WarmupProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
