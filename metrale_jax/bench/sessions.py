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
then two more with the same prefix and other suffixes (warm: the device's prefix cache; on
a hybrid the first of them computes from the last SSM snapshot before the prefix's end and
leaves one there, so `warm_device_s` is the second, the steady state, and the first is
reported beside it); then unrelated prompts fill the KV pool, so the prefix's blocks and SSM snapshots are
evicted into the prefix tier, and a third request with the prefix is timed (warm: restored
from the tier). That runs twice, on an engine whose tier is host RAM and on one whose tier
is disk only; each first makes sure the prefix really left the device (no cached block of
it) and reports how many blocks the restore brought back.
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


def _prefix_engine(model: str | None, prefix_len: int, suffix_len: int, tier: dict):
    """A pool a little larger than the prefix, so that two fillers as long evict all of it."""
    from metrale_jax.engine import LLMEngine

    block = 16
    blocks = (prefix_len + suffix_len) // block + 8
    engine = LLMEngine(model, max_batch_size=1, max_seq_len=prefix_len + suffix_len + 16,
                       max_tokens_per_tick=512, enable_swap=False, block_size=block,
                       num_kv_blocks=blocks, prefix_tier=tier)
    engine.runner.warmup(progress=False)
    return engine


def _prefix_ttft(model: str | None, prefix: list[int], suffixes: list[list[int]],
                 fillers: list[list[int]], tier: dict) -> dict:
    engine = _prefix_engine(model, len(prefix), len(suffixes[0]), tier)
    try:
        _ttft(engine, fillers[0][:len(suffixes[0]) + 16], 1)  # first-use costs, not timed
        cold, _ = _ttft(engine, prefix + suffixes[0], 1)
        first, _ = _ttft(engine, prefix + suffixes[1], 1)
        warm, _ = _ttft(engine, prefix + suffixes[2], 1)
        for filler in fillers:
            _ttft(engine, filler, 1)
        pool, offload = engine.core.memory.pool, engine.core.memory.prefix_tier
        on_device = len(pool.peek_prefix(prefix + suffixes[3]).blocks)
        restored = offload.stats.blocks_restored
        tiered, _ = _ttft(engine, prefix + suffixes[3], 1)
        return {"cold_s": round(cold, 4), "first_warm_device_s": round(first, 4),
                "warm_device_s": round(warm, 4), "warm_tier_s": round(tiered, 4),
                "first_warm_over_cold_device": round(first / cold, 3),
                "warm_over_cold_device": round(warm / cold, 3),
                "warm_over_cold_tier": round(tiered / cold, 3),
                "prefix_blocks_on_device_before": on_device,
                "blocks_restored": offload.stats.blocks_restored - restored,
                "snapshots_restored": offload.stats.snapshots_restored,
                "tier_stats": vars(offload.tier.stats)}
    finally:
        engine.close()


def sessions_benchmark(model: str | None, turns: int, turn_len: int, reply_len: int,
                       prefix_len: int, suffix_len: int = 32, seed: int = 0) -> dict:
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
    prefix, suffixes = tokens(prefix_len), [tokens(suffix_len) for _ in range(4)]
    fillers = [tokens(prefix_len + suffix_len) for _ in range(2)]
    shared = {"prefix_len": prefix_len, "suffix_len": suffix_len}
    for level, tier in (("host", {"host_bytes": 4 << 30}), ("disk", {"disk_bytes": 4 << 30})):
        shared[level] = _prefix_ttft(model, prefix, suffixes, fillers, tier)
    return {"turns": turns, "turn_len": turn_len, "reply_len": reply_len,
            "chat": rows, "replies_identical": all(replies[m] == replies["recompute"]
                                                   for m in MODES),
            "shared_prefix": shared}
