"""`DataParallelAsyncLLM`: M `AsyncLLM`s behind one prefix-affinity router, with the surface
the server uses from one `AsyncLLM` (the streaming API; `DataParallelLLM` is the offline one).

1. Each engine is a whole `AsyncLLM` on its own device group (`device_groups`: devices
   `[i * tp, (i + 1) * tp)`) with its own scheduler, caches and tick-loop thread. Nothing is
   shared between them but the router, which lives on the event loop.
2. `submit` picks the engine: a request naming a session goes where that session lives;
   any other goes where the router sends it (its prompt's prefix, else the least loaded
   engine: parallel/router.py), under its adapter as the hash salt. The request's queue is
   handed to that engine behind a small stand-in that tells the router when the request's
   end marker passes, so the router's loads count requests in flight.
3. Everything else per request (streaming, aborts) goes to the engine that holds it.
4. Commands fan out: adapter loads and unloads apply to every engine and answer once all
   have acknowledged (a load that fails on one is undone on the others); levers are set
   on every engine; a session's DELETE goes to the engine holding it (to all when its
   engine is not known).
5. Reads merge: `snapshot()` and `stats()` are the engines' summed (what /metrics and the
   admin snapshot report as totals; `engines` gives each one); `error` is the first
   engine's that failed, so /health is healthy only while every engine is.

The server builds this only for `--data-parallel-size` > 1: one engine is a plain
`AsyncLLM`, with no layer in between.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
from collections.abc import AsyncIterator, Hashable

from metrale_jax.async_engine import AsyncLLM, EngineLimits
from metrale_jax.engine import PromptInput, check_session_id
from metrale_jax.lora.weights import LoraError
from metrale_jax.outputs import StreamDelta
from metrale_jax.parallel.config import ParallelConfig
from metrale_jax.parallel.router import PrefixAffinityRouter, RouterConfig
from metrale_jax.request import RequestError, SamplingParams
from metrale_jax.scheduler.faults import EngineFailed
from metrale_jax.scheduler.levers import LeverValues
from metrale_jax.scheduler.snapshot import SchedulerSnapshot
from metrale_jax.telemetry.recorder import PhaseStats

# Sessions whose engine is remembered (LRU). A forgotten one costs only its tail: its next
# turn is routed by prefix and, on another engine, opens the session there afresh.
MAX_REMEMBERED_SESSIONS = 1 << 16


class _Release:
    """Stands in for a request's queue on its engine (the sink calls `put_nowait` on the
    event loop): forwards every item and, as the end marker passes, tells the router the
    request left its engine (finished, aborted or failed)."""

    __slots__ = ("queue", "keyed", "release")

    def __init__(self, queue: asyncio.Queue, keyed: bool, release) -> None:
        self.queue, self.keyed, self.release = queue, keyed, release

    def put_nowait(self, item) -> None:
        if (item[1] if self.keyed else item) is None:
            self.release()
        self.queue.put_nowait(item)


class DataParallelLevers:
    """The engines' levers as one: read from engine 0, set on every engine (validated by
    the first, so a bad value changes none)."""

    def __init__(self, levers: list) -> None:
        self._levers = levers

    def get(self) -> LeverValues:
        return self._levers[0].get()

    def set(self, **changes) -> LeverValues:
        values = self._levers[0].set(**changes)
        for levers in self._levers[1:]:
            levers.set(**changes)
        return values

    def as_dict(self) -> dict:
        return self._levers[0].as_dict()


class DataParallelAsyncLLM:
    def __init__(self, model: str | None = None, *, parallel: ParallelConfig,
                 router_config: RouterConfig | None = None, **engine_kwargs):
        """`engine_kwargs`: what `AsyncLLM` takes, the same for every engine. The device
        count is checked before any model loads."""
        from metrale_jax.parallel.placement import device_groups

        groups = device_groups(parallel)
        self._init([AsyncLLM(model, devices=group, parallel=parallel, **engine_kwargs)
                    for group in groups], router_config)

    @classmethod
    def from_engines(cls, engines: list[AsyncLLM],
                     router_config: RouterConfig | None = None) -> "DataParallelAsyncLLM":
        """A group of engines built elsewhere (tests: each with its own fake runner)."""
        group = cls.__new__(cls)
        group._init(list(engines), router_config)
        return group

    def _init(self, engines: list[AsyncLLM], router_config: RouterConfig | None) -> None:
        self.engines = engines
        self.data_parallel_size = len(self.engines)
        first = self.engines[0]
        self.limits: EngineLimits = first.limits
        self.router = PrefixAffinityRouter(router_config or RouterConfig(
            num_engines=self.data_parallel_size,
            block_size=first.engine.engine_config.block_size))
        self.levers = DataParallelLevers([e.levers for e in self.engines])
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._ids = itertools.count()
        self._error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def warmup(self) -> int:
        return sum(e.warmup() for e in self.engines)

    def start(self) -> None:
        for e in self.engines:
            e.start()

    @property
    def error(self) -> BaseException | None:
        """Why the first failed engine stopped (None while all serve)."""
        if self._error is None:
            for i, e in enumerate(self.engines):
                if e.error is not None:
                    self._error = EngineFailed(f"engine {i} of {len(self.engines)}: "
                                               f"{e.error!r}")
                    break
        return self._error

    def shutdown(self, timeout: float | None = None) -> None:
        """Every engine stops accepting at once and finishes what it holds; then each is
        joined and closed."""
        for e in self.engines:
            e.engine.close_inbox()
        for e in self.engines:
            e.shutdown(timeout)

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, prompt: PromptInput, params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 0,
                       lora_request=None, session_id: str | None = None,
                       ) -> AsyncIterator[StreamDelta]:
        """`AsyncLLM.generate` over the engines (a LoRARequest registers on all)."""
        lora_name = None
        if lora_request is not None:
            names = await asyncio.gather(*(asyncio.to_thread(e.engine.ensure_adapter,
                                                             lora_request)
                                           for e in self.engines))
            lora_name = names[0]
        queue: asyncio.Queue = asyncio.Queue()
        request_id = self.submit(prompt, params, queue=queue, request_id=request_id,
                                 priority=priority, lora_name=lora_name,
                                 session_id=session_id)
        return self._drain(request_id, queue)

    def submit(self, prompt: PromptInput, params: SamplingParams, *, queue: asyncio.Queue,
               key: Hashable | None = None, request_id: str | None = None,
               priority: int = 0, max_tokens_must_fit: bool = True,
               lora_name: str | None = None, session_id: str | None = None) -> str:
        """`AsyncLLM.submit` on the engine the session or the router picks."""
        request_id = request_id or f"dp-{next(self._ids)}"
        if self.router.owner(request_id) is not None:
            raise RequestError(f"request_id: {request_id!r} is already in flight")
        text, ids = self.engines[0].prompt_ids(prompt)
        index = self._pick(request_id, ids, lora_name, session_id)
        release = _Release(queue, key is not None,
                           lambda: self.router.finished(request_id))
        try:
            self.engines[index].submit(
                {"prompt_token_ids": ids, "prompt": text}, params, queue=release, key=key,
                request_id=request_id, priority=priority,
                max_tokens_must_fit=max_tokens_must_fit, lora_name=lora_name,
                session_id=session_id)
        except BaseException:
            self.router.finished(request_id)
            raise
        if session_id is not None:
            self._remember_session(session_id, index)
        return request_id

    def _pick(self, request_id: str, ids: list[int], lora_name: str | None,
              session_id: str | None) -> int:
        engine = self._sessions.get(session_id) if session_id is not None else None
        if engine is not None:
            return self.router.assign(request_id, ids, engine, salt=lora_name)
        return self.router.route(request_id, ids, salt=lora_name)

    def _remember_session(self, session_id: str, engine: int) -> None:
        self._sessions[session_id] = engine
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > MAX_REMEMBERED_SESSIONS:
            self._sessions.popitem(last=False)

    async def _drain(self, request_id: str, queue: asyncio.Queue,
                     ) -> AsyncIterator[StreamDelta]:
        done = False
        try:
            while (delta := await queue.get()) is not None:
                self.decode_logprobs(delta)
                yield delta
            done = True
        finally:
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort on the engine holding the request (a finished one: nothing to do)."""
        engine = self.router.owner(request_id)
        if engine is not None:
            self.engines[engine].abort(request_id)

    def decode_logprobs(self, delta: StreamDelta) -> None:
        self.engines[0].decode_logprobs(delta)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compiled into every engine's cache (blocking, on a worker thread): the request
        may go to any of them, and none may compile on the event loop."""
        for e in self.engines:
            e.compile_grammar(params)

    async def close_session(self, session_id: str) -> bool:
        """End a session on the engine holding it (on every engine when that is not
        known); False when none had it open."""
        check_session_id(session_id)
        engine = self._sessions.pop(session_id, None)
        targets = self.engines if engine is None else [self.engines[engine]]
        found = await asyncio.gather(*(e.close_session(session_id) for e in targets))
        return any(found)

    # ---- adapters: on every engine ------------------------------------------------------------

    @property
    def lora_enabled(self) -> bool:
        return self.engines[0].lora_enabled

    def adapters(self) -> list[tuple[str, str]]:
        return self.engines[0].adapters()

    def has_adapter(self, name: str) -> bool:
        """Registered on every engine (a load in progress counts once all have it)."""
        return all(e.has_adapter(name) for e in self.engines)

    def register_adapter(self, name: str, path: str) -> None:
        for e in self.engines:
            e.register_adapter(name, path)

    async def load_adapter(self, name: str, path: str, replace: bool = False) -> str:
        """Load on every engine; answers once all have acknowledged. When one fails, a
        fresh load is unloaded again from the engines that took it, and the error raised."""
        if not replace and any(e.has_adapter(name) for e in self.engines):
            raise LoraError(f"adapter {name!r}: is already loaded")
        results = await asyncio.gather(*(e.load_adapter(name, path, replace=replace)
                                         for e in self.engines), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return results[0]
        if not replace:
            for e, r in zip(self.engines, results):
                if not isinstance(r, BaseException):
                    await _quietly(e.unload_adapter(name))
        raise errors[0]

    async def unload_adapter(self, name: str) -> str:
        holding = [e for e in self.engines if e.has_adapter(name)]
        if not holding:
            raise LoraError(f"adapter {name!r}: is not loaded")
        results = await asyncio.gather(*(e.unload_adapter(name) for e in holding),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results[0]

    # ---- the tokenizer (the engines share one model) -----------------------------------------

    def prompt_ids(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        return self.engines[0].prompt_ids(prompt)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engines[0].tokenize(text, add_special_tokens)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.engines[0].detokenize(ids, skip_special_tokens)

    def token_text(self, token: int) -> str:
        return self.engines[0].token_text(token)

    def apply_chat_template(self, messages: list[dict], **options) -> str:
        return self.engines[0].apply_chat_template(messages, **options)

    def special_token_ids(self, names) -> tuple[int, ...]:
        return self.engines[0].special_token_ids(names)

    # ---- state: the engines' totals ----------------------------------------------------------

    def snapshot(self) -> SchedulerSnapshot | None:
        """The engines' latest snapshots summed (None until every engine has published)."""
        snaps = [e.snapshot() for e in self.engines]
        return None if any(s is None for s in snaps) else merge_snapshots(snaps)

    def stats(self) -> dict:
        """Counters and phase timings summed (a phase's `last_s`: the longest), compiled
        variants summed."""
        return merge_stats([e.stats() for e in self.engines])


async def _quietly(undo) -> None:
    try:
        await undo
    except (LoraError, EngineFailed):
        pass


# Snapshot fields that do not add up: the oldest publication time; the gate's mode when
# every engine is in it.
def merge_snapshots(snaps: list[SchedulerSnapshot]) -> SchedulerSnapshot:
    """One snapshot of M engines: counts summed, adapters by name."""
    merged = {}
    for f in dataclasses.fields(SchedulerSnapshot):
        values = [getattr(s, f.name) for s in snaps]
        if f.name == "published_at":
            merged[f.name] = min(values)
        elif f.name == "mtp_mode":
            merged[f.name] = values[0] if len(set(values)) == 1 else "mixed"
        elif f.name == "lora_running":
            running: dict[str, int] = {}
            for pairs in values:
                for name, count in pairs:
                    running[name] = running.get(name, 0) + count
            merged[f.name] = tuple(running.items())
        elif f.name in ("lora_loaded", "lora_waiting"):
            merged[f.name] = tuple(dict.fromkeys(x for names in values for x in names))
        else:
            merged[f.name] = sum(values)
    return SchedulerSnapshot(**merged)


def merge_stats(parts: list[dict]) -> dict:
    counters: dict[str, int] = {}
    phases: dict[str, PhaseStats] = {}
    for part in parts:
        for name, n in part["counters"].items():
            counters[name] = counters.get(name, 0) + n
        for name, p in part["phases"].items():
            total = phases.setdefault(name, PhaseStats())
            total.count += p.count
            total.total_s += p.total_s
            total.last_s = max(total.last_s, p.last_s)
    return {"counters": counters, "phases": phases,
            "compiled_variants": sum(p["compiled_variants"] for p in parts),
            "compiling_variants": sum(p["compiling_variants"] for p in parts)}
