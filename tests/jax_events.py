"""Watching what JAX does while a test runs: the names of the functions behind one of its
monitoring events (every backend compilation, a persistent-cache hit included, records
'/jax/core/compile/backend_compile_duration'; every trace, '.../jaxpr_trace_duration')."""

from __future__ import annotations

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"


class EventWatch:
    """Names of the functions JAX records `event` for while the watch is on."""

    def __init__(self, event: str) -> None:
        self.event = event
        self.names: list[str] = []

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == self.event:
            self.names.append(str(kwargs.get("fun_name")))

    def __enter__(self) -> "EventWatch":
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self)
