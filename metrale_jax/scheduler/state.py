"""What the tick loop holds between ticks besides sequences, and what one tick plans."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from metrale_jax.lora.weights import LoraWeights
from metrale_jax.request import Request
from metrale_jax.scheduler.inbox import Abort, Received
from metrale_jax.sequence import Sequence


# How a rotation's caller hears of it: (result, None) or (None, the error), exactly once.
Ack = Callable[[Any, BaseException | None], None]


@dataclasses.dataclass
class Rotation:
    """A queued command that must run with nothing on the device (the rotation phase):
    `apply` runs on the engine thread; its result or exception goes to `ack`."""

    apply: Callable[[], Any]
    ack: Ack


@dataclasses.dataclass
class LoadAdapter:
    """Register an adapter (already read off the engine thread) and load it into a device
    slot; with `replace`, give a registered name new weights (a new version)."""

    name: str
    path: str
    weights: LoraWeights
    ack: Ack
    replace: bool = False
    int_id: int | None = None


@dataclasses.dataclass
class UnloadAdapter:
    """Free an adapter's slot and forget its name; requests still waiting for it fail."""

    name: str
    ack: Ack


ROTATIONS = (Rotation, LoadAdapter, UnloadAdapter)


@dataclasses.dataclass
class Pending:
    """The seed's `pending`: what arrived and is not yet admitted."""

    waiting: list[Sequence] = dataclasses.field(default_factory=list)  # accepted sequences
    # Rotation | LoadAdapter | UnloadAdapter, in arrival order (`ROTATIONS`)
    rotations: list = dataclasses.field(default_factory=list)
    closed: bool = False  # the inbox closed: no new requests will come

    def absorb(self, received: Received, on_request: Callable[[Request], None],
               on_abort: Callable[[str], None]) -> None:
        for item in received.items:
            if isinstance(item, Abort):
                on_abort(item.request_id)
            elif isinstance(item, ROTATIONS):
                self.rotations.append(item)
            else:
                on_request(item)
                self.waiting.extend(item.sequences)
        self.closed = self.closed or received.closed


@dataclasses.dataclass(frozen=True)
class TickPlan:
    """What `plan_tick` hands the lanes. The seed's lanes are StartPrefills(admitted),
    ContinuePrefills and Decode; the last two read the running lists, so only the first
    carries data."""

    admitted: list[Sequence] = dataclasses.field(default_factory=list)  # StartPrefills
    shutdown: bool = False    # the inbox closed and nothing is left: the loop stops


class OutputSink(Protocol):
    """Where the loop reports: called on the engine thread after every processed step."""

    def on_update(self, request: Request, seq: Sequence) -> None: ...

    def on_finished(self, request: Request) -> None: ...
