"""No compilation after warm-up: a warmed engine serves a randomized mix of requests (every
sampling feature, n > 1, logprobs, prompt logprobs, penalties, logit bias of any size, stop
strings, chunked prefills, prefix sharing, swap-out/in and preemption on a tight KV pool)
and neither the engine's CompileCounter nor JAX's own compile events move.

JAX is watched independently of the counter: every backend compilation (a persistent-cache
hit included) records '/jax/core/compile/backend_compile_duration'.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest

from metrale_jax import LLM, SamplingParams, StructuredOutputsParams
from metrale_jax.runner.buckets import StepShape, serve_first
from tests.hf_models import save_tiny_llama
from tests.jax_events import BACKEND_COMPILE, EventWatch

NUM_REQUESTS = 520
# Small buckets (as the server tests use) and a KV pool far too small for 4 sequences of
# 64 tokens: sequences spill and come back, or are preempted, all the time.
ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=64, seq_buckets=(4,),
              token_buckets=(16, 32), query_buckets=(1, 8, 32), block_size=8,
              num_kv_blocks=14, block_buckets=(8,), max_logprobs=2, prefill_chunk_size=16)


def _params(rng: random.Random, vocab: int, prompt_len: int) -> SamplingParams:
    sampled = rng.random() < 0.6
    bias_size = rng.choice([0, 0, 0, 1, 3, 17, 200, 1000])
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]),
        temperature=rng.choice([0.7, 1.0, 1.3]) if sampled else 0.0,
        top_k=rng.choice([0, 0, 1, 5, 50, 200]), top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        seed=rng.choice([None, rng.randrange(2 ** 32)]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.0, 0.8, 1.3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.0, 0.5, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.0, 0.3, 1.0]),
        logit_bias={rng.randrange(vocab): rng.uniform(-3, 3) for _ in range(bias_size)} or None,
        max_tokens=rng.randint(1, min(6, 63 - prompt_len)),
        min_tokens=rng.choice([0, 0, 1]),
        stop=rng.choice([None, None, ["e"], [" the", "a"]]),
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, None, 0, 1, 2]),
        prompt_logprobs=rng.choice([None] * 6 + [0, 2]))


def random_mix(seed: int, vocab: int, n: int) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of 1-56 token ids, many sharing one of a few long prefixes (prefix hits),
    some long enough to prefill in several chunks; random parameters for each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(4)]
    prompts, params = [], []
    for _ in range(n):
        length = rng.choice([rng.randint(1, 8), rng.randint(9, 24), rng.randint(25, 56)])
        head = rng.choice(prefixes)[:length - 1] if rng.random() < 0.4 else []
        ids = head + [rng.randrange(3, vocab) for _ in range(length - len(head))]
        prompts.append({"prompt_token_ids": ids})
        params.append(_params(rng, vocab, length))
    # Some requests grammar-constrained (masks on the device), drawn from a stream of their
    # own so the rest of the mix stays as it was.
    grammar_rng = random.Random(seed + 1000)
    for p in params:
        if grammar_rng.random() < 0.15:
            p.structured_outputs = StructuredOutputsParams(**grammar_rng.choice(GRAMMARS))
    return prompts, params


GRAMMARS = [{"regex": "[a-z]{2,5}"}, {"choice": ["yes", "no"]},
            {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}]


def _drive_without_compiling(llm: LLM, seed: int, n: int = NUM_REQUESTS,
                             penalties: bool = True) -> dict:
    counter = llm.runner.counter
    before = counter.count
    prompts, params = random_mix(seed, llm.model_config.vocab_size, n)
    if not penalties:  # penalized rows never draft: a mix where most rows can
        params = [dataclasses.replace(p, repetition_penalty=1.0, presence_penalty=0.0,
                                      frequency_penalty=0.0) for p in params]
    start = dict(llm.engine.stats()["counters"])
    with EventWatch(BACKEND_COMPILE) as watch:
        outs = []
        for i in range(0, n, 130):  # in waves, so the pool drains and refills
            outs += llm.generate(prompts[i:i + 130], params[i:i + 130])
    assert watch.names == [], f"compiled after warm-up: {watch.names}"
    assert counter.count == before
    assert len(outs) == n and all(o.finished for o in outs)
    assert all(c.finish_reason is not None for o in outs for c in o.outputs)
    return {k: v - start.get(k, 0) for k, v in llm.engine.stats()["counters"].items()}


def _warmed(model: str | None, **extra) -> LLM:
    return LLM(model, **ENGINE, **extra)  # LLM() warms up: nothing below may compile


@pytest.fixture(scope="module")
def builtin():
    # With the prefix tier on (a small RAM level spilling to disk): its block-only and
    # snapshot-only moves are warmed too.
    llm = _warmed(None, prefix_tier={"host_bytes": 1 << 16, "disk_bytes": 1 << 26})
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_llama(path)
    llm = _warmed(str(path))
    yield llm
    llm.engine.close()


def test_builtin_model_compiles_nothing_after_warmup(builtin):
    hits = builtin.engine.core.pool.stats.prefix_hit_tokens
    stats = _drive_without_compiling(builtin, seed=1)
    # The mix really reached the paths that used to compile: swaps both ways, prefix hits
    # (SSM snapshot copies on this hybrid) and penalties after both.
    assert stats.get("spills", 0) > 0 and stats.get("swap_ins", 0) > 0, stats
    assert builtin.engine.core.pool.stats.prefix_hit_tokens > hits
    offload = builtin.engine.core.memory.prefix_tier.stats
    assert offload.blocks_stored > 0 and offload.blocks_restored > 0, offload


def test_builtin_model_with_mtp_compiles_nothing_after_warmup():
    """Speculative decoding on, the gate on auto: ticks run the plain step and the
    speculative one (drafts verified beside prefill chunks, spills and preemptions)."""
    llm = _warmed(None, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                            "gate": "auto"})
    try:
        stats = _drive_without_compiling(llm, seed=3, n=130)
        assert stats.get("spills", 0) > 0, stats
        llm.engine.levers.set(mtp_policy="on")
        stats = _drive_without_compiling(llm, seed=4, n=130, penalties=False)
        assert stats.get("spec_decode_num_drafts", 0) > 0, stats
        assert stats.get("spec_decode_num_accepted_tokens", 0) > 0, stats
    finally:
        llm.engine.close()


def test_speculative_variants_compiled_beside_serving_compile_nothing_after():
    """`metrale serve`'s warm-up: the covering plain shapes before serving, the other
    plain ones and the speculative ones on a thread. Until they are ready every tick runs
    the plain step, though the policy says "on"; after, speculation runs and nothing
    compiles. Greedy outputs are the same either way."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "gate": "on"}
    llm = LLM(None, warmup=False, **ENGINE, speculative_config=spec)
    try:
        runner = llm.runner
        runner.warmup(progress=False, speculative_later=True, serve_early=True)
        prompts = [{"prompt_token_ids": [5 + i, 9, 13 + i, 4]} for i in range(3)]
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        before = dict(llm.engine.stats()["counters"])
        early = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        drafts = llm.engine.stats()["counters"].get("spec_decode_num_drafts", 0)
        if not runner.speculation_ready:  # nothing drafted while the variants compiled
            assert drafts == before.get("spec_decode_num_drafts", 0)
        assert runner._later.wait(timeout=600) and runner._later.error is None
        assert runner.speculation_ready
        stats = _drive_without_compiling(llm, seed=5, n=130, penalties=False)
        assert stats.get("spec_decode_num_drafts", 0) > 0, stats
        with EventWatch(BACKEND_COMPILE) as watch:
            late = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert watch.names == [] and late == early
    finally:
        llm.engine.close()


class _ShapeLog:
    """The runner's step, noting the shape of every batch it runs."""

    def __init__(self, step):
        self._step, self.seen = step, set()

    def __getattr__(self, name):
        return getattr(self._step, name)

    def __call__(self, batch, *args, **kwargs):
        self.seen.add(StepShape(batch.num_tokens, batch.num_rows, batch.query_len,
                                batch.block_tables.shape[1]))
        return self._step(batch, *args, **kwargs)


def test_serving_early_runs_every_batch_padded_in_a_compiled_shape(tmp_path):
    """`metrale serve`'s plain warm-up: only `serve_first`'s shapes compile before serving.
    While the others wait to compile (held here), a mix of every feature runs padded in
    those shapes and compiles nothing; once they are compiled beside it, batches run in
    their own shapes, nothing compiles, and greedy and seeded outputs are what they were."""
    save_tiny_llama(tmp_path)
    llm = LLM(str(tmp_path), warmup=False, **{**ENGINE, "seq_buckets": (1, 2, 4)})
    try:
        runner = llm.runner
        log = runner.step = _ShapeLog(runner.step)
        hold = threading.Event()
        runner.warmup(progress=False, serve_early=True, hold=hold)
        plain = [shape for shape, _, _ in runner.warmup_variants()]
        first = set(serve_first(plain))
        assert runner.compiling == len(plain) - len(first) > 0
        rng = random.Random(7)
        prompts = [{"prompt_token_ids": [rng.randrange(3, 60) for _ in range(n)]}
                   for n in (1, 3, 9, 20, 40)]
        params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=9,
                                 ignore_eos=True, n=2)]

        def run() -> list:
            return [[c.token_ids for c in o.outputs]
                    for p in params for o in llm.generate(prompts, p)]

        early = run()
        _drive_without_compiling(llm, seed=8, n=130)
        assert log.seen and log.seen <= first  # padded: only what was compiled ran
        assert runner.compiling == len(plain) - len(first)
        hold.set()
        assert runner._later.wait(timeout=600) and runner._later.error is None
        assert runner.compiling == 0
        log.seen.clear()
        with EventWatch(BACKEND_COMPILE) as watch:
            late = run()
        assert watch.names == [] and late == early
        _drive_without_compiling(llm, seed=9, n=130)
        assert log.seen - first  # batches now run in their own shapes
    finally:
        llm.engine.close()


def test_llama_compiles_nothing_after_warmup(llama):
    stats = _drive_without_compiling(llama, seed=2)
    assert stats.get("spills", 0) > 0 and stats.get("swap_ins", 0) > 0, stats


def test_penalties_and_bias_equal_solo_runs_through_prefix_hits_and_swaps(builtin):
    # Alone, each sequence runs every token through its own slot; together, on a pool that
    # holds half of them, they hit each other's cached prefixes and spill and come back, so
    # their token histories reach the device through host writes. Greedy outputs match.
    rng = random.Random(11)
    vocab = builtin.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(33)]}
               for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                            repetition_penalty=1.4, presence_penalty=0.6,
                            frequency_penalty=0.4,
                            logit_bias={rng.randrange(vocab): rng.uniform(-2, 2)
                                        for _ in range(40)})
    plain = [o.outputs[0].token_ids for o in builtin.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))]
    solo = [builtin.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert solo != plain  # the penalties and bias change what greedy picks
    before = dict(builtin.engine.stats()["counters"])
    hits = builtin.engine.core.pool.stats.prefix_hit_tokens
    together = [o.outputs[0].token_ids for o in builtin.generate(prompts, params)]
    assert together == solo
    after = builtin.engine.stats()["counters"]
    assert after.get("swap_ins", 0) > before.get("swap_ins", 0)
    assert builtin.engine.core.pool.stats.prefix_hit_tokens > hits
