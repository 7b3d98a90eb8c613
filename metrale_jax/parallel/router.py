"""Data parallel routing: which of M engines gets a request (host only: no jax import).

Each engine keeps its own prefix cache, so a request is cheapest where its prompt's prefix
was sent before. The router remembers, per engine, the hash chains of the full blocks it
sent there (a bounded LRU, standing in for what that engine's cache holds) and picks:

1. the engine holding the longest prefix of the prompt, unless its load (requests routed
   there and not yet finished) exceeds the least loaded engine's by more than
   `max_imbalance`: affinity must not pile a popular prefix onto one engine;
2. otherwise the least loaded engine (the lowest index on ties).

The hashes chain over (parent, block tokens, adapter), as the block pool keys its blocks,
so a prefix under one adapter never matches another's. `RoundRobinRouter` is the baseline
the affinity is measured against.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    num_engines: int
    block_size: int = 16       # the engines' KV block size: only full blocks are cached
    # How many more in-flight requests the prefix's engine may hold than the least loaded
    # one before a request goes by load instead.
    max_imbalance: int = 4
    # Block hashes remembered per engine (LRU): about what its KV pool holds.
    blocks_per_engine: int = 65536

    def __post_init__(self) -> None:
        for name in ("num_engines", "block_size", "blocks_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance: must be >= 0, got {self.max_imbalance}")


def block_hashes(prompt_ids: Sequence[int], block_size: int, salt: str | None = None,
                 ) -> list[int]:
    """The hash chain of the prompt's full blocks: entry k names the first k+1 blocks."""
    hashes, parent = [], hash(("root", salt))
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(prompt_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixAffinityRouter:
    def __init__(self, config: RouterConfig):
        self.config = config
        self._seen = [collections.OrderedDict() for _ in range(config.num_engines)]
        self._load = [0] * config.num_engines
        self._owner: dict[str, int] = {}  # in-flight request id -> engine

    @property
    def loads(self) -> list[int]:
        return list(self._load)

    def route(self, request_id: str, prompt_ids: Sequence[int], salt: str | None = None,
              ) -> int:
        """The engine for a new request; counted as in flight there until `finished`."""
        hashes = block_hashes(prompt_ids, self.config.block_size, salt)
        least = min(range(len(self._load)), key=self._load.__getitem__)
        engine, matched = self._longest_prefix(hashes)
        if matched == 0 or self._load[engine] - self._load[least] > self.config.max_imbalance:
            engine = least
        return self._place(request_id, engine, hashes)

    def assign(self, request_id: str, prompt_ids: Sequence[int], engine: int,
               salt: str | None = None) -> int:
        """Count a request the caller sent to `engine` itself (a session's next turn goes
        where the session lives) as routed there: its load and its prefix."""
        if not 0 <= engine < self.config.num_engines:
            raise ValueError(f"engine: {engine} is not in [0, {self.config.num_engines})")
        return self._place(request_id, engine,
                           block_hashes(prompt_ids, self.config.block_size, salt))

    def owner(self, request_id: str) -> int | None:
        """The engine of an in-flight request (None once finished, or never routed)."""
        return self._owner.get(request_id)

    def _place(self, request_id: str, engine: int, hashes: list[int]) -> int:
        if request_id in self._owner:
            raise ValueError(f"request_id: {request_id!r} is already routed")
        self._remember(engine, hashes)
        self._load[engine] += 1
        self._owner[request_id] = engine
        return engine

    def finished(self, request_id: str) -> None:
        """The request left its engine (finished, aborted or failed); unknown ids are
        ignored, so a double report is harmless."""
        engine = self._owner.pop(request_id, None)
        if engine is not None:
            self._load[engine] -= 1

    def _longest_prefix(self, hashes: list[int]) -> tuple[int, int]:
        """(engine, blocks matched) of the engine holding the longest prefix; (0, 0) if
        none holds any. Ties go to the less loaded engine."""
        best, best_len = 0, 0
        for engine, seen in enumerate(self._seen):
            n = next((k + 1 for k in range(len(hashes) - 1, -1, -1) if hashes[k] in seen), 0)
            if n > best_len or (n == best_len and n and self._load[engine] < self._load[best]):
                best, best_len = engine, n
        return best, best_len

    def _remember(self, engine: int, hashes: list[int]) -> None:
        seen = self._seen[engine]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.config.blocks_per_engine:
            seen.popitem(last=False)


class RoundRobinRouter:
    """The baseline: engines in turn, whatever the prompt."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self._next = 0
        self._owner: dict[str, int] = {}

    def route(self, request_id: str, prompt_ids: Sequence[int], salt: str | None = None,
              ) -> int:
        engine = self._next
        self._next = (self._next + 1) % self.config.num_engines
        self._owner[request_id] = engine
        return engine

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def finished(self, request_id: str) -> None:
        self._owner.pop(request_id, None)
