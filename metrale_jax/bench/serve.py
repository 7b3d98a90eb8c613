"""A load client for any OpenAI-compatible server, shaped like `vllm bench serve`.

Requests arrive by a Poisson process (or gamma, for burstiness) at a rate, or all at once,
optionally capped at a maximum concurrency. Every request streams; the client times the first
token (TTFT), every later token (ITL), the time per output token (TPOT) and the whole request
(E2EL). A chunk that carries several tokens (MTP, or text held back by the detokenizer) is
counted token by token: the server's running usage (`stream_options.continuous_usage_stats`,
which metrale and vLLM send) says how many tokens a chunk holds, and the gap before the chunk
is split evenly among them. Servers without running usage are counted one token per chunk,
and the final usage chunk, when sent, corrects the request's output count.

The run is bounded in requests and in time; it talks to loopback addresses unless told
otherwise, so a mistyped URL never loads somebody else's server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable

import numpy as np

from metrale_jax.bench.datasets import BenchRequest
from metrale_jax.bench.metrics import SLO, RequestRecord, serving_summary

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost",)


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"      # or /v1/chat/completions (prompt sent as text)
    model: str | None = None               # the "model" field; None: ask /v1/models
    request_rate: float = math.inf         # requests/s; inf sends everything at once
    burstiness: float = 1.0                # gamma shape: 1 is Poisson, < 1 burstier
    max_concurrency: int | None = None
    max_duration_s: float | None = None    # stop sending and cancel what is left after this
    api_key: str | None = None
    allow_remote: bool = False
    seed: int = 0
    request_timeout_s: float = 600.0
    extra_body: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be positive (inf: all at once), "
                             f"got {self.request_rate}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        check_loopback(self.base_url, self.allow_remote)


def check_loopback(url: str, allow_remote: bool) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"base_url: {url!r} is not an http(s) URL")
    if allow_remote:
        return
    host = parsed.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in LOOPBACK_NAMES
    if not loopback:
        raise ValueError(f"base_url: {host} is not a loopback address; pass --allow-remote "
                         f"(allow_remote=True) to load a server on another machine")


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent, in seconds after the start: gamma-distributed gaps with
    mean 1/rate and shape `burstiness` (1: exponential gaps, a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def request_body(spec: LoadSpec, model: str, req: BenchRequest, tokenizer=None) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if spec.endpoint.endswith("/chat/completions"):
        if tokenizer is None:
            raise ValueError("the chat endpoint takes text: give a tokenizer to decode prompts")
        body["messages"] = [{"role": "user", "content": tokenizer.decode(
            list(req.prompt_token_ids))}]
    else:
        body["prompt"] = list(req.prompt_token_ids)
    body.update(dict(spec.extra_body))
    return body


class ChunkCounter:
    """Turns the stream's chunks into per-token times for one request."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.last: float | None = None

    def on_chunk(self, chunk: dict, now: float) -> None:
        r = self.record
        usage = chunk.get("usage") or {}
        reported = usage.get("completion_tokens")
        choices = chunk.get("choices") or []
        if not choices:              # an OpenAI-style final usage chunk: the true count
            if reported is not None:
                r.output_tokens = int(reported)
            return
        c = choices[0]
        text = c.get("text")
        if text is None:
            text = (c.get("delta") or {}).get("content") or ""
        # Running usage (ours, vLLM's) says how many tokens this chunk brings; llama-server
        # puts its usage on the last chunk, which then brings whatever was held back.
        n = int(reported) - r.output_tokens if reported is not None else (1 if text else 0)
        if n <= 0:
            return
        if self.last is None:
            r.ttft_s = now - r.sent_at
        else:
            r.itl_s.extend([(now - self.last) / n] * n)
        self.last = now
        r.output_tokens += n


async def _stream_one(session, url: str, headers: dict, body: dict, record: RequestRecord,
                      clock: Callable[[], float]) -> None:
    import aiohttp

    counter = ChunkCounter(record)
    record.sent_at = clock()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                record.error = f"HTTP {resp.status}: {text[:200]}"
                return
            buffer = b""
            async for piece in resp.content.iter_any():
                buffer += piece
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    counter.on_chunk(json.loads(data), clock())
        record.e2e_s = clock() - record.sent_at
        if record.ttft_s is None:
            record.error = "the stream ended without a token"
    except asyncio.CancelledError:
        record.error = "cancelled at the time limit"
        raise
    except (aiohttp.ClientError, json.JSONDecodeError, asyncio.TimeoutError) as err:
        record.error = f"{type(err).__name__}: {err}"


async def served_model(session, spec: LoadSpec, headers: dict) -> str:
    if spec.model is not None:
        return spec.model
    async with session.get(spec.base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
        data = await resp.json(content_type=None)
    return data["data"][0]["id"]


async def compiling_variants(session, spec: LoadSpec, headers: dict) -> int:
    """What `metrale serve`'s /health says still compiles beside serving (0 for a server
    that does not say): load sent meanwhile meets padded shapes and a busy compiler."""
    import aiohttp

    try:
        async with session.get(spec.base_url.rstrip("/") + "/health",
                               headers=headers) as resp:
            body = await resp.json(content_type=None)
        return int(body.get("compiling_variants", 0))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, AttributeError):
        return 0  # not JSON, or no such field: a server that does not say


async def run_load(spec: LoadSpec, requests: list[BenchRequest], *, slo: SLO = SLO(),
                   tokenizer=None, progress: bool = True,
                   sleep: Callable[[float], Awaitable] = asyncio.sleep,
                   clock: Callable[[], float] = time.perf_counter) -> dict:
    """Send `requests` by the spec's arrival process; returns the summary (see
    metrics.serving_summary) with the spec beside it. `sleep` and `clock` are injectable."""
    import aiohttp
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    url = spec.base_url.rstrip("/") + spec.endpoint
    offsets = arrival_offsets(len(requests), spec.request_rate, spec.burstiness, spec.seed)
    records = [RequestRecord(input_len=r.input_len) for r in requests]
    limit = asyncio.Semaphore(spec.max_concurrency or len(requests) or 1)
    timeout = aiohttp.ClientTimeout(total=spec.request_timeout_s)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress,
               leave=False)
    connector = aiohttp.TCPConnector(limit=spec.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = await served_model(session, spec, headers)
        compiling = await compiling_variants(session, spec, headers)
        if compiling:
            logger.warning("the server still compiles %d step variants beside serving: "
                           "figures measured now fall short of its steady state (wait "
                           "until its /health says compiling_variants 0)", compiling)
        start = clock()

        async def one(i: int) -> None:
            async with limit:
                await _stream_one(session, url, headers,
                                  request_body(spec, model, requests[i], tokenizer),
                                  records[i], clock)
            bar.update(1)

        tasks = []
        for i, offset in enumerate(offsets):
            wait = start + offset - clock()
            if spec.max_duration_s is not None and offset > spec.max_duration_s:
                break
            if wait > 0:
                await sleep(wait)
            tasks.append(asyncio.create_task(one(i)))
        remaining = None if spec.max_duration_s is None else \
            max(0.0, start + spec.max_duration_s - clock())
        done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = clock() - start
    bar.close()
    sent = records[:len(tasks)]
    summary = serving_summary(sent, duration, slo)
    summary["not_sent"] = len(requests) - len(tasks)
    summary["server_compiling_variants_at_start"] = compiling
    summary["spec"] = {"base_url": spec.base_url, "endpoint": spec.endpoint, "model": model,
                       "request_rate": spec.request_rate if math.isfinite(spec.request_rate)
                       else "inf",
                       "burstiness": spec.burstiness,
                       "max_concurrency": spec.max_concurrency,
                       "max_duration_s": spec.max_duration_s}
    return summary
