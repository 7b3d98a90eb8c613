"""Sessions: a multi-turn chat's latest turn kept on the device for its next turn.

A request may name a `session_id`. When one of its turns finishes, the session keeps that
turn's *tail*: its KV blocks (the last one partly full), the tokens they hold and, on a
hybrid model, its SSM/conv state at exactly its last computed token (a slot of the snapshot
pool the session holds). The next turn whose prompt extends those tokens
adopts the tail and computes only what is new: a block-grid snapshot is not needed, so a
chat whose history is shorter than a block still hits (the trap vLLM fell into with large
Mamba blocks). A prompt that does not extend the tail (an edited history) falls back to the
ordinary prefix cache; a prompt-logprobs request reuses nothing.

Budgets are `config.SessionConfig` (`EngineConfig.sessions`). A tail holds a reference
to each of its blocks (so LRU eviction cannot take them) and one snapshot slot (held: never
evicted). A tail over `max_session_blocks` is not kept; all tails together stay under
`max_pinned_fraction` of the KV pool and of the snapshot slots, the least recently used
idle session giving way. Memory pressure (a decode, an admission or a resume that finds no
block) takes tails back the same way (`give_back`, logged and counted): an idle session's
tail is stored in the second tier (`cache/tiers.StateTier`: host RAM, then disk) when
there is one, else the session is evicted; a running one only drops a tail its turn did
not extend. A stored tail comes back (scattered into fresh blocks and the sequence's slot)
when the next turn extends it; an unreadable one is a miss. Sessions end by TTL (the
scheduler's injected clock), by `close` (DELETE /v1/sessions/{id}), or by eviction.

An unknown session id opens a session. SGLang makes a client open one first because its
sessions *append* to server-side history (an unknown id would make the prompt mean
something else); here the prompt always carries the whole chat and a session only decides
what stays cached, so a new or misspelt id can cost a cache miss, never a wrong answer,
and a client of the OpenAI API needs no extra call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Callable

from metrale_jax.cache.tiers import StateTier
from metrale_jax.config import SessionConfig
from metrale_jax.scheduler.memory import Memory
from metrale_jax.sequence import Sequence
from metrale_jax.telemetry import Clock, Telemetry
from metrale_jax.types import Runner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CloseSession:
    """DELETE /v1/sessions/{id}: the engine thread closes it and acks True (found) or
    False (no such session)."""

    session_id: str
    ack: Callable[[object, BaseException | None], None]


@dataclasses.dataclass
class Tail:
    """A finished turn kept for the next one."""

    tokens: list[int]      # the tokens in the caches (its KV and SSM state cover them)
    blocks: list[int]      # the blocks holding them, one reference each; the last may be partial
    hashes: list[bytes]    # chain hashes of the committed full blocks
    adapter_id: int        # the LoRA version it was computed under
    stored: bool = False   # in the state tier (host RAM or disk): no blocks, no slot held


@dataclasses.dataclass
class Session:
    session_id: str
    last_used: float
    running: int = 0       # accepted sequences of this session not yet finished
    tail: Tail | None = None


def _owner(session_id: str) -> tuple[str, str]:
    """The snapshot pool's owner key of a session's tail state."""
    return ("session", session_id)


def _tier_key(session_id: str) -> str:
    """A file-safe, collision-free key for the state tier."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", session_id)[:64]
    return f"session-{safe}-{hashlib.blake2b(session_id.encode(), digest_size=6).hexdigest()}"


class Sessions:
    def __init__(self, config: SessionConfig, memory: Memory, clock: Clock, tel: Telemetry,
                 runner: Runner | None = None, tier: StateTier | None = None):
        self.config, self.memory, self.clock, self.tel = config, memory, clock, tel
        # The second tier (None or a disabled one: a tail leaving the device is gone).
        self.runner = runner
        self.tier = tier if tier is not None and tier.enabled and runner is not None else None
        if self.tier is not None:
            self.tier.on_drop = self._tier_dropped
        self._open: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    # ---- queries ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._open

    def _on_device(self) -> list[Session]:
        return [s for s in self._open.values() if s.tail and not s.tail.stored]

    @property
    def pinned_blocks(self) -> int:
        return sum(len(s.tail.blocks) for s in self._on_device())

    @property
    def num_tails(self) -> int:
        """Tails on the device (those in the state tier hold nothing there)."""
        return len(self._on_device())

    @property
    def num_stored(self) -> int:
        return sum(1 for s in self._open.values() if s.tail and s.tail.stored)

    def tables(self) -> dict:
        """The blocks tails hold, as tables for the pool's integrity check."""
        return {_owner(s.session_id): s.tail.blocks for s in self._on_device()}

    def owners(self) -> list:
        """The snapshot pool's owners of held tail states."""
        return [_owner(s.session_id) for s in self._on_device()] if self.memory.has_ssm else []

    def check_integrity(self) -> None:
        """Stored tails and the state tier's entries are the same set."""
        if self.tier is None:
            return
        stored = sorted(_tier_key(s.session_id) for s in self._open.values()
                        if s.tail and s.tail.stored)
        held = sorted(k for k in stored if k in self.tier)
        if stored != held or len(self.tier) != len(stored):
            raise AssertionError(f"stored session tails {stored} but the state tier holds "
                                 f"{len(self.tier)} entries")
        self.tier.check_integrity()

    # ---- a turn's lifetime --------------------------------------------------------------

    def accept(self, seq: Sequence) -> None:
        """A sequence naming a session arrived: open the session if it is new."""
        session = self._open.get(seq.session_id)
        if session is None:
            self._make_room_for_session()
            session = self._open[seq.session_id] = Session(seq.session_id, self.clock.now())
            self.tel.count("sessions_opened")
        session.running += 1
        self._touch(session)

    def take_tail(self, seq: Sequence) -> Tail | None:
        """At admission: the session's tail when the prompt extends its tokens (the
        sequence then owns its blocks and state: `Memory.adopt_tail`)."""
        session = self._open.get(seq.session_id) if seq.session_id else None
        tail = session.tail if session is not None else None
        if tail is None or tail.adapter_id != seq.adapter_id:
            return None
        n = len(tail.tokens)
        if len(seq.prompt_ids) <= n or seq.prompt_ids[:n] != tail.tokens:
            return None
        if tail.stored:
            if not self._restore(seq, session):
                return None
        else:
            session.tail = None
            self.memory.adopt_tail(seq, tail, _owner(session.session_id))
        self.tel.count("session_tail_hits")
        self.tel.count("session_tail_tokens", n)
        return tail

    def _restore(self, seq: Sequence, session: Session) -> bool:
        """A stored tail back onto the device, into fresh blocks and the sequence's slot;
        False (a miss: the prompt is computed) when no room can be made or the entry is
        gone or unreadable."""
        tail, memory = session.tail, self.memory
        needed = memory.blocks_for(len(tail.tokens))
        if not memory.make_room(needed):
            return False  # it stays stored for a later turn
        arrays = self.tier.take(_tier_key(session.session_id))
        session.tail = None
        if arrays is None:
            self.tel.count("session_tier_misses")
            return False
        blocks = memory.pool.allocate(needed)
        try:
            self.runner.scatter(arrays, blocks, seq.slot if memory.has_ssm else None)
        except ValueError as err:  # arrays of another layout: a miss, never an error
            logger.warning("session %s: stored tail unusable (%s)", session.session_id, err)
            memory.pool.release(blocks)
            self.tel.count("session_tier_misses")
            return False
        # Fresh blocks: committed to the prefix cache again as the turn commits.
        seq.block_table, seq.block_hashes = blocks, []
        seq.num_computed = len(tail.tokens)
        self.tel.count("session_tier_restores")
        return True

    def finish(self, seq: Sequence) -> None:
        """A sequence of a session is done (before its memory is released): keep its tail
        when it finished cleanly and fits the budgets."""
        session = self._open.get(seq.session_id)
        if session is None:
            return  # closed while the turn ran
        session.running -= 1
        self._touch(session)
        if seq.finish_reason not in ("stop", "length") or not seq.block_table:
            return
        computed = seq.num_computed
        if not 0 < computed <= len(seq.prompt_ids) + len(seq.output_ids):
            return
        blocks = seq.block_table[:self.memory.blocks_for(computed)]
        self._drop_tail(session)
        if not self._fits(session, len(blocks)):
            self.tel.count("session_tails_over_budget")
            return
        tail = Tail(seq.all_ids[:computed], list(blocks),
                    list(seq.block_hashes[:computed // self.memory.block_size]),
                    seq.adapter_id)
        if self.memory.pin_tail(seq, tail, _owner(session.session_id)):
            session.tail = tail

    # ---- ends ---------------------------------------------------------------------------

    def close(self, session_id: str, why: str = "deleted") -> bool:
        """End a session (its tail's blocks and state go back); False if none is open."""
        session = self._open.pop(session_id, None)
        if session is None:
            return False
        self._drop_tail(session)
        self.tel.count(f"sessions_{why}")
        logger.info("session %s closed (%s)", session_id, why)
        return True

    def expire(self) -> None:
        """End idle sessions past their TTL (the least recently used are first)."""
        now = self.clock.now()
        for session in list(self._open.values()):
            if now - session.last_used <= self.config.ttl_s:
                break
            if not session.running:
                self.close(session.session_id, "expired")

    def give_back(self) -> bool:
        """Memory pressure: the least recently used session holding a tail on the device
        gives it back: an idle one moves it to the state tier (or, without one, is evicted:
        ended); one running a turn only drops its stale tail (it did not extend it). False
        when no session holds anything on the device."""
        victim = next(iter(self._on_device()), None)
        if victim is None:
            return False
        if victim.running:
            logger.warning("session %s drops its last turn under memory pressure",
                           victim.session_id)
            self._drop_tail(victim)
            self.tel.count("session_tails_dropped")
            return True
        return self._evict(victim)

    def _evict(self, session: Session) -> bool:
        """An idle session's device tail must go: to the state tier when there is one,
        else the session ends."""
        if self.tier is not None and self._store(session):
            return True
        logger.warning("session %s evicted under memory pressure", session.session_id)
        return self.close(session.session_id, "evicted")

    def _store(self, session: Session) -> bool:
        """Copy a device tail to the state tier and free its blocks and slot."""
        tail, owner = session.tail, _owner(session.session_id)
        slot = self.memory.snapshots.held_slot(owner) if self.memory.has_ssm else None
        arrays = self.runner.gather(tail.blocks, slot)
        if not self.tier.put(_tier_key(session.session_id), arrays):
            return False
        self.memory.unpin_tail(tail, owner)
        session.tail = dataclasses.replace(tail, blocks=[], hashes=[], stored=True)
        self.tel.count("session_tails_stored")
        return True

    def _tier_dropped(self, key: str) -> None:
        """The tier's budgets pushed a stored tail out: its session has no tail any more."""
        for session in self._open.values():
            if session.tail and session.tail.stored and _tier_key(session.session_id) == key:
                session.tail = None
                self.tel.count("session_tails_dropped")
                return

    def drop_tails(self) -> None:
        """The device caches were lost: device tails hold nothing any more (sessions stay
        open; stored tails are intact)."""
        for session in self._on_device():
            self._drop_tail(session)

    # ---- budgets ------------------------------------------------------------------------

    def _fits(self, session: Session, num_blocks: int) -> bool:
        """Room for a tail of `num_blocks` under the per-session and global budgets, the
        least recently used idle sessions giving way."""
        cfg, memory = self.config, self.memory
        if num_blocks > cfg.max_session_blocks:
            return False
        block_cap = int(cfg.max_pinned_fraction * memory.pool.num_usable)
        slot_cap = int(cfg.max_pinned_fraction * memory.snapshots.total)
        if num_blocks > block_cap or (memory.has_ssm and slot_cap < 1):
            return False
        while (self.pinned_blocks + num_blocks > block_cap
               or (memory.has_ssm and self.num_tails + 1 > slot_cap)):
            victim = next((s for s in self._on_device()
                           if not s.running and s is not session), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _make_room_for_session(self) -> None:
        while len(self._open) >= self.config.max_sessions:
            victim = next((s for s in self._open.values() if not s.running), None)
            if victim is None:
                return  # every session is running a turn: go over rather than refuse
            self.close(victim.session_id, "evicted")

    def _drop_tail(self, session: Session) -> None:
        if session.tail is None:
            return
        if session.tail.stored:
            self.tier.drop(_tier_key(session.session_id))
        else:
            self.memory.unpin_tail(session.tail, _owner(session.session_id))
        session.tail = None

    def _touch(self, session: Session) -> None:
        session.last_used = self.clock.now()
        self._open.move_to_end(session.session_id)
