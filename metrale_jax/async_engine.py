"""AsyncLLM: the streaming API the server uses.

1. `generate()` validates and tokenizes on the caller's event loop, submits a `Request`
   to the inbox, and returns an async iterator of `StreamDelta`s.
2. The tick loop runs on its own thread (JAX releases the GIL while the device works); when
   idle it blocks on the inbox instead of spinning.
3. After each processed step the loop's sink pushes each changed sequence's delta onto its
   request's asyncio queue with `loop.call_soon_threadsafe`.
4. A consumer that stops iterating (a client that went away) aborts its request: the abort
   travels through the inbox and its blocks come back within a tick.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator

from metrale_jax.engine import LLMEngine, PromptInput
from metrale_jax.outputs import PositionLogprobs
from metrale_jax.request import SamplingParams
from metrale_jax.scheduler.state import Request
from metrale_jax.sequence import Sequence


@dataclasses.dataclass
class StreamDelta:
    request_id: str
    index: int
    text: str                        # new text since the previous delta
    token_ids: list[int]             # new tokens since the previous delta
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    prompt_token_ids: list[int] | None = None   # on the first delta of each sequence
    prompt_logprobs: list | None = None


class _QueueSink:
    """Runs on the engine thread; hands deltas to the owning event loop."""

    def __init__(self) -> None:
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._sent: dict[tuple[str, int], int] = {}  # tokens already delivered per sequence

    def on_update(self, request: Request, seq: Sequence) -> None:
        target = self.queues.get(request.request_id)
        if target is None:
            return
        key = (seq.request_id, seq.index)
        first = key not in self._sent
        sent = self._sent.get(key, 0)
        new_ids = seq.output_ids[sent:]
        self._sent[key] = len(seq.output_ids)
        delta = StreamDelta(
            request_id=seq.request_id, index=seq.index, text=seq.stream_delta(),
            token_ids=list(new_ids),
            logprobs=seq.logprobs[sent:] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
            prompt_token_ids=seq.prompt_ids if first else None,
            prompt_logprobs=seq.prompt_logprobs if first and seq.index == 0 else None)
        if seq.finished:
            self._sent.pop(key, None)
        loop, queue = target
        loop.call_soon_threadsafe(queue.put_nowait, delta)

    def on_finished(self, request: Request) -> None:
        target = self.queues.pop(request.request_id, None)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, None)


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs):
        self._sink = _QueueSink()
        self.engine = LLMEngine(model, sink=self._sink, **kwargs)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def core(self):
        return self.engine.core

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="metrale-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        core = self.engine.core
        try:
            while core.tick():
                if core.is_idle:
                    core.absorb(core.inbox.recv(wait=True, timeout=0.5))
        except BaseException as exc:  # surfaced to callers (the server turns unhealthy)
            self.error = exc
            raise

    async def generate(self, prompt: PromptInput, params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 0,
                       ) -> AsyncIterator[StreamDelta]:
        request = self.engine.make_request(prompt, params, priority=priority,
                                           request_id=request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._sink.queues[request.request_id] = (asyncio.get_running_loop(), queue)
        self.engine.submit(request)
        return self._drain(request.request_id, queue)

    async def _drain(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[StreamDelta]:
        done = False
        try:
            while (delta := await queue.get()) is not None:
                yield delta
            done = True
        finally:
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting; the loop finishes what it holds, then exits."""
        self.engine.core.inbox.close()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()
