"""llama.cpp in-process, through llama-cpp-python's low-level ctypes bindings, driven by our
continuous batcher: the offline figures measure llama.cpp's kernels, not its HTTP and JSON."""

from __future__ import annotations

import os
import time
from typing import Sequence

from tqdm import tqdm

from metrale_jax.bench.datasets import BenchRequest
from metrale_jax.bench.metrics import OfflineResult
from metrale_jax.bench.peers.llamacpp.batcher import (BATCH_TOKENS, UBATCH_TOKENS,
                                                      context_tokens, greedy_continuous)
from metrale_jax.bench.peers.llamacpp.locate import ENGINE, default_threads, import_llama_cpp

class LlamaCppContext:
    """A GGUF model and a llama.cpp context with `n_seq` KV streams of `ctx_per_seq`
    tokens each; a `DecodeBackend` for `greedy_continuous`. Close it (or use `with`)."""

    def __init__(self, gguf_path: str | os.PathLike, *, n_seq: int, ctx_per_seq: int,
                 threads: int | None = None, batch_tokens: int = BATCH_TOKENS,
                 ubatch_tokens: int = UBATCH_TOKENS):
        import numpy as np

        self._np = np
        self.lib = lib = import_llama_cpp()
        self.threads = threads or default_threads()
        self.batch_tokens = batch_tokens
        self.n_seq = n_seq
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(
            os.fsencode(gguf_path), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        params = lib.llama_context_default_params()
        params.n_ctx = n_seq * ctx_per_seq
        params.n_batch = batch_tokens
        params.n_ubatch = min(ubatch_tokens, batch_tokens)
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = self.threads
        # One KV stream per sequence, as llama-server runs with an explicit --parallel: a
        # token attends over its own sequence only, not over every slot's cache.
        params.kv_unified = False
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context of {params.n_ctx} tokens "
                               f"for {n_seq} sequences")
        self.n_ctx = lib.llama_n_ctx(self.ctx)
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(batch_tokens, 0, 1)

    def decode(self, tokens, positions, seq_ids, wants_logits) -> list[int]:
        if not 0 < len(tokens) <= self.batch_tokens:  # the C arrays hold batch_tokens
            raise ValueError(f"batch of {len(tokens)} tokens; 1 to {self.batch_tokens} fit")
        lib, b, np = self.lib, self.batch, self._np
        for i, (tok, pos, sid, want) in enumerate(zip(tokens, positions, seq_ids, wants_logits)):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = sid
            b.logits[i] = want
        b.n_tokens = len(tokens)
        rc = lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} on a batch of {len(tokens)} tokens "
                               f"(1: no room in the KV cache of {self.n_ctx} tokens)")
        out = []
        for i, want in enumerate(wants_logits):
            if want:
                row = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i),
                                            shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def release(self, seq_id: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = self.model = None

    def __enter__(self) -> "LlamaCppContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _warm_up(ctx: LlamaCppContext, requests: Sequence[BenchRequest]) -> None:
    """A short prefill and a few decode steps, then an empty cache: first-call costs (page
    faults on the weights, thread pool start, buffer allocation) stay out of the timing."""
    probe = [BenchRequest(requests[0].prompt_token_ids[:16], 4)] * min(2, ctx.n_seq)
    greedy_continuous(ctx, probe, len(probe), batch_tokens=ctx.batch_tokens)
    ctx.clear()


def _generate(gguf_path, requests: list[BenchRequest], concurrency: int, threads, progress):
    """(tokens per request, load+warm-up seconds, generation seconds, run facts)."""
    if not requests:
        raise ValueError("no requests")
    n_seq = min(concurrency, len(requests))
    ctx_per_seq, _ = context_tokens(requests, n_seq)
    t0 = time.perf_counter()
    ctx = LlamaCppContext(gguf_path, n_seq=n_seq, ctx_per_seq=ctx_per_seq, threads=threads,
                          batch_tokens=max(BATCH_TOKENS, n_seq))
    try:
        _warm_up(ctx, requests)
        warm_s = time.perf_counter() - t0
        with tqdm(total=len(requests), desc=f"llama.cpp c={concurrency}", unit="req",
                  disable=not progress, leave=False) as bar:
            t0 = time.perf_counter()
            tokens = greedy_continuous(ctx, requests, n_seq, batch_tokens=ctx.batch_tokens,
                                       on_finish=lambda _i: bar.update(1))
            elapsed = time.perf_counter() - t0
        info = {"threads": ctx.threads, "n_ctx": ctx.n_ctx}
    finally:
        ctx.close()
    return tokens, warm_s, elapsed, info


def run_offline(gguf_path: str | os.PathLike, requests: list[BenchRequest], concurrency: int,
                *, threads: int | None = None, progress: bool = True) -> OfflineResult:
    """Every request through llama.cpp, continuously batched `concurrency` at a time.
    compile_s is the model load plus a warm-up; elapsed_s the generation alone. The tokens
    themselves are returned by `greedy_tokens`.

    `threads` should not exceed the cores left free: llama.cpp's threads spin at barriers,
    so one that loses its core stalls every step (seen on a busy 2-core machine with 2
    threads: 2.2 output tokens/s at concurrency 1, against 79 to 94 when it was quiet)."""
    _, warm_s, elapsed, info = _generate(gguf_path, requests, concurrency, threads, progress)
    return OfflineResult(
        engine=ENGINE, concurrency=concurrency, requests=len(requests),
        input_tokens=sum(r.input_len for r in requests),
        output_tokens=sum(r.output_len for r in requests), elapsed_s=elapsed,
        compile_s=warm_s, extra={"batching": "continuous", **info})


def greedy_tokens(gguf_path: str | os.PathLike, requests: list[BenchRequest],
                  concurrency: int = 1, *, threads: int | None = None) -> list[list[int]]:
    """The greedy tokens `run_offline` generates, per request, for agreement checks."""
    tokens, *_ = _generate(gguf_path, requests, concurrency, threads, progress=False)
    return tokens
