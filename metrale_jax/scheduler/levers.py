"""Levers: knobs an operator may turn while the engine serves.

Reads and writes go through one lock; the engine reads a consistent copy once per tick.
Each write is validated against the engine's compiled limits (a token budget or batch size
beyond what the buckets were built for would mean compiling mid-serving).
"""

from __future__ import annotations

import dataclasses
import threading
import typing


class LeverError(ValueError):
    """A lever name or value is invalid; the message names the lever."""


@dataclasses.dataclass(frozen=True)
class LeverValues:
    max_tokens_per_tick: int       # token budget of one ragged batch
    max_batch_size: int            # sequences running at once
    admit_watermark: float         # fraction of KV blocks admission keeps free for growth
    prefill_chunk_size: int        # longest prefill chunk of one sequence per tick
    swap_enabled: bool             # spill sequences to disk instead of recomputing
    pipeline_enabled: bool         # dispatch step N+1 before reading step N
    prefix_cache_enabled: bool     # reuse cached prefix blocks at admission
    # The MTP gate's policy: auto (speculate where it pays) / on / off. Only "off" exists
    # where speculative decoding is not configured.
    mtp_policy: str = "off"
    # How many ticks a queued rotation (an adapter load, unload or replace, or the cohort
    # gate's load of an adapter that waiting requests need) lets new work keep being
    # admitted before admission holds everything so the engine drains to the quiescence
    # rotations need. Counted in ticks, not seconds, so the bound on a request's wait is
    # one a test can state exactly: 0 drains at once (rotations first), a large value lets
    # requests for resident adapters run longer (throughput first); neither side starves,
    # as the hold always ends with the rotation and the tick after it always admits.
    rotation_hold_ticks: int = 16


MTP_POLICIES = ("auto", "on", "off")
ZERO_ALLOWED = ("rotation_hold_ticks",)  # integer levers whose floor is 0, not 1


class Levers:
    def __init__(self, values: LeverValues, limits: dict[str, int],
                 speculative: bool = False):
        self._limits = dict(limits)  # upper bounds fixed by the compiled buckets
        self._speculative = speculative  # the speculative step was built
        self._lock = threading.Lock()
        self._values = self._validated(values)

    def get(self) -> LeverValues:
        with self._lock:
            return self._values

    def set(self, **changes) -> LeverValues:
        known = {f.name for f in dataclasses.fields(LeverValues)}
        for name in changes:
            if name not in known:
                raise LeverError(f"{name}: unknown lever; levers are {sorted(known)}")
        with self._lock:
            self._values = self._validated(dataclasses.replace(self._values, **changes))
            return self._values

    def as_dict(self) -> dict:
        return dataclasses.asdict(self.get())

    def _validated(self, v: LeverValues) -> LeverValues:
        hints = typing.get_type_hints(LeverValues)
        for f in dataclasses.fields(v):
            value, want = getattr(v, f.name), hints[f.name]
            if want is str:
                if value not in MTP_POLICIES:
                    raise LeverError(f"{f.name}: must be one of {MTP_POLICIES}, got {value!r}")
                if value != "off" and not self._speculative:
                    raise LeverError(f"{f.name}: speculative decoding is not configured (start "
                                     "the engine with a speculative_config)")
                continue
            ok = (type(value) is bool) if want is bool else (
                isinstance(value, (int, float)) and type(value) is not bool
                if want is float else isinstance(value, int) and type(value) is not bool)
            if not ok:
                raise LeverError(f"{f.name}: expected {want.__name__}, got {value!r}")
            limit = self._limits.get(f.name)
            low = 0 if f.name in ZERO_ALLOWED else 1
            if want is int and not low <= value <= (limit or value):
                raise LeverError(f"{f.name}: must be in [{low}, {limit}], got {value}")
        if not 0.0 <= v.admit_watermark < 1.0:
            raise LeverError(f"admit_watermark: must be in [0, 1), got {v.admit_watermark}")
        return v
