"""Exactness of the tick loop on real models: greedy outputs of hypothesis-generated
workloads (random prompt lengths, shared prefixes, arrival ticks, aborts, max_tokens) equal
each request run alone, across prefix cache on/off, pipeline on/off, token budgets and chunk
sizes (levers: no recompilation), block sizes, a KV pool so small that it must spill or
preempt, and MTP speculative decoding off / on / gated (the `mtp_policy` lever; the solo
run has it off, so speculation is checked against plain decoding) — on the built-in hybrid
(trained MTP modules: drafts often accepted) and on a NemotronH hybrid loaded from a HF
directory with MTP modules (random: drafts mostly rejected, so rollback runs all the
time)."""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_jax.engine import LLMEngine
from metrale_jax.request import SamplingParams
from metrale_jax.spec.config import SpeculativeConfigError
from tests.hf_models import add_nemotronh_mtp, save_tiny_llama, save_tiny_nemotronh
from tests.scheduler_harness import assert_accounted

COMMON = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=64, seq_buckets=(4,),
              token_buckets=(16, 32), query_buckets=(1, 8, 32), max_logprobs=2,
              num_ssm_snapshots=4)
SPEC = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotronh-tick")
    save_tiny_nemotronh(
        path, vocab_size=2048, intermediate_size=96, mamba_num_heads=4, ssm_state_size=8,
        max_position_embeddings=128,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"])
    add_nemotronh_mtp(path, num_modules=2)
    return str(path)


def _engines(model):
    # (block size, pool blocks): a roomy pool, and one that holds a single full sequence.
    return {
        "roomy": LLMEngine(model, block_size=4, num_kv_blocks=80, block_buckets=(16,),
                           check_every_tick=True, speculative_config={**SPEC, "gate": "on"},
                           **COMMON),
        "tight": LLMEngine(model, block_size=8, num_kv_blocks=10, block_buckets=(8,),
                           check_every_tick=True, speculative_config={**SPEC, "gate": "auto"},
                           **COMMON),
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
    """The request alone: no prefix cache, no pipeline, no speculation, nothing else in
    flight."""
    cache_key = (key, tuple(prompt), max_tokens)
    if cache_key not in _solo:
        levers = engine.levers.get()
        engine.levers.set(prefix_cache_enabled=False, pipeline_enabled=False, mtp_policy="off")
        try:
            req = engine.make_request({"prompt_token_ids": prompt}, SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            engine.submit(req)
            while not req.finished:
                engine.step()
            _solo[cache_key] = req.sequences[0].output_ids
        finally:
            engine.levers.set(**{k: getattr(levers, k) for k in
                                 ("prefix_cache_enabled", "pipeline_enabled", "mtp_policy")})
    return _solo[cache_key]


workloads = st.lists(st.fixed_dictionaries({
    "prefix_len": st.sampled_from([0, 5, 17, 30]),
    "tail": st.lists(st.integers(3, 2000), min_size=1, max_size=10),
    "max_tokens": st.integers(1, 12),
    "arrive": st.integers(0, 4),
    "abort_at": st.one_of(st.none(), st.integers(1, 8)),
}), min_size=2, max_size=5)
levers = st.fixed_dictionaries({
    "prefix_cache_enabled": st.booleans(), "pipeline_enabled": st.booleans(),
    "swap_enabled": st.booleans(), "max_tokens_per_tick": st.sampled_from([8, 16, 32]),
    "prefill_chunk_size": st.sampled_from([3, 8, 32]),
    "mtp_policy": st.sampled_from(["off", "on", "auto"]),
})
SHARED = list(range(100, 140))


def _check(engines, key, pool, work, lever_values) -> int:
    """Run the workload; returns how many rows verified drafts meanwhile."""
    engine = engines[pool]
    engine.levers.set(**lever_values)
    before = engine.core.tel.counters().get("spec_decode_num_drafts", 0)
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
    return engine.core.tel.counters().get("spec_decode_num_drafts", 0) - before


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


@pytest.mark.parametrize("mtp_policy", ["off", "on"])
def test_tight_pool_really_spills_and_preempts(default_engines, mtp_policy):
    engine = default_engines["tight"]
    engine.levers.set(swap_enabled=True, pipeline_enabled=True, prefix_cache_enabled=True,
                      max_tokens_per_tick=32, prefill_chunk_size=32, mtp_policy=mtp_policy)
    before = engine.core.tel.counters()
    reqs = [engine.make_request({"prompt_token_ids": list(range(10 + i, 40 + i))},
                                SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
            for i in range(3)]
    for r in reqs:
        engine.submit(r)
    while not all(r.finished for r in reqs):
        engine.step()
    engine.drain()
    after = engine.core.tel.counters()
    moved = sum(after.get(k, 0) - before.get(k, 0) for k in ("spills", "preemptions"))
    assert moved > 0
    drafted = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
    assert (drafted > 0) == (mtp_policy == "on")
    for r in reqs:
        s = r.sequences[0]
        assert s.output_ids == _solo_run(engine, "default", s.prompt_ids, 20)
    assert_accounted(engine.core)
    engine.levers.set(mtp_policy="auto")


def test_drafts_are_verified_and_accepted(default_engines):
    """The run above is not vacuous: the speculative step ran with drafts, and the trained
    MTP modules' drafts were accepted at both depths."""
    engine = default_engines["roomy"]
    engine.levers.set(prefix_cache_enabled=True, pipeline_enabled=True,
                      max_tokens_per_tick=32, prefill_chunk_size=32, mtp_policy="on")
    work = [{"prefix_len": 17, "tail": [5, 6, 7], "max_tokens": 24, "arrive": 0,
             "abort_at": None}, {"prefix_len": 0, "tail": [900, 901], "max_tokens": 24,
                                 "arrive": 1, "abort_at": None}]
    before = engine.core.tel.counters()
    assert _check(default_engines, "default", "roomy", work, {}) > 0
    after = engine.core.tel.counters()
    for d in range(2):
        name = f"spec_decode_num_accepted_tokens_per_pos_{d}"
        assert after.get(name, 0) > before.get(name, 0)


def test_multi_turn_sessions_with_mtp_and_spills_equal_solo(default_engines):
    """Chats in sessions, their turns running together in the tight pool: speculative
    decoding on, spills and preemptions mid-turn; every reply equals the prompt run
    alone, session tails are hit, and once the sessions close nothing is held."""
    engine = default_engines["tight"]
    engine.levers.set(swap_enabled=True, pipeline_enabled=True, prefix_cache_enabled=True,
                      max_tokens_per_tick=32, prefill_chunk_size=32, mtp_policy="on")
    before = engine.core.tel.counters()
    history = {f"chat{i}": list(range(200 + 30 * i, 218 + 30 * i)) for i in range(3)}
    for turn in range(3):
        reqs = {sid: engine.make_request(
            {"prompt_token_ids": history[sid] + [300 + turn]},
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), session_id=sid)
            for sid in history}
        for r in reqs.values():
            engine.submit(r)
        while not all(r.finished for r in reqs.values()):
            engine.step()
        engine.drain()
        for sid, r in reqs.items():
            s = r.sequences[0]
            assert s.output_ids == _solo_run(engine, "default", s.prompt_ids, 8), (sid, turn)
            history[sid] = s.prompt_ids + s.output_ids
    after = engine.core.tel.counters()
    for name in ("session_tail_hits", "spec_decode_num_drafts"):
        assert after.get(name, 0) > before.get(name, 0), name
    assert sum(after.get(k, 0) - before.get(k, 0) for k in ("spills", "preemptions")) > 0
    for sid in history:
        engine.core.sessions.close(sid)
    assert_accounted(engine.core)
    engine.levers.set(mtp_policy="auto")


def test_speculation_needs_mtp_modules(tmp_path):
    save_tiny_llama(tmp_path)
    with pytest.raises(SpeculativeConfigError, match="needs MTP modules"):
        LLMEngine(str(tmp_path), speculative_config=SPEC, **COMMON)
    with pytest.raises(SpeculativeConfigError, match="3 drafts need as many MTP modules"):
        LLMEngine(None, speculative_config={**SPEC, "num_speculative_tokens": 3}, **COMMON)


def _generate(engine: LLMEngine, prompt: list[int], params: SamplingParams, policy: str):
    engine.levers.set(mtp_policy=policy, pipeline_enabled=True, prefix_cache_enabled=True)
    req = engine.make_request({"prompt_token_ids": prompt}, params)
    engine.submit(req)
    while not req.finished:
        engine.step()
    engine.drain()
    return req.sequences


def test_logprobs_stops_and_n_equal_with_mtp_on_and_off(default_engines):
    """What a speculative run emits per token (logprobs, ranks, top-n) and where it stops
    (a stop string or stop token inside an accepted run, max_tokens) equal the plain run."""
    engine = default_engines["roomy"]
    prompt = [SHARED[0], 900, 17, 33, 1200]
    plain = _generate(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                     ignore_eos=True), "off")[0]
    stop_token = plain.output_ids[9]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2, n=2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                       stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                       stop=[plain.text[12:15]]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, min_tokens=3),
    ]
    for params in cases:
        off = _generate(engine, prompt, params, "off")
        on = _generate(engine, prompt, params, "on")
        for a, b in zip(off, on):
            assert b.output_ids == a.output_ids and b.text == a.text
            assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)
            if a.logprobs is not None:
                for pa, pb in zip(a.logprobs, b.logprobs):
                    assert pa.keys() == pb.keys()
                    for t in pa:
                        assert abs(pa[t].logprob - pb[t].logprob) < 1e-4
                        assert pa[t].rank == pb[t].rank


def test_sampled_requests_run_under_speculation(default_engines):
    """Seeded sampling with filters and penalties under speculation: every request finishes
    with its token count, penalized rows decode one token at a time (no drafts)."""
    engine = default_engines["roomy"]
    engine.levers.set(mtp_policy="on")
    reqs = [engine.make_request({"prompt_token_ids": [SHARED[i], 50 + i]}, SamplingParams(
        temperature=0.9, top_k=20, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True,
        repetition_penalty=1.2 if i == 0 else 1.0)) for i in range(3)]
    for r in reqs:
        engine.submit(r)
    while not all(r.finished for r in reqs):
        engine.step()
    engine.drain()
    assert all(len(r.sequences[0].output_ids) == 16 for r in reqs)
    assert_accounted(engine.core)


def test_a_seeded_request_emits_the_same_whatever_the_gate_chooses(default_engines,
                                                                   monkeypatch):
    """The gate on auto speculates as the load says, and the speculative step samples from
    streams of its own: a seeded sampled request then runs plain, so its text is the one
    MTP off gives, on every run. Shown against a gate that always wants speculation (it
    speculates for a greedy request beside) and against policy "on" (a different text)."""
    engine = default_engines["roomy"]
    prompt = [SHARED[1], 77, 5]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=24,
                            ignore_eos=True, n=2)
    off = [s.output_ids for s in _generate(engine, prompt, seeded, "off")]
    on = [s.output_ids for s in _generate(engine, prompt, seeded, "on")]
    assert on != off  # the speculative step's own streams
    gate = engine.core.gate  # on auto from here, and it always wants to speculate
    monkeypatch.setattr(gate, "choose", lambda batch: True)
    monkeypatch.setattr(gate, "choose_unmeasured", lambda batch: True)
    drafts = engine.core.tel.counters().get("spec_decode_num_drafts", 0)
    assert [s.output_ids for s in _generate(engine, prompt, seeded, "auto")] == off
    assert engine.core.tel.counters().get("spec_decode_num_drafts", 0) == drafts
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _generate(engine, prompt, greedy, "auto")
    assert engine.core.tel.counters().get("spec_decode_num_drafts", 0) > drafts
    engine.levers.set(mtp_policy="on")


def _run_batch(engine: LLMEngine, prompts, params, pipeline: bool):
    engine.levers.set(mtp_policy="on", pipeline_enabled=pipeline, prefix_cache_enabled=True)
    reqs = [engine.make_request({"prompt_token_ids": p}, q) for p, q in zip(prompts, params)]
    for r in reqs:
        engine.submit(r)
    while not all(r.finished for r in reqs):
        engine.step()
    engine.drain()
    return [[(s.output_ids, s.finish_reason) for s in r.sequences] for r in reqs]


@pytest.mark.parametrize("model", ["default", "nemotronh"])
def test_rows_packed_ahead_equal_the_read_back_ones(default_engines, nemotron_engines,
                                                    model, monkeypatch):
    """Pipelined speculation: decodes are packed before the speculative step ahead is read
    back, and the device moves each row on by the drafts that step accepted. Greedy and
    seeded sampled runs (whose random streams count the tokens sampled) then emit what
    the same requests emit with every step read back first, limits near the end included
    (the last rows cannot run ahead and the loop settles)."""
    import metrale_jax.scheduler.lanes as lanes
    packed_ahead = []
    real = lanes._ahead_row
    monkeypatch.setattr(lanes, "_ahead_row",
                        lambda seq, depth: packed_ahead.append(seq.uid) or real(seq, depth))
    engine = (default_engines if model == "default" else nemotron_engines)["roomy"]
    prompts = [[SHARED[i % len(SHARED)], 300 + 7 * i, 41] for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True)
              for i in range(2)] + [
              SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=24 + i,
                             ignore_eos=True, n=1 + i) for i in range(2)]
    settled = _run_batch(engine, prompts, params, pipeline=False)
    assert not packed_ahead
    assert _run_batch(engine, prompts, params, pipeline=True) == settled
    assert len(packed_ahead) > 10
    assert_accounted(engine.core)
