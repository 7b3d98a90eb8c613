"""What the tick loop holds between ticks, and what one tick plans."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Protocol

from metrale_jax.scheduler.inbox import Abort, Received
from metrale_jax.sequence import Sequence


@dataclasses.dataclass(eq=False)
class Request:
    """An accepted request: its sequences (n completions) and how it reports back."""

    request_id: str
    sequences: list[Sequence]
    prompt_text: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


@dataclasses.dataclass
class Rotation:
    """A queued adapter command, applied only at quiescence (the LoRA rotation phase).
    `apply` runs on the engine thread; its result or exception goes to `ack`."""

    apply: Callable[[], Any]
    ack: Callable[[Any, BaseException | None], None]


@dataclasses.dataclass
class Pending:
    queue: list[Sequence] = dataclasses.field(default_factory=list)
    rotations: list[Rotation] = dataclasses.field(default_factory=list)
    closed: bool = False

    def absorb(self, received: Received, on_request: Callable[[Request], None],
               on_abort: Callable[[str], None]) -> None:
        for item in received.items:
            if isinstance(item, Abort):
                on_abort(item.request_id)
            elif isinstance(item, Rotation):
                self.rotations.append(item)
            else:
                on_request(item)
                self.queue.extend(item.sequences)
        self.closed = self.closed or received.closed


class LaneKind(enum.Enum):
    START_PREFILLS = "start_prefills"
    CONTINUE_PREFILLS = "continue_prefills"
    DECODE = "decode"


@dataclasses.dataclass
class Lane:
    kind: LaneKind
    sequences: list[Sequence] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TickPlan:
    lanes: list[Lane]
    shutdown: bool = False


class OutputSink(Protocol):
    """Where the loop reports: called on the engine thread after every processed step."""

    def on_update(self, request: Request, seq: Sequence) -> None: ...

    def on_finished(self, request: Request) -> None: ...
