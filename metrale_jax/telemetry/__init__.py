"""Telemetry: an injected clock, per-phase tick timings and the latest scheduler snapshot."""

from metrale_jax.telemetry.clock import Clock, FakeClock, MonotonicClock
from metrale_jax.telemetry.recorder import Phase, Telemetry

__all__ = ["Clock", "FakeClock", "MonotonicClock", "Phase", "Telemetry"]
