"""Hybrid state reuse: time to first token of each turn of a multi-turn chat, and of a
request whose long shared prefix is cached (warm) or not (cold).

The chat: turn n's prompt is the whole chat so far (every prompt and greedy reply) plus
`turn_len` new tokens; each turn generates `reply_len`. Three ways to serve it, each on its
own warmed engine so none inherits another's cache:
  sessions  -- the requests carry a session id: a turn starts from the last one's tail;
  prefix    -- no session, prefix cache on: the last block-boundary snapshot of the turn
               before (decode-time snapshots) is the hit;
  recompute -- prefix cache off: every turn computes its whole prompt (the baseline).
Replies must be identical across the three (greedy); the result says whether they were.
Without reuse TTFT grows with the history; the issue's bar is turn 10 / turn 1 <= 1.5 with
sessions. The prefix part times one request over a fresh `prefix_len`-token prefix (cold),
then another with the same prefix and a different suffix (warm, from the device tier); the
host and disk tiers are not built, so their figures are null.
"""

from __future__ import annotations

import time

import numpy as np

from metrale_jax.request import SamplingParams

MODES = ("sessions", "prefix", "recompute")


def _engine(model: str | None, max_len: int, prefix_cache: bool):
    from metrale_jax.engine import LLMEngine

    engine = LLMEngine(model, max_batch_size=1, max_seq_len=max_len, max_tokens_per_tick=512,
                       enable_swap=False, enable_prefix_cache=prefix_cache)
    engine.runner.warmup(progress=False)
    return engine


def _ttft(engine, prompt: list[int], reply_len: int, session_id: str | None = None,
          ) -> tuple[float, list[int]]:
    """Seconds from submit to the first token read back, and the whole greedy reply."""
    request = engine.make_request({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=reply_len, ignore_eos=True), session_id=session_id)
    seq, first = request.sequences[0], None
    t0 = time.perf_counter()
    engine.submit(request)
    while not request.finished:
        engine.step()
        if first is None and seq.output_ids:
            first = time.perf_counter() - t0
    engine.drain()
    return first if first is not None else time.perf_counter() - t0, list(seq.output_ids)


def _chat(engine, session_id: str | None, messages: list[list[int]], reply_len: int,
          ) -> tuple[list[float], list[list[int]]]:
    history: list[int] = []
    ttfts, replies = [], []
    for message in messages:
        prompt = history + message
        ttft, reply = _ttft(engine, prompt, reply_len, session_id)
        ttfts.append(ttft)
        replies.append(reply)
        history = prompt + reply
    return ttfts, replies


def _prefix_ttft(engine, prefix: list[int], suffixes: list[list[int]]) -> dict:
    cold, _ = _ttft(engine, prefix + suffixes[0], 1)
    warm, _ = _ttft(engine, prefix + suffixes[1], 1)
    return {"cold_s": round(cold, 4), "warm_device_s": round(warm, 4),
            "warm_over_cold_device": round(warm / cold, 3),
            "warm_host_s": None, "warm_disk_s": None}


def sessions_benchmark(model: str | None, turns: int, turn_len: int, reply_len: int,
                       prefix_len: int, seed: int = 0) -> dict:
    from metrale_jax.bench.compare import vocab_size

    vocab = vocab_size(model)
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, vocab, n)]

    messages = [tokens(turn_len) for _ in range(turns)]
    max_len = turns * (turn_len + reply_len) + 16
    rows, replies = {}, {}
    for mode in MODES:
        engine = _engine(model, max_len, prefix_cache=mode != "recompute")
        session = (lambda name: name) if mode == "sessions" else (lambda name: None)
        _chat(engine, session("warm-up"), [tokens(turn_len)], reply_len)  # not timed
        ttfts, replies[mode] = _chat(engine, session("chat"), messages, reply_len)
        rows[mode] = {"ttft_s": [round(t, 4) for t in ttfts],
                      "last_over_first": round(ttfts[-1] / ttfts[0], 3)}
        engine.close()
    prefix_engine = _engine(model, prefix_len + turn_len + 16, prefix_cache=True)
    _ttft(prefix_engine, tokens(turn_len), 1)  # first-use costs, not timed
    prefix = _prefix_ttft(prefix_engine, tokens(prefix_len), [tokens(turn_len),
                                                              tokens(turn_len)])
    prefix_engine.close()
    return {"turns": turns, "turn_len": turn_len, "reply_len": reply_len,
            "chat": rows, "replies_identical": all(replies[m] == replies["recompute"]
                                                   for m in MODES),
            "shared_prefix": {"prefix_len": prefix_len, **prefix}}
