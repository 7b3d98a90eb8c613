"""The bridge from a parsed request to the engine's streams.

1. Each prompt is tokenized once, checked against the context, and submitted through
   `AsyncLLM.submit` as its own engine request (`<id>-<i>`), all onto one asyncio queue for
   the HTTP request, tagged with the prompt index; the waiting cap is checked first.
2. `Generation.deltas()` reads that queue as one iterator of (prompt index, StreamDelta),
   decodes logprob text here on the event loop, and raises `EngineDead` as soon as the
   engine thread dies.
3. However the consumer leaves (finished, client gone, cancelled), every engine request not
   finished is aborted, so its blocks come back within a tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from metrale_jax.outputs import StreamDelta
from metrale_jax.request import RequestError

from server.metrics import RequestTimer
from server.protocol import APIError, ParsedRequest, from_request_error, score_only_delta
from server.state import EngineDead, ServerState
from server.structured import compile_error


class Generation:
    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str):
        self.state, self.parsed, self.request_id = state, parsed, request_id
        self.prompt_ids: list[list[int]] = []
        self.prompt_texts: list[str | None] = []
        self.queue: asyncio.Queue = asyncio.Queue()  # (prompt index, delta or None)
        self.timers: list[RequestTimer] = []
        self.engine_ids: list[str] = []
        self.finished: set[int] = set()
        self.num_seqs = parsed.params.n * len(parsed.prompts)
        self._admitted = False

    async def submit(self) -> None:
        """Tokenize, check and submit every prompt; on any error nothing stays submitted."""
        state, parsed = self.state, self.parsed
        llm = state.llm
        plans = []
        for prompt in parsed.prompts:
            try:
                text, ids = llm.prompt_ids(prompt)
                # The default max_tokens is set here: min_tokens is checked against it again.
                params = parsed.params_for(len(ids), state.limits)
            except RequestError as err:
                raise from_request_error(err) from None
            plans.append((text, ids, params))
        await self._compile_constraint()
        state.require_serving()
        state.admit(self.num_seqs)
        self._admitted = True
        try:
            for i, (text, ids, params) in enumerate(plans):
                engine_id = llm.submit({"prompt_token_ids": ids, "prompt": text}, params,
                                       queue=self.queue, key=i,
                                       request_id=f"{self.request_id}-{i}",
                                       priority=parsed.priority, lora_name=parsed.lora_name,
                                       session_id=parsed.session_id)
                self.engine_ids.append(engine_id)
                self.timers.append(RequestTimer(state.metrics, llm, len(ids)))
                self.prompt_ids.append(ids)
                self.prompt_texts.append(text if text is not None else llm.detokenize(ids))
        except RequestError as err:
            await self.close()
            raise from_request_error(err) from None
        except RuntimeError as err:  # the inbox closed under us: shutting down
            await self.close()
            raise APIError(503, str(err)) from None
        except BaseException:
            await self.close()
            raise

    async def _compile_constraint(self) -> None:
        """Compile the request's grammar on a worker thread (cached by its text): the
        event loop and the engine thread never wait for a compile."""
        constraint = self.parsed.constraint
        if constraint is None:
            return
        try:
            await asyncio.to_thread(self.state.llm.compile_grammar, self.parsed.params)
        except RequestError as err:
            raise compile_error(constraint, err) from None

    @property
    def model(self) -> str:
        """The model name responses carry: the adapter the request named, else the base."""
        return self.parsed.lora_name or self.state.model_name

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_ids)

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        dead, llm = self.state.dead, self.state.llm
        try:
            while len(self.finished) < len(self.engine_ids):
                get = asyncio.ensure_future(self.queue.get())
                waiters = {get} if dead is None else {get, dead}
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not get.done():
                        get.cancel()
                if not get.done() or get.cancelled():
                    raise EngineDead(repr(llm.error))
                i, delta = get.result()
                if delta is None:
                    self.finished.add(i)
                    self.timers[i].on_done()
                    continue
                if self.parsed.score_only:
                    delta = score_only_delta(delta)
                llm.decode_logprobs(delta)
                self.timers[i].on_delta(delta.index, len(delta.token_ids), delta.finish_reason)
                yield i, delta
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort what is unfinished and give back the in-flight slots (idempotent)."""
        for i, engine_id in enumerate(self.engine_ids):
            if i not in self.finished:
                self.state.llm.abort(engine_id)
                self.timers[i].on_abort(self.parsed.params.n)
                self.finished.add(i)
        if self._admitted:
            self._admitted = False
            self.state.release(self.num_seqs)
