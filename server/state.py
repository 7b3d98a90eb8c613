"""What one server holds: the engine (an `AsyncLLM`, or a `DataParallelAsyncLLM` with the same
surface), its lifecycle status, in-flight accounting, metrics.

Status: "starting" (warming up) -> "ok" -> "draining" (SIGTERM: no new work) or
"unhealthy" (the engine thread died: every open request is answered with a 5xx).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from metrale_jax.async_engine import AsyncLLM

from server.metrics import ServerMetrics
from server.protocol import APIError, Limits

logger = logging.getLogger("metrale.server")

DEFAULT_MAX_WAITING = 256
RETRY_AFTER_S = 1  # what a refused client is told to wait before trying again
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...] = ()   # empty: the engine's model name
    api_key: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING     # sequences beyond the batch before 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    watchdog_interval_s: float = 0.25          # how often the engine thread is checked
    # Runtime LoRA loading (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) is allowed
    # only for adapter directories inside this one (None: refused).
    lora_dir: str | None = None


class EngineDead(Exception):
    """The engine thread stopped; open requests get a 5xx instead of hanging."""


class ServerState:
    def __init__(self, llm: AsyncLLM, config: ServerConfig, status: str = "ok"):
        self.llm, self.config, self.status = llm, config, status
        engine = llm.limits
        names = config.served_model_names or (engine.model_name,)
        self.limits = Limits(model_names=tuple(names), max_seq_len=engine.max_seq_len,
                             max_logprobs=engine.max_logprobs, vocab_size=engine.vocab_size,
                             has_adapter=llm.has_adapter if engine.max_loras else None)
        self.model_name = names[0]
        self.metrics = ServerMetrics(llm, self.model_name)
        self.open_seqs = 0
        self.open_requests = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.dead: asyncio.Future | None = None  # set on the serving loop at startup

    # ---- lifecycle --------------------------------------------------------------------------

    def require_serving(self) -> None:
        if self.status == "starting":
            raise APIError(503, "the server is starting: the engine is warming up")
        if self.status == "draining":
            raise APIError(503, "the server is shutting down and accepts no new requests")
        if self.status == "unhealthy" or self.llm.error is not None:
            raise APIError(503, f"the engine failed: {self.llm.error!r}")

    def engine_died(self) -> None:
        if self.status != "unhealthy":
            logger.error("engine thread died: %r; answering open requests with errors",
                         self.llm.error)
        self.status = "unhealthy"
        if self.dead is not None and not self.dead.done():
            self.dead.set_result(None)

    async def watchdog(self) -> None:
        """Turns the server unhealthy when the engine thread dies (checked periodically)."""
        while self.llm.error is None:
            await asyncio.sleep(self.config.watchdog_interval_s)
        self.engine_died()

    # ---- admission --------------------------------------------------------------------------

    def admit(self, num_seqs: int) -> None:
        """The waiting cap: sequences beyond the running batches (one per engine), at most
        max_waiting."""
        batch = self.llm.levers.get().max_batch_size * self.llm.data_parallel_size
        cap = batch + self.config.max_waiting
        if self.open_seqs + num_seqs > cap:
            raise APIError(429, f"too many requests waiting: {self.open_seqs} sequences "
                                f"in flight, the cap is {cap}; retry later",
                           code="too_many_requests", retry_after_s=RETRY_AFTER_S)
        self.open_seqs += num_seqs
        self.open_requests += 1
        self.idle.clear()

    def release(self, num_seqs: int) -> None:
        self.open_seqs -= num_seqs
        self.open_requests -= 1
        if self.open_requests == 0:
            self.idle.set()
