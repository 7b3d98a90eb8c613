"""Per-phase tick timings and the latest snapshot, readable from other threads while the
engine serves."""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Any

from metrale_jax.telemetry.clock import Clock


class Phase(enum.Enum):
    DRAIN = "drain"          # drain + admission gate (the seed's LoopDrain)
    SETTLE = "settle"        # waiting for a step that ran ahead
    SNAPSHOT = "snapshot"
    ROTATIONS = "rotations"
    SWAP_OUT = "swap_out"
    RESUME = "resume"        # swap-in / requeue of parked sequences
    PACK = "pack"            # lanes -> one ragged batch
    DISPATCH = "dispatch"    # handing the batch to the device
    PROCESS = "process"      # reading results back, committing tokens, emitting outputs


@dataclasses.dataclass
class PhaseStats:
    count: int = 0
    total_s: float = 0.0
    last_s: float = 0.0


class Telemetry:
    def __init__(self, clock: Clock):
        self.clock = clock
        self._lock = threading.Lock()
        self._phases = {p: PhaseStats() for p in Phase}
        self._snapshot: Any = None
        self._counters: dict[str, int] = {}

    def mark(self, phase: Phase, started: float) -> None:
        """Close a phase section that began at `started` (a `clock.now()` reading)."""
        elapsed = self.clock.now() - started
        with self._lock:
            stats = self._phases[phase]
            stats.count += 1
            stats.total_s += elapsed
            stats.last_s = elapsed

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def publish(self, snapshot: Any) -> None:
        with self._lock:
            self._snapshot = snapshot

    @property
    def snapshot(self) -> Any:
        with self._lock:
            return self._snapshot

    def phases(self) -> dict[str, PhaseStats]:
        with self._lock:
            return {p.value: dataclasses.replace(s) for p, s in self._phases.items()}

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)
