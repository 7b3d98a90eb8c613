"""The small engine the in-process server tests share (one compiled set of buckets)."""

from __future__ import annotations

import os

from metrale_jax.async_engine import AsyncLLM

MODEL = os.environ.get("METRALE_TEST_MODEL") or None  # default: the built-in model
ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=64, seq_buckets=(4,),
              token_buckets=(16, 32), query_buckets=(1, 8, 32), block_size=8,
              num_kv_blocks=40, block_buckets=(8,), max_logprobs=2)
# The same engine with a pool too small for four full-length sequences: under load it
# preempts and swaps (the reliability tests share it, so its programs compile once).
TIGHT_ENGINE = {**ENGINE, "num_kv_blocks": 20}


def running_engine():
    """Generator body for a module fixture: a started AsyncLLM, shut down afterwards."""
    engine = AsyncLLM(MODEL, **ENGINE)
    engine.start()
    yield engine
    engine.shutdown(timeout=30)
