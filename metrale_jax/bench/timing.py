"""Compilation time, counted from JAX's own compile events, so a benchmark can report it
apart from the time it measures (and show that nothing compiled inside the window)."""

from __future__ import annotations

import threading

import jax.monitoring

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_lock = threading.Lock()
_total = [0.0]
_installed = [False]


def _listener(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        with _lock:
            _total[0] += duration


def compile_seconds() -> float:
    """Seconds spent tracing, lowering and compiling in this process since the first call."""
    with _lock:
        if not _installed[0]:
            # JAX has no way to unregister one listener: install it once, for the process.
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed[0] = True
        return _total[0]
