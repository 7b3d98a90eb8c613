"""Each rule of the seed's plan_tick, checked on the fake runner so it would fail without it."""

from __future__ import annotations

import pathlib

import pytest

from metrale_jax.cache.spill import SpillStore, SpillWriteError
from metrale_jax.scheduler import parking
from metrale_jax.scheduler import core as core_module
from metrale_jax.scheduler import phases
from metrale_jax.scheduler.levers import LeverError
from metrale_jax.scheduler.state import Rotation
from metrale_jax.sequence import Status
from tests.fake_runner import reference_continuation
from tests.scheduler_harness import (TrackingGrammar, assert_accounted, drive, make_core,
                                     make_request, run, tick_until)

P1 = list(range(1, 14))   # 13 tokens
P2 = list(range(20, 27))  # 7 tokens


def _outputs(req):
    return [s.output_ids for s in req.sequences]


def test_outputs_equal_reference_and_everything_is_returned():
    core = make_core()
    reqs = [make_request(P1, 8), make_request(P2, 5), make_request(P1[:5], 3)]
    run(core, reqs)
    for r in reqs:
        assert _outputs(r) == [reference_continuation(r.sequences[0].prompt_ids,
                                                      r.sequences[0].params.max_tokens)]
    assert_accounted(core)


def test_phase_order(monkeypatch):
    core = make_core()
    calls = []

    def spy(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapped

    for name in ("drain_pending", "gate_admissions", "build_snapshot", "apply_rotations",
                 "should_shut_down", "swap_out_for_admissions"):
        monkeypatch.setattr(phases, name, spy(name, getattr(phases, name)))
    monkeypatch.setattr(core_module, "pack_lanes", spy("lanes", core_module.pack_lanes))
    core.inbox.submit(make_request(P1, 2))
    core.tick()
    assert calls == ["drain_pending", "gate_admissions", "build_snapshot", "apply_rotations",
                     "should_shut_down", "swap_out_for_admissions", "lanes"]


def test_settle_only_for_prefill_or_parked_work(monkeypatch):
    core = make_core(pipeline=True)
    settles = []
    real = core.settle
    monkeypatch.setattr(core, "settle", lambda: (settles.append(core.inflight is not None),
                                                 real())[1])
    core.inbox.submit(make_request(P2, 20))
    tick_until(core, lambda: core.active and not core.prefilling)
    settles.clear()
    for _ in range(3):  # pure decode ticks: the step stays ahead of the host
        core.tick()
        assert core.inflight is not None
    assert not any(settles)
    core.inbox.submit(make_request(P1, 2))  # a new prompt: this tick must settle first
    core.tick()
    assert settles and settles[0] is True


def test_snapshot_fields():
    core = make_core(num_blocks=40)
    core.inbox.submit(make_request(P1, 20))
    core.inbox.submit(make_request(P2, 20))
    tick_until(core, lambda: len(core.active) == 2)
    plan = core.plan_tick()  # phase 4 publishes before the lanes allocate anything
    snap = core.tel.snapshot
    assert snap.active_seqs == 2 and snap.prefilling_seqs == 0 and snap.swapped_seqs == 0
    assert snap.kv_blocks_total == 39
    assert snap.kv_blocks_free == core.pool.num_free
    assert snap.steps_total == core.steps_total
    assert snap.ssm_slots_total == 4 and snap.ssm_slots_used == core.snapshots.used
    assert snap.mtp_mode == "off" and snap.published_at > 0
    core.run_lanes(plan)


def _crowded_core(**kw):
    kw = {"budget": 64, "chunk": 64, **kw}
    # 23 usable blocks of 4 tokens: the three `_residents` fill most of them.
    return make_core(num_blocks=24, block_size=4, max_batch=4, **kw)


def _residents():
    """29-, 20- and 8-token prompts decoding 8 tokens each: 21 blocks at the end."""
    return [make_request(list(range(1, 30)), 8), make_request(list(range(40, 60)), 8),
            make_request(list(range(70, 78)), 8)]


def _newcomer():
    return make_request(list(range(100, 140)), 2)  # 40 tokens: 11 blocks, only after a spill


def _submit_newcomer(core):
    newcomer = _newcomer()
    core.inbox.submit(newcomer)
    return newcomer


def _assert_reference(reqs):
    for r in reqs:
        s = r.sequences[0]
        assert s.output_ids == reference_continuation(s.prompt_ids, s.params.max_tokens)


def _admit_residents(core):
    reqs = _residents()
    for r in reqs:
        core.inbox.submit(r)
    tick_until(core, lambda: len(core.active) == 3)
    return reqs


def test_victim_has_most_blocks_and_is_never_grammar_constrained():
    core = _crowded_core()
    long_grammar, mid, short = reqs = _admit_residents(core)
    long_grammar.sequences[0].grammar_state = TrackingGrammar()
    newcomer = _submit_newcomer(core)
    tick_until(core, lambda: core.swapped)
    assert [s.request_id for s in core.swapped] == [mid.request_id]
    long_grammar.sequences[0].grammar_state = None
    drive(core, reqs + [newcomer])
    _assert_reference(reqs + [newcomer])
    assert_accounted(core)


def test_prefix_reclaim_spares_the_requests_own_prefix():
    core = make_core(num_blocks=20, block_size=4, budget=64, chunk=64)
    shared = list(range(1, 18))
    run(core, [make_request(shared, 1)])              # its blocks go first in LRU order
    run(core, [make_request(list(range(50, 67)), 1)])
    assert core.pool.num_cached == 8
    hog = make_request(list(range(100, 136)), 4)       # 10 blocks from the 11 free
    core.inbox.submit(hog)
    tick_until(core, lambda: hog.sequences[0].status is Status.RUNNING)
    hits_before = core.pool.stats.prefix_hit_tokens
    again = make_request(shared[:16] + list(range(200, 209)), 3)  # reuses 4 blocks, needs 3
    core.inbox.submit(again)
    drive(core, [again, hog])
    assert core.pool.stats.prefix_hit_tokens - hits_before == 16
    assert core.tel.counters().get("spills", 0) == 0   # reclaiming was enough
    _assert_reference([again, hog])
    assert_accounted(core)


def test_prompt_logprobs_request_reuses_nothing():
    core = make_core()
    run(core, [make_request(P1, 2)])
    hits = core.pool.stats.prefix_hit_tokens
    scored = make_request(P1, 2, prompt_logprobs=1)
    run(core, [scored])
    assert core.pool.stats.prefix_hit_tokens == hits
    assert len(scored.sequences[0].prompt_logprobs) == len(P1)
    plain = make_request(P1, 2)
    run(core, [plain])
    assert core.pool.stats.prefix_hit_tokens > hits  # the same prompt without logprobs does


class FailingStore:
    def __init__(self):
        self.attempts = 0

    def write(self, key, arrays, meta):
        self.attempts += 1
        raise SpillWriteError(f"spill {key!r}: disk full")

    def read(self, handle):
        raise AssertionError("nothing was written")

    def remove(self, handle):
        pass

    def keys(self):
        return []


def test_failing_spill_keeps_sequence_active_and_output_unchanged():
    store = FailingStore()
    core = _crowded_core(spill=store)
    reqs = _admit_residents(core)
    newcomer = _submit_newcomer(core)
    core.tick()
    assert store.attempts == 1  # one failure stops spilling for the tick
    assert len(core.active) == 3 and not core.swapped
    drive(core, reqs + [newcomer])
    _assert_reference(reqs + [newcomer])
    assert core.tel.counters()["spill_failures"] >= 1
    assert_accounted(core)


def test_a_failed_spill_pauses_spilling_then_tries_again():
    # A full disk used to be retried at every preemption (the same error many times in
    # 40 ms); now spilling pauses, doubling per failure, and recompute stands in meanwhile.
    store = FailingStore()
    core = _crowded_core(spill=store)
    reqs = _admit_residents(core)
    newcomer = _submit_newcomer(core)
    for _ in range(30):
        core.tick()
    assert store.attempts == 1 and not core.parking.can_spill()
    core.clock.advance(parking.SPILL_BACKOFF_S[0])
    assert core.parking.can_spill()
    drive(core, reqs + [newcomer])
    _assert_reference(reqs + [newcomer])
    assert_accounted(core)


def test_corrupt_spill_file_falls_back_to_exact_recompute(tmp_path):
    core = _crowded_core(spill_dir=str(tmp_path))
    reqs = _admit_residents(core)
    newcomer = _submit_newcomer(core)
    tick_until(core, lambda: core.swapped)
    victim = core.swapped[0]
    for f in pathlib.Path(tmp_path).glob("*.bin"):
        data = bytearray(f.read_bytes())
        data[0] ^= 0xFF
        f.write_bytes(bytes(data))
    drive(core, reqs + [newcomer])
    assert victim.finish_reason == "length" and victim.error is None
    _assert_reference(reqs + [newcomer])  # the victim's output too: recompute is exact
    assert core.tel.counters()["spill_corrupt"] == 1
    assert_accounted(core)


def test_shutdown_waits_for_parked_work():
    core = _crowded_core()
    reqs = _admit_residents(core) + [_newcomer()]
    core.inbox.submit(reqs[-1])
    tick_until(core, lambda: core.swapped)
    core.inbox.close()
    ticks = 0
    while core.tick():
        ticks += 1
        assert ticks < 1000
    assert all(r.finished for r in reqs)
    assert all(r.sequences[0].finish_reason == "length" for r in reqs)
    _assert_reference(reqs)
    assert_accounted(core)


def test_preemption_by_recompute_when_swap_is_off():
    core = _crowded_core(swap=False)
    reqs = [make_request(list(range(1, 30)), 30), make_request(list(range(40, 60)), 30),
            make_request(list(range(70, 78)), 30)]
    run(core, reqs)
    assert core.tel.counters().get("preemptions", 0) >= 1
    _assert_reference(reqs)
    assert_accounted(core)


@pytest.mark.parametrize("where", ["pending", "prefilling", "running", "swapped"])
def test_abort_anywhere(where):
    if where == "swapped":  # residents first, then a newcomer that makes room by spilling
        core = _crowded_core()
        reqs = _admit_residents(core) + [_newcomer()]
        core.inbox.submit(reqs[-1])
    else:  # small chunks and budget keep sequences in each state for a few ticks
        core = _crowded_core(chunk=4, budget=8)
        reqs = _residents() + [_newcomer()]
        for r in reqs:
            core.inbox.submit(r)
    state = {"pending": Status.WAITING, "prefilling": Status.PREFILLING,
             "running": Status.RUNNING, "swapped": Status.SWAPPED}[where]
    target = None

    def found():
        nonlocal target
        target = next((r for r in reqs if r.sequences[0].status is state), None)
        return target is not None

    tick_until(core, found)
    core.inbox.abort(target.request_id)
    others = [r for r in reqs if r is not target]
    drive(core, others)
    core.tick()
    assert target.sequences[0].finish_reason == "abort"
    _assert_reference(others)
    assert_accounted(core)


def test_prompt_longer_than_max_seq_len_is_answered_with_an_error():
    core = make_core(max_seq_len=16)
    bad = make_request(list(range(1, 20)), 2)
    good = make_request(P2, 3)
    run(core, [bad, good])
    assert bad.sequences[0].finish_reason == "error"
    assert "max_seq_len" in bad.sequences[0].error and "truncated" in bad.sequences[0].error
    assert good.sequences[0].output_ids == reference_continuation(P2, 3)
    assert_accounted(core)


def test_rotations_wait_for_quiescence_and_are_acknowledged():
    core = make_core()
    applied, acks = [], []
    busy = make_request(P1, 4)
    core.inbox.submit(busy)
    core.tick()
    core.inbox.submit(Rotation(apply=lambda: applied.append("load") or "ok",
                               ack=lambda res, err: acks.append((res, err))))
    core.tick()
    assert applied == [] and acks == []  # a sequence is still running
    drive(core, [busy])
    for _ in range(3):
        core.tick()
    assert applied == ["load"] and acks == [("ok", None)]


def test_priority_policy_admits_lower_values_first():
    core = make_core(max_batch=1, policy="priority")
    low = make_request(P1, 1, priority=5)
    high = make_request(P2, 1, priority=-1)
    core.inbox.submit(low)
    core.inbox.submit(high)
    core.tick()
    assert [s.request_id for s in core.prefilling + core.active] == [high.request_id]


def test_levers_are_typed_and_validated():
    core = make_core()
    assert core.levers.set(max_tokens_per_tick=8).max_tokens_per_tick == 8
    with pytest.raises(LeverError, match="no_such_lever"):
        core.levers.set(no_such_lever=1)
    with pytest.raises(LeverError, match="max_tokens_per_tick"):
        core.levers.set(max_tokens_per_tick=10_000)
    with pytest.raises(LeverError, match="swap_enabled"):
        core.levers.set(swap_enabled="yes")
    with pytest.raises(LeverError, match="admit_watermark"):
        core.levers.set(admit_watermark=1.5)


def test_spill_files_are_removed_once_used(tmp_path):
    core = _crowded_core(spill=SpillStore(tmp_path))
    reqs = _admit_residents(core) + [_newcomer()]
    core.inbox.submit(reqs[-1])
    drive(core, reqs)
    assert core.tel.counters().get("spills", 0) >= 1
    assert list(tmp_path.iterdir()) == []
