"""Step variants compiled on a thread of their own while the engine already serves.

`metrale serve` on the built-in model with speculative decoding warms ~23 plain and ~23
speculative variants; the speculative ones (verification, drafting, the MTP modules) take
most of a cold start (136 s, where the plain ones alone take 46-73 s on 2 cores). Only the
plain step is needed to serve, so the server answers once the plain variants are ready and
the speculative ones compile here: the gate chooses the plain step until `ready` is set, so
no tick ever waits for a compilation. XLA compiles outside Python's lock; tracing takes it
in slices, which slows the tick loop a little while this runs and stalls it never.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger("metrale_jax.warmup")


class BackgroundCompile:
    """Runs `jobs` (each compiles one variant, nothing else) in order on a daemon thread;
    `ready` is set once every one has run. A job that raises stops the rest: `error` holds
    why, `ready` stays unset (what needed those variants keeps to what is compiled)."""

    def __init__(self, jobs: Sequence[Callable[[], None]], what: str):
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._jobs, self._what = list(jobs), what
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrale-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        logger.info("warm-up: compiling %d %s beside serving", len(self._jobs), self._what)
        for job in self._jobs:
            if self._stop.is_set():
                return
            try:
                job()
            except BaseException as err:  # noqa: BLE001 - reported; serving goes on without
                self.error = err
                logger.error("warm-up: %s failed to compile (%s: %s); they stay off",
                             self._what, type(err).__name__, err)
                return
        logger.info("warm-up: %d %s ready in %.1f s", len(self._jobs), self._what,
                    time.monotonic() - start)
        self.ready.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every variant is compiled (True) or the timeout passes."""
        self._thread.join(timeout)
        return self.ready.is_set()

    def close(self) -> None:
        """Stop after the variant compiling now (a compilation cannot be cut short)."""
        self._stop.set()
        self._thread.join()
