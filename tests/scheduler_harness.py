"""Build a SchedulerCore on the fake runner and drive it tick by tick (no jax, no sleep)."""

from __future__ import annotations

import atexit
import pathlib
import shutil
import tempfile

import numpy as np

from metrale_jax.cache.spill import SpillStore
from metrale_jax.default_model import ASSET_DIR
from metrale_jax.lora.registry import AdapterRegistry
from metrale_jax.lora.weights import LoraWeights
from metrale_jax.request import Request, SamplingParams
from metrale_jax.scheduler.core import SchedulerCore
from metrale_jax.scheduler.levers import Levers, LeverValues
from metrale_jax.scheduler.policy import make_policy
from metrale_jax.sequence import Sequence
from metrale_jax.telemetry import FakeClock
from metrale_jax.tokenizer import Tokenizer
from tests.fake_runner import FakeRunner

TOKENIZER = Tokenizer.from_dir(ASSET_DIR)
# Every fake core's spill store goes under one folder per test process, removed at exit (a
# folder a core leaves behind would otherwise stay in /tmp for good).
_SPILLS = pathlib.Path(tempfile.mkdtemp(prefix="fake-spills-"))
atexit.register(shutil.rmtree, _SPILLS, ignore_errors=True)


class RecordingSink:
    def __init__(self) -> None:
        self.updates: list[tuple[str, int, int]] = []
        self.finished: list[str] = []

    def on_update(self, request, seq) -> None:
        self.updates.append((request.request_id, seq.index, len(seq.output_ids)))

    def on_finished(self, request) -> None:
        self.finished.append(request.request_id)


def make_core(*, num_blocks: int = 64, block_size: int = 4, max_batch: int = 4,
              budget: int = 16, chunk: int = 8, swap: bool = True, pipeline: bool = True,
              prefix: bool = True, has_ssm: bool = True, watermark: float = 0.0,
              max_seq_len: int = 64, policy: str = "fcfs", spill=None,
              spill_dir: str | None = None, max_loras: int = 0,
              rotation_hold_ticks: int = 16, sessions=None,
              num_snapshots: int = 4, tier=None, prefix_tier=None) -> SchedulerCore:
    """`max_loras` > 0: LoRA on, with an `AdapterRegistry` whose loader builds
    `fake_weights` (register adapters with `add_adapter`)."""
    runner = FakeRunner(num_blocks, block_size, max_batch, has_ssm=has_ssm,
                        max_loras=max_loras, num_snapshot_slots=num_snapshots)
    levers = Levers(LeverValues(
        max_tokens_per_tick=budget, max_batch_size=max_batch, admit_watermark=watermark,
        prefill_chunk_size=chunk, swap_enabled=swap, pipeline_enabled=pipeline,
        prefix_cache_enabled=prefix, rotation_hold_ticks=rotation_hold_ticks),
        {"max_tokens_per_tick": budget,
                                       "max_batch_size": max_batch, "prefill_chunk_size": 64})
    if spill is None and swap:
        spill = SpillStore(pathlib.Path(spill_dir or tempfile.mkdtemp(dir=_SPILLS)))
    return SchedulerCore(
        runner=runner, levers=levers, policy=make_policy(policy),
        clock=FakeClock(step=0.001), sink=RecordingSink(), max_seq_len=max_seq_len,
        block_size=block_size, spill=spill,
        snapshot_slots=list(range(runner.num_seq_slots, runner.num_slots)),
        check_every_tick=True, sessions=sessions, tier=tier, prefix_tier=prefix_tier,
        adapters=AdapterRegistry(max_loras, fake_loader) if max_loras else None)


def fake_weights(name: str, scaling: float = 1.0) -> LoraWeights:
    """An adapter for the fake runner: only its name and scaling matter (`adapter_code`)."""
    return LoraWeights(name=name, rank=4, scaling=scaling, targets={})


def fake_loader(name: str, path: str) -> LoraWeights:
    """Reads nothing: the path's last part, when a number, is the scaling."""
    tail = pathlib.Path(path).name
    return fake_weights(name, float(tail) if tail.replace(".", "", 1).isdigit() else 1.0)


def add_adapter(core: SchedulerCore, name: str, scaling: float = 1.0) -> LoraWeights:
    """Register an adapter (no slot yet: the cohort gate loads it on demand)."""
    weights = fake_weights(name, scaling)
    core.cohort.registry.register(name, f"/adapters/{name}", weights)
    return weights


_ids = iter(range(10**9))


def make_request(prompt: list[int], max_tokens: int = 6, *, n: int = 1, priority: int = 0,
                 max_len: int = 64, lora: str | None = None, session_id: str | None = None,
                 **params) -> Request:
    rid = f"r{next(_ids)}"
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n, **params)
    seqs = [Sequence(request_id=rid, index=i, prompt_ids=list(prompt), params=sp, seed=i,
                     detok=TOKENIZER.incremental(prompt), eos_token_id=None, max_len=max_len,
                     priority=priority, lora_name=lora, session_id=session_id,
                     want_prompt_logprobs=(i == 0 and sp.prompt_logprobs is not None))
            for i in range(n)]
    return Request(rid, seqs, None)


def run(core: SchedulerCore, requests: list[Request], max_ticks: int = 2000) -> int:
    """Submit and tick until every request is finished; returns the ticks taken."""
    for r in requests:
        core.inbox.submit(r)
    return drive(core, requests, max_ticks)


def drive(core: SchedulerCore, requests: list[Request], max_ticks: int = 2000) -> int:
    """Tick until every (already submitted) request is finished."""
    for tick in range(max_ticks):
        if all(r.finished for r in requests):
            core.drain()
            return tick
        core.tick()
    raise AssertionError(f"not finished after {max_ticks} ticks: "
                         f"{[(r.request_id, [s.status for s in r.sequences]) for r in requests]}")


def tick_until(core: SchedulerCore, cond, limit: int = 200) -> None:
    """Tick until `cond()` holds; fail after `limit` ticks."""
    for _ in range(limit):
        if cond():
            return
        core.tick()
    raise AssertionError("condition never held")


def poison_free_slots(core: SchedulerCore) -> None:
    """A free slot's state is whatever was left there: nothing may rely on it (a slot
    freed and handed straight back would otherwise hide a missing state copy)."""
    core.runner.ssm[list(core.slots._free)] = 123457


def assert_accounted(core: SchedulerCore) -> None:
    """After a workload: every block back, no slot held, spill directory empty."""
    core.check_integrity()
    assert core.pool.num_used == 0
    assert core.pool.num_free + core.pool.num_cached == core.pool.num_usable
    assert core.slots.num_free == core.slots.num_slots - 1
    assert not (core.active or core.prefilling or core.swapped or core.preempted)
    if core.spill is not None:
        assert core.spill.keys() == []


class TrackingGrammar:
    """A grammar state that allows every token and keeps the tokens it was given: the
    scheduler's grammar rules tested on the fake runner, without llguidance. `done_after`:
    the grammar completes after that many tokens; `reject`: a token it refuses."""

    def __init__(self, done_after: int | None = None, reject: int | None = None):
        self.tokens: list[int] = []
        self.done_after, self.reject = done_after, reject
        self.masks_asked = 0

    def next_mask(self):
        self.masks_asked += 1
        return np.full(1, -1, np.int32)

    def advance(self, token: int) -> str | None:
        if token == self.reject:
            return f"rejected {token}"
        self.tokens.append(token)
        return None

    @property
    def done(self) -> bool:
        return self.done_after is not None and len(self.tokens) >= self.done_after
