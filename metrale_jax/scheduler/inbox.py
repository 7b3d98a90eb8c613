"""The inbox: how requests, aborts and admin commands reach the engine thread.

Any thread may `submit`; only the engine thread receives. `recv(wait=False)` never blocks;
`recv(wait=True)` blocks until something arrives or the inbox closes (the engine's idle wait).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: str


@dataclasses.dataclass
class Received:
    items: list[Any]
    closed: bool


class Inbox:
    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._closed = False
        self._cond = threading.Condition()

    def submit(self, item: Any) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is shutting down and accepts no new requests")
            self._items.append(item)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Aborts pass even after close: a client may still give up on accepted work."""
        with self._cond:
            self._items.append(Abort(request_id))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def recv(self, wait: bool = False, timeout: float | None = None) -> Received:
        with self._cond:
            if wait and not self._items and not self._closed:
                self._cond.wait(timeout)
            items = list(self._items)
            self._items.clear()
            return Received(items, self._closed)
