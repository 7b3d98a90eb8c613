"""AsyncLLM: the streaming API, and the one door the server goes through.

1. `generate()` validates and tokenizes on the caller's event loop, submits a `Request`
   to the inbox, and returns an async iterator of `StreamDelta`s read from one asyncio
   queue per request.
2. The tick loop runs on its own thread (`LLMEngine.run`; JAX releases the GIL while the
   device works); when idle it publishes a fresh snapshot and blocks on the inbox.
3. After each processed step the loop's sink pushes each changed sequence's delta onto its
   request's queue with `loop.call_soon_threadsafe`; `submit(..., queue=, key=)` lets a
   caller share one queue between several requests (the server: one per HTTP request).
4. Logprob entries arrive as token ids; their text is decoded here, on the event loop, not
   on the engine thread.
5. A consumer that stops iterating (a client that went away) aborts its request: the abort
   travels through the inbox and its blocks come back within a tick.
6. A step that raises fails its own requests (their deltas carry the error); repeated
   failures stop the loop, which answers every request it holds first, and `error` is set
   (the server's /health turns unhealthy).

7. Adapter commands (`load_adapter`, `unload_adapter`) read the adapter directory on a
   worker thread, queue the rotation, and resolve once the engine thread acknowledges it at
   a quiescent tick.

Besides streams, the server reads everything through this class: tokenizing, the chat
template, limits, the published snapshot, telemetry, the levers and the adapters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Hashable

from metrale_jax.engine import LLMEngine, PromptInput
from metrale_jax.lora.weights import LoraError
from metrale_jax.outputs import StreamDelta
from metrale_jax.parallel.distributed import refuse_serving
from metrale_jax.request import Request, RequestError, SamplingParams
from metrale_jax.scheduler.faults import EngineFailed
from metrale_jax.scheduler.levers import Levers
from metrale_jax.scheduler.snapshot import SchedulerSnapshot
from metrale_jax.scheduler.state import LoadAdapter, UnloadAdapter
from metrale_jax.sequence import Sequence, decode_logprobs


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What request validation needs to know about the engine."""

    model_name: str
    max_seq_len: int
    max_logprobs: int
    vocab_size: int
    max_batch_size: int
    max_loras: int = 0          # LoRA adapter slots (0: LoRA off)


@dataclasses.dataclass
class _Target:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    key: Hashable | None        # None: the queue is the request's own; else (key, delta)


class _QueueSink:
    """Runs on the engine thread; hands deltas to the owning event loop."""

    def __init__(self) -> None:
        self.targets: dict[str, _Target] = {}
        self._sent: dict[tuple[str, int], int] = {}  # tokens already delivered per sequence

    def on_update(self, request: Request, seq: Sequence) -> None:
        target = self.targets.get(request.request_id)
        if target is None:
            return
        key = (seq.request_id, seq.index)
        first = key not in self._sent
        sent = self._sent.get(key, 0)
        new_ids = seq.output_ids[sent:]
        if not new_ids and not seq.finished:
            # A prefill chunk ran, nothing came out: nothing to tell. The first delta must
            # wait for the prompt's end, as it carries the prompt logprobs, all of them.
            return
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
        self._put(target, delta)

    def on_finished(self, request: Request) -> None:
        target = self.targets.pop(request.request_id, None)
        if target is not None:
            self._put(target, None)

    @staticmethod
    def _put(target: _Target, item) -> None:
        if target.key is not None:
            item = (target.key, item)
        target.loop.call_soon_threadsafe(target.queue.put_nowait, item)


class AsyncLLM:
    # Engines behind this door: one (`DataParallelAsyncLLM` has M, with the same surface).
    data_parallel_size = 1

    def __init__(self, model: str | None = None, **kwargs):
        self._sink = _QueueSink()
        self.engine = LLMEngine(model, sink=self._sink, **kwargs)
        # Requests reach one process at times of its own: no lockstep loop across processes.
        refuse_serving(self.engine.engine_config.parallel)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        e = self.engine
        self.limits = EngineLimits(
            model_name=e.model_name, max_seq_len=e.engine_config.max_seq_len,
            max_logprobs=e.engine_config.max_logprobs, vocab_size=e.model_config.vocab_size,
            max_batch_size=e.engine_config.max_batch_size,
            max_loras=e.engine_config.lora.max_loras if e.engine_config.lora else 0)

    # ---- lifecycle --------------------------------------------------------------------------

    def warmup(self) -> int:
        """Compile the few step shapes that cover every batch (before `start`; blocking);
        the other shapes, then the speculative ones, compile beside serving: a batch runs
        padded in a covering shape until its own is ready, and the MTP gate keeps to the
        plain step until every variant is (runner/background_warmup.py)."""
        return self.engine.runner.warmup(speculative_later=True, serve_early=True)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="metrale-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.engine.run(wait=0.5)
        except BaseException as exc:  # surfaced to callers (the server turns unhealthy)
            self._error = exc
            raise

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread died or stopped (None while it serves). A halt after
        repeated step failures shows here as soon as it is decided, before the loop has
        answered every request it held."""
        if self._error is None and self.engine.failure is not None:
            self._error = EngineFailed(self.engine.failure)
        return self._error

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting; the loop finishes what it holds, then exits."""
        self.engine.close_inbox()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, prompt: PromptInput, params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 0,
                       lora_request=None, session_id: str | None = None,
                       ) -> AsyncIterator[StreamDelta]:
        """Submit one request and return its deltas; leaving the iterator early aborts it.
        `lora_request`: a LoRARequest (read on a worker thread the first time) or None."""
        lora_name = None
        if lora_request is not None:
            lora_name = await asyncio.to_thread(self.engine.ensure_adapter, lora_request)
        queue: asyncio.Queue = asyncio.Queue()
        request_id = self.submit(prompt, params, queue=queue, request_id=request_id,
                                 priority=priority, lora_name=lora_name,
                                 session_id=session_id)
        return self._drain(request_id, queue)

    def submit(self, prompt: PromptInput, params: SamplingParams, *, queue: asyncio.Queue,
               key: Hashable | None = None, request_id: str | None = None,
               priority: int = 0, max_tokens_must_fit: bool = True,
               lora_name: str | None = None, session_id: str | None = None) -> str:
        """Submit one request whose deltas go to `queue` (on the running event loop), each
        as `(key, delta)` when a key is given, then `None` (or `(key, None)`) once it is
        finished. The caller decodes logprobs (`decode_logprobs`) and aborts what it leaves.
        Raises RequestError (bad input) or RuntimeError (shutting down)."""
        request = self.engine.make_request(prompt, params, priority=priority,
                                           request_id=request_id,
                                           max_tokens_must_fit=max_tokens_must_fit,
                                           lora_name=lora_name, session_id=session_id)
        if request.request_id in self._sink.targets:  # never re-point a live request's queue
            raise RequestError(f"request_id: {request.request_id!r} is already in flight")
        self._sink.targets[request.request_id] = _Target(asyncio.get_running_loop(), queue,
                                                         key)
        try:
            self.engine.submit(request)
        except BaseException:
            self._sink.targets.pop(request.request_id, None)
            raise
        return request.request_id

    async def _drain(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[StreamDelta]:
        done = False
        try:
            while (delta := await queue.get()) is not None:
                self.decode_logprobs(delta)
                yield delta
            done = True
        finally:
            if not done:
                self.abort(request_id)

    def decode_logprobs(self, delta: StreamDelta) -> None:
        """Fill in the text of a delta's logprob entries (in place, on the caller's loop)."""
        decode_logprobs(delta.logprobs, self.engine.tokenizer)
        decode_logprobs(delta.prompt_logprobs, self.engine.tokenizer)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's structured-output constraint (blocking; any thread but the
        engine's). Raises RequestError when it does not compile."""
        self.engine.compile_grammar(params)

    # ---- adapters (multi-LoRA) ----------------------------------------------------------------

    @property
    def lora_enabled(self) -> bool:
        return self.engine.adapters is not None

    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of every registered adapter."""
        if self.engine.adapters is None:
            return []
        return [(a.name, a.path) for a in self.engine.adapters.adapters()]

    def has_adapter(self, name: str) -> bool:
        return self.engine.adapters is not None and name in self.engine.adapters

    def register_adapter(self, name: str, path: str) -> None:
        """Read and register an adapter (blocking: before `start`, or on a worker thread);
        the cohort gate loads it into a slot when a request needs it. Raises LoraError."""
        registry = self._registry()
        registry.register(name, path, registry.read(name, path))

    async def load_adapter(self, name: str, path: str, replace: bool = False) -> str:
        """Read the adapter on a worker thread, then load it into a device slot at the next
        quiescent tick (`replace`: new weights for a registered name). Returns once the
        engine thread has acknowledged it; raises LoraError (or EngineFailed)."""
        registry = self._registry()
        if not replace and name in registry:
            raise LoraError(f"adapter {name!r}: is already loaded")
        weights = await asyncio.to_thread(registry.read, name, path)
        return await self._rotate(lambda ack: LoadAdapter(name, path, weights, ack, replace))

    async def unload_adapter(self, name: str) -> str:
        """Free the adapter's slot and forget it at the next quiescent tick (requests still
        waiting for it fail). Raises LoraError when it is not loaded."""
        if name not in self._registry():
            raise LoraError(f"adapter {name!r}: is not loaded")
        return await self._rotate(lambda ack: UnloadAdapter(name, ack))

    def _registry(self):
        if self.engine.adapters is None:
            raise LoraError("LoRA is not enabled on this engine (start it with --enable-lora)")
        return self.engine.adapters

    async def close_session(self, session_id: str) -> bool:
        """End a session (its pins go back); False when none was open. Raises
        RequestError for a malformed id."""
        return await self._acked(lambda ack: self.engine.close_session(session_id, ack))

    async def _rotate(self, make):
        return await self._acked(lambda ack: self.engine.submit_rotation(make(ack)))

    async def _acked(self, submit):
        """Submit a command whose `ack` the engine thread calls exactly once, and await it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result, error) -> None:  # on the event loop
            if done.done():
                return  # the caller went away
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def ack(result, error) -> None:  # on the engine thread, exactly once
            loop.call_soon_threadsafe(settle, result, error)

        submit(ack)
        return await done

    # ---- the tokenizer ----------------------------------------------------------------------

    def prompt_ids(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt as `generate` takes it; raises RequestError."""
        return self.engine.prompt_ids(prompt)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it (special tokens included)."""
        return self.engine.tokenizer.decode([token], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], **options) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, **options)

    def special_token_ids(self, names) -> tuple[int, ...]:
        """Ids of the named tokens that the chat template uses."""
        tok = self.engine.tokenizer
        ids = (tok.backend.token_to_id(t) for t in names if t in tok.chat_template)
        return tuple(i for i in ids if i is not None)

    # ---- state other threads may read -------------------------------------------------------

    def snapshot(self) -> SchedulerSnapshot | None:
        """The latest snapshot the engine thread published (every tick, and when idle)."""
        return self.engine.snapshot()

    def stats(self) -> dict:
        """Counters, tick-phase timings and compiled variants (thread-safe reads)."""
        return self.engine.stats()

    @property
    def levers(self) -> Levers:
        return self.engine.levers
