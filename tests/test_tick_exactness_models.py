"""Exactness of the tick loop on real models: greedy outputs of hypothesis-generated
workloads (random prompt lengths, shared prefixes, arrival ticks, aborts, max_tokens) equal
each request run alone, across prefix cache on/off, pipeline on/off, token budgets and chunk
sizes (levers: no recompilation), block sizes, and a KV pool so small that it must spill or
preempt — on the built-in hybrid and on a NemotronH hybrid loaded from a HF directory."""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_jax.engine import LLMEngine
from metrale_jax.request import SamplingParams
from tests.hf_models import save_tiny_nemotronh
from tests.scheduler_harness import assert_accounted

COMMON = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=64, seq_buckets=(4,),
              token_buckets=(16, 32), query_buckets=(1, 8, 32), max_logprobs=2,
              num_ssm_snapshots=4)


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotronh-tick")
    save_tiny_nemotronh(
        path, vocab_size=2048, intermediate_size=96, mamba_num_heads=4, ssm_state_size=8,
        max_position_embeddings=128,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"])
    return str(path)


def _engines(model):
    # (block size, pool blocks): a roomy pool, and one that holds a single full sequence.
    return {
        "roomy": LLMEngine(model, block_size=4, num_kv_blocks=80, block_buckets=(16,),
                           check_every_tick=True, **COMMON),
        "tight": LLMEngine(model, block_size=8, num_kv_blocks=10, block_buckets=(8,),
                           check_every_tick=True, **COMMON),
    }


@pytest.fixture(scope="module")
def default_engines():
    engines = _engines(None)
    yield engines
    for e in engines.values():
        e.close()


@pytest.fixture(scope="module")
def nemotron_engines(nemotron_dir):
    engines = _engines(nemotron_dir)
    yield engines
    for e in engines.values():
        e.close()


_solo: dict = {}


def _solo_run(engine: LLMEngine, key, prompt: list[int], max_tokens: int) -> list[int]:
    """The request alone: no prefix cache, no pipeline, nothing else in flight."""
    cache_key = (key, tuple(prompt), max_tokens)
    if cache_key not in _solo:
        levers = engine.levers.get()
        engine.levers.set(prefix_cache_enabled=False, pipeline_enabled=False)
        try:
            req = engine.make_request({"prompt_token_ids": prompt}, SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            engine.submit(req)
            while not req.finished:
                engine.step()
            _solo[cache_key] = req.sequences[0].output_ids
        finally:
            engine.levers.set(**{k: getattr(levers, k) for k in
                                 ("prefix_cache_enabled", "pipeline_enabled")})
    return _solo[cache_key]


workloads = st.lists(st.fixed_dictionaries({
    "prefix_len": st.sampled_from([0, 5, 17, 30]),
    "tail": st.lists(st.integers(3, 2000), min_size=1, max_size=10),
    "max_tokens": st.integers(1, 8),
    "arrive": st.integers(0, 4),
    "abort_at": st.one_of(st.none(), st.integers(1, 8)),
}), min_size=2, max_size=5)
levers = st.fixed_dictionaries({
    "prefix_cache_enabled": st.booleans(), "pipeline_enabled": st.booleans(),
    "swap_enabled": st.booleans(), "max_tokens_per_tick": st.sampled_from([8, 16, 32]),
    "prefill_chunk_size": st.sampled_from([3, 8, 32]),
})
SHARED = list(range(100, 140))


def _check(engines, key, pool, work, lever_values):
    engine = engines[pool]
    engine.levers.set(**lever_values)
    reqs = []
    for w in work:
        prompt = SHARED[:w["prefix_len"]] + w["tail"]
        reqs.append((w, engine.make_request({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True))))
    for tick in range(500):
        for w, r in reqs:
            if w["arrive"] == tick:
                engine.submit(r)
            if w["abort_at"] == tick and w["arrive"] < tick:
                engine.abort(r.request_id)
        if tick > 8 and all(r.finished for _, r in reqs):
            break
        engine.step()
    engine.drain()
    for w, r in reqs:
        s = r.sequences[0]
        assert s.finished
        if s.finish_reason == "abort":
            continue
        assert s.output_ids == _solo_run(engine, key, s.prompt_ids, w["max_tokens"]), w
    assert_accounted(engine.core)


SETTINGS = settings(max_examples=8, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@SETTINGS
@given(pool=st.sampled_from(["roomy", "tight"]), work=workloads, lever_values=levers)
def test_default_model_workloads_equal_solo(default_engines, pool, work, lever_values):
    _check(default_engines, "default", pool, work, lever_values)


@SETTINGS
@given(pool=st.sampled_from(["roomy", "tight"]), work=workloads, lever_values=levers)
def test_nemotronh_workloads_equal_solo(nemotron_engines, pool, work, lever_values):
    _check(nemotron_engines, "nemotronh", pool, work, lever_values)


def test_tight_pool_really_spills_and_preempts(default_engines):
    engine = default_engines["tight"]
    engine.levers.set(swap_enabled=True, pipeline_enabled=True, prefix_cache_enabled=True,
                      max_tokens_per_tick=32, prefill_chunk_size=32)
    before = engine.core.tel.counters()
    reqs = [engine.make_request({"prompt_token_ids": list(range(10 + i, 40 + i))},
                                SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
            for i in range(3)]
    for r in reqs:
        engine.submit(r)
    while not all(r.finished for r in reqs):
        engine.step()
    after = engine.core.tel.counters()
    moved = sum(after.get(k, 0) - before.get(k, 0) for k in ("spills", "preemptions"))
    assert moved > 0
    for r in reqs:
        s = r.sequences[0]
        assert s.output_ids == _solo_run(engine, "default", s.prompt_ids, 20)
    assert_accounted(engine.core)
