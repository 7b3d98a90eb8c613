"""Step variants compiled on a thread of their own while the engine already serves.

Compiling every step variant of the built-in model takes ~60 s on 2 cores (2-4 s each,
almost all of it XLA's backend, which already uses both cores), and the speculative ones
(verification, drafting, the MTP modules) as long again. `metrale serve` compiles only
some plain shapes before it answers (`buckets.serve_first`: every decode shape, and the
largest prefill shapes, which cover the others) and the rest here, plain ones first: until
a batch's own shape is ready it runs padded in the smallest ready shape that covers it
(`ReadyShapes`): slower, the same tokens. The MTP gate keeps to the plain step
until every variant is ready (`ready`), so no tick ever waits for a compilation. XLA
compiles outside Python's lock; tracing takes it in slices, which slows the tick loop a
little while this runs and stalls it never.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from metrale_jax.runner.buckets import StepShape
from metrale_jax.runner.progress import LOG_EVERY_S

logger = logging.getLogger("metrale_jax.warmup")

# A step variant: its shape, whether it is the speculative step, whether it applies LoRA.
Variant = tuple[StepShape, bool, bool]


class ReadyShapes:
    """The step variants compiled so far, while others compile beside serving. The tick
    loop reads it, the compiling thread adds to it: `add` swaps in a new frozen set, so a
    reader never sees one that changes under it."""

    def __init__(self, ready: Iterable[Variant]):
        self._ready = frozenset(ready)
        self._lock = threading.Lock()

    def add(self, variant: Variant) -> None:
        with self._lock:
            self._ready = self._ready | {variant}

    def __contains__(self, variant: Variant) -> bool:
        return variant in self._ready

    def fit(self, shape: StepShape, speculative: bool, lora: bool) -> StepShape:
        """`shape` if its variant is compiled, else the smallest compiled shape of the same
        kind that covers it (`shape` again where none does: the caller compiles it)."""
        ready = self._ready
        if (shape, speculative, lora) in ready:
            return shape
        covering = [s for s, spec, lo in ready
                    if spec == speculative and lo == lora and s.covers(shape)]
        return min(covering, default=shape)


class BackgroundCompile:
    """Runs `jobs` (each compiles one variant, nothing else) in order on a daemon thread;
    `ready` is set once every one has run. A job that raises stops the rest: `error` holds
    why, `ready` stays unset (what needed those variants keeps to what is compiled)."""

    def __init__(self, jobs: Sequence[Callable[[], None]], what: str,
                 hold: threading.Event | None = None):
        """`hold`: the thread waits for it to be set before it compiles anything (tests
        serve on what was compiled first for as long as they need)."""
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.done = 0  # jobs run so far
        self._jobs, self._what, self._hold = list(jobs), what, hold
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrale-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._hold is not None:
            while not self._hold.wait(0.1):
                if self._stop.is_set():
                    return
        start = last_log = time.monotonic()
        logger.info("warm-up: compiling %d %s beside serving", len(self._jobs), self._what)
        for job in self._jobs:
            if self._stop.is_set():
                return
            try:
                job()
                self.done += 1
                if time.monotonic() - last_log >= LOG_EVERY_S and self.done < len(self._jobs):
                    last_log = time.monotonic()
                    logger.info("warm-up: %d/%d %s compiled beside serving in %.0f s",
                                self.done, len(self._jobs), self._what, last_log - start)
            except BaseException as err:  # noqa: BLE001 - reported; serving goes on without
                self.error = err
                logger.error("warm-up: %s failed to compile (%s: %s); the %d left stay "
                             "uncompiled: batches run padded in the shapes compiled before, "
                             "speculation stays off", self._what, type(err).__name__, err,
                             len(self._jobs) - self.done)
                return
        logger.info("warm-up: %d %s ready in %.1f s", len(self._jobs), self._what,
                    time.monotonic() - start)
        self.ready.set()

    @property
    def left(self) -> int:
        """Jobs not run yet (the one compiling now included)."""
        return 0 if self.ready.is_set() else len(self._jobs) - self.done

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every variant is compiled (True) or the timeout passes."""
        self._thread.join(timeout)
        return self.ready.is_set()

    def close(self) -> None:
        """Stop after the variant compiling now (a compilation cannot be cut short)."""
        self._stop.set()
        self._thread.join()
