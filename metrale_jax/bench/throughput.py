"""Offline throughput: a list of requests through one engine, all submitted at once, at most
`concurrency` running together. A warm-up first runs the same workload spelled with other
tokens (`datasets.remapped`): the scheduler sees the same lengths in the same order, so the
warm-up compiles every step shape the measured run will use, and leaves nothing in the prefix
cache that the measured run could hit. Compilation is reported apart (`compile_s`), with any
that still happened inside the measured window (`compile_s_in_window`, expected 0)."""

from __future__ import annotations

import dataclasses
import time

from tqdm import tqdm

from metrale_jax.bench.datasets import BenchRequest, remapped
from metrale_jax.bench.metrics import OfflineResult
from metrale_jax.bench.timing import compile_seconds


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The engine settings a benchmark picks from its workload."""
    concurrency: int
    max_seq_len: int
    max_tokens_per_tick: int = 512
    block_size: int = 16
    enable_pipeline: bool = True
    enable_prefix_cache: bool = True

    @classmethod
    def for_requests(cls, requests: list[BenchRequest], concurrency: int,
                     **kw) -> "EngineShape":
        longest = max(r.input_len + r.output_len for r in requests)
        return cls(concurrency=concurrency, max_seq_len=longest + 1, **kw)

    def engine_kwargs(self) -> dict:
        blocks_per_seq = -(-self.max_seq_len // self.block_size)
        return dict(max_batch_size=self.concurrency,
                    max_tokens_per_tick=max(self.max_tokens_per_tick, self.concurrency),
                    max_seq_len=self.max_seq_len, block_size=self.block_size,
                    num_kv_blocks=self.concurrency * blocks_per_seq + 1,
                    enable_pipeline=self.enable_pipeline,
                    enable_prefix_cache=self.enable_prefix_cache)


def build_engine(model: str | None, shape: EngineShape):
    from metrale_jax.engine import LLMEngine

    return LLMEngine(model, **shape.engine_kwargs())


def drive(engine, requests: list[BenchRequest], *, progress: bool = False,
          desc: str = "metrale") -> float:
    """Submit every request, tick until all finish; returns the wall time."""
    from metrale_jax.request import SamplingParams

    reqs = [engine.make_request({"prompt_token_ids": list(r.prompt_token_ids)},
                                SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                               ignore_eos=True))
            for r in requests]
    bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    done = 0
    while done < len(reqs):
        engine.step()
        now_done = sum(r.finished for r in reqs)
        bar.update(now_done - done)
        done = now_done
    engine.drain()
    elapsed = time.perf_counter() - t0
    bar.close()
    for req, want in zip(reqs, requests):
        seq = req.sequences[0]
        if seq.error or len(seq.output_ids) != want.output_len:
            raise RuntimeError(f"request {req.request_id} produced {len(seq.output_ids)} of "
                               f"{want.output_len} tokens ({seq.error or 'no error'})")
    return elapsed


def run_metrale_offline(model: str | None, requests: list[BenchRequest], concurrency: int,
                        *, shape: EngineShape | None = None, progress: bool = True,
                        engine=None, warmup_seed: int = 1) -> OfflineResult:
    shape = shape or EngineShape.for_requests(requests, concurrency)
    own = engine is None
    c0 = compile_seconds()
    t0 = time.perf_counter()
    engine = engine or build_engine(model, shape)
    warmup = remapped(requests, engine.model_config.vocab_size, seed=warmup_seed)
    drive(engine, warmup, desc="metrale warm-up")
    warm_s = time.perf_counter() - t0
    c1 = compile_seconds()
    elapsed = drive(engine, requests, progress=progress, desc=f"metrale c={concurrency}")
    c2 = compile_seconds()
    if own:
        engine.close()
    return OfflineResult(
        engine="metrale_jax", concurrency=concurrency, requests=len(requests),
        input_tokens=sum(r.input_len for r in requests),
        output_tokens=sum(r.output_len for r in requests), elapsed_s=elapsed,
        compile_s=c1 - c0, extra={"warmup_s": round(warm_s, 3),
                                  "compile_s_in_window": round(c2 - c1, 3),
                                  "pipeline": shape.enable_pipeline})
