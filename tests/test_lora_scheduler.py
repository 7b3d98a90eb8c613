"""Multi-LoRA in the tick loop, on the fake runner (no jax, no sleep): the adapter-cohort
gate, rotations at quiescence, adapters kept across spill and preemption, prefix-cache and
SSM-snapshot keys per adapter, and exact outputs per adapter.

The fake runner mixes the code of the weights in a row's adapter slot into the KV entries,
the SSM state and the token (`fake_runner.adapter_code`), so a row run on the wrong slot,
with replaced weights, or on another adapter's cached prefix gives another token."""

from __future__ import annotations

import pytest

from metrale_jax.lora.weights import LoraError
from metrale_jax.scheduler.state import LoadAdapter, UnloadAdapter
from metrale_jax.sequence import Status
from tests.fake_runner import reference_continuation
from tests.scheduler_harness import (add_adapter, assert_accounted, drive, fake_weights,
                                     make_core, make_request, run, tick_until)

P1 = list(range(1, 14))
P2 = list(range(20, 27))


def _want(req, weights=None):
    s = req.sequences[0]
    return reference_continuation(s.prompt_ids, s.params.max_tokens, adapter=weights)


class Acks:
    """An ack callable that records each call (exactly-once is checked on it)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, result, error) -> None:
        self.calls.append((result, error))


def _watch_adapters(core) -> list[set[str]]:
    """Per dispatched step, the adapters its rows ran with (names of the slots' weights)."""
    steps: list[set[str]] = []
    runner, dispatch = core.runner, core.runner.dispatch

    def recording(rows, *args, **kw):
        steps.append({runner.adapters[r.adapter_slot].name for r in rows if r.adapter_slot})
        return dispatch(rows, *args, **kw)

    runner.dispatch = recording
    return steps


# ---- rows and outputs ------------------------------------------------------------------------

def test_rows_carry_the_adapter_slot_and_outputs_follow_the_adapter():
    core = make_core(max_loras=3)
    weights = {name: add_adapter(core, name, s) for name, s in (("a", 1.0), ("b", 0.5),
                                                                ("c", 2.0))}
    reqs = {name: make_request(P1, 6, lora=name) for name in weights}
    base = make_request(P1, 6)
    run(core, [*reqs.values(), base])
    for name, r in reqs.items():
        assert r.sequences[0].output_ids == _want(r, weights[name])
        assert r.sequences[0].adapter_slot > 0
    assert base.sequences[0].output_ids == _want(base)
    # Different adapters give different outputs: the fake really depends on the slot.
    assert len({tuple(r.sequences[0].output_ids) for r in [*reqs.values(), base]}) == 4
    assert_accounted(core)


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("tight", [False, True])
@pytest.mark.parametrize("has_ssm", [False, True])
def test_mixed_adapters_equal_solo_runs(pipeline, prefix, tight, has_ssm):
    """Three adapters and the base model, sharing prompts (prefix-cache candidates), with the
    pipeline and the prefix cache on and off, and a pool so small that sequences spill and
    resume (or are preempted): every request gets its solo output."""
    bs, max_len = 4, 64
    core = make_core(num_blocks=12 if tight else 64, block_size=bs,
                     max_batch=4, budget=16, chunk=8, pipeline=pipeline, prefix=prefix,
                     has_ssm=has_ssm, max_loras=3, max_seq_len=max_len)
    weights = {None: None}
    for name, s in (("a", 1.0), ("b", 0.25), ("c", 3.0)):
        weights[name] = add_adapter(core, name, s)
    shared = list(range(30, 50))
    reqs = []
    for i in range(12):
        lora = [None, "a", "b", "c"][i % 4]
        prompt = (shared[:8 + i] if i % 3 else P1[: 5 + i % 7]) + [i + 1]
        reqs.append((lora, make_request(prompt, 8 + i % 5, lora=lora)))
    for tick in range(3000):
        for i, (_, r) in enumerate(reqs):
            if i // 4 == tick:
                core.inbox.submit(r)
        if tick >= len(reqs) and all(r.finished for _, r in reqs):
            break
        core.tick()
    else:
        raise AssertionError("workload did not finish")
    core.drain()
    for lora, r in reqs:
        assert r.sequences[0].output_ids == _want(r, weights[lora]), (lora, r.request_id)
    assert_accounted(core)
    if tight:
        counters = core.tel.counters()
        assert counters.get("spills", 0) + counters.get("preemptions", 0) > 0


# ---- the adapter-cohort gate -----------------------------------------------------------------

@pytest.mark.parametrize("hold", [0, 4])
def test_cohort_never_runs_more_adapters_than_slots_and_nobody_starves(hold):
    """max_loras=2, requests for 4 adapters arriving interleaved, one a tick: no step runs
    more than two adapters, every request finishes with its adapter's output, and none
    waits longer than the bound. A round is: at most `hold` ticks of grace, the drain of
    what runs (here at most 1 prefill + 6 decodes + 1 pipelined read-back = 8 ticks), the
    quiescent rotation tick and the admitting tick after it. A request waits at most
    ceil(4 adapters / 2 slots) rounds, plus the round under way when it arrives: 3 rounds,
    so wait <= 3 * (hold + 8 + 2) ticks (30 with hold 0, 42 with hold 4)."""
    core = make_core(max_loras=2, max_batch=4, budget=64, chunk=64, rotation_hold_ticks=hold)
    weights = {n: add_adapter(core, n, 1.0 + i) for i, n in enumerate("abcd")}
    steps = _watch_adapters(core)
    reqs = [make_request(P1[: 6 + i % 5], 6, lora="abcd"[i % 4]) for i in range(12)]
    submitted, admitted = {}, {}
    for tick in range(500):
        if tick < len(reqs):
            core.inbox.submit(reqs[tick])
            submitted[reqs[tick].request_id] = tick
        core.tick()
        for r in reqs:
            if r.request_id in submitted and r.request_id not in admitted \
                    and r.sequences[0].status is not Status.WAITING:
                admitted[r.request_id] = tick
        if all(r.finished for r in reqs):
            break
    core.drain()
    assert all(r.finished for r in reqs)
    assert max(len(s) for s in steps) <= 2
    assert {n for s in steps for n in s} == set("abcd")
    for i, r in enumerate(reqs):
        assert r.sequences[0].output_ids == _want(r, weights["abcd"[i % 4]])
    bound = 3 * (hold + 8 + 2)
    waits = [admitted[r.request_id] - submitted[r.request_id] for r in reqs]
    assert max(waits) <= bound, (waits, bound)
    assert_accounted(core)


def test_a_queued_rotation_holds_a_steady_stream_within_the_lever():
    """Base-model requests keep arriving (the engine is never idle on its own): a queued
    rotation still runs within rotation_hold_ticks + the drain + 2 ticks, and the stream
    goes on after it."""
    hold = 5
    core = make_core(max_loras=1, max_batch=2, budget=64, chunk=64, rotation_hold_ticks=hold)
    acks = Acks()
    stream = [make_request(P2, 3) for _ in range(60)]
    queued_at = None
    for tick, r in enumerate(stream):
        core.inbox.submit(r)
        if tick == 3:
            core.inbox.submit(LoadAdapter("a", "/adapters/a", fake_weights("a"), acks))
            queued_at = tick
        core.tick()
        if acks.calls and "applied" not in locals():
            applied = tick
    drive(core, stream)
    assert len(acks.calls) == 1 and acks.calls[0][1] is None
    drain = 1 + 3 + 1  # prefill, 3 decodes, the pipelined read-back
    assert applied - queued_at <= hold + drain + 2, (applied, queued_at)
    for r in stream:
        assert r.sequences[0].output_ids == _want(r)
    assert_accounted(core)


def test_request_for_an_unloaded_adapter_fails_and_others_are_served():
    core = make_core(max_loras=1)
    add_adapter(core, "a")
    busy = make_request(P1, 6)
    core.inbox.submit(busy)
    core.tick()
    acks = Acks()
    core.inbox.submit(UnloadAdapter("a", acks))
    orphan = make_request(P2, 3, lora="a")
    core.inbox.submit(orphan)
    drive(core, [busy, orphan])
    for _ in range(3):
        core.tick()
    assert acks.calls == [("unloaded a", None)]
    assert orphan.sequences[0].finish_reason == "error"
    assert "unloaded" in orphan.sequences[0].error
    assert busy.sequences[0].output_ids == _want(busy)
    assert_accounted(core)


# ---- rotations at quiescence ----------------------------------------------------------------

def test_unload_and_replace_wait_for_quiescence_and_are_acknowledged_once():
    core = make_core(max_loras=2)
    old = add_adapter(core, "a", 1.0)
    first = make_request(P1, 6, lora="a")
    core.inbox.submit(first)
    tick_until(core, lambda: core.active)
    new = fake_weights("a", 5.0)
    replace_acks, unload_acks = Acks(), Acks()
    core.inbox.submit(LoadAdapter("a", "/adapters/a2", new, replace_acks, replace=True))
    for _ in range(2):
        core.tick()
        assert replace_acks.calls == []  # "a" is running
    drive(core, [first])
    tick_until(core, lambda: replace_acks.calls)
    assert replace_acks.calls == [("replaced a", None)]
    assert first.sequences[0].output_ids == _want(first, old)
    second = make_request(P1, 6, lora="a")  # same prompt: the old version's cache is not reused
    run(core, [second])
    assert second.sequences[0].output_ids == _want(second, new)
    assert second.sequences[0].adapter_id != first.sequences[0].adapter_id
    core.inbox.submit(UnloadAdapter("a", unload_acks))
    for _ in range(5):
        core.tick()
    assert unload_acks.calls == [("unloaded a", None)]
    assert replace_acks.calls == [("replaced a", None)]  # still once
    assert ("unload", second.sequences[0].adapter_slot) in core.runner.adapter_calls
    assert "a" not in core.cohort.registry


def test_bad_rotations_are_answered_with_their_error():
    core = make_core(max_loras=1)
    add_adapter(core, "a")
    acks = Acks()
    core.inbox.submit(UnloadAdapter("nope", acks))
    core.inbox.submit(LoadAdapter("a", "/x", fake_weights("a"), acks))  # no replace
    for _ in range(2):
        core.tick()
    assert [type(e) for _, e in acks.calls] == [LoraError, LoraError]


def test_a_spilled_sequence_resumes_with_the_adapter_it_started_with():
    """A replace of its adapter is queued while the sequence is spilled: the replace waits
    until it has resumed and finished, and its output is the old weights' throughout."""
    core = make_core(num_blocks=24, block_size=4, max_batch=4, budget=64, chunk=64,
                     max_loras=2)
    old = add_adapter(core, "a", 1.0)
    residents = [make_request(list(range(1, 30)), 8, lora="a"),
                 make_request(list(range(40, 60)), 8),
                 make_request(list(range(70, 78)), 8, lora="a")]
    for r in residents:
        core.inbox.submit(r)
    tick_until(core, lambda: len(core.active) == 3)
    newcomer = make_request(list(range(100, 140)), 2)
    core.inbox.submit(newcomer)
    tick_until(core, lambda: any(s.lora_name == "a" for s in core.swapped))
    parked = next(s for s in core.swapped if s.lora_name == "a")
    slot, version = parked.adapter_slot, parked.adapter_id
    acks = Acks()
    core.inbox.submit(LoadAdapter("a", "/adapters/a2", fake_weights("a", 7.0), acks,
                                  replace=True))
    tick_until(core, lambda: parked.status is Status.RUNNING)
    assert acks.calls == []
    assert (parked.adapter_slot, parked.adapter_id) == (slot, version)
    drive(core, residents + [newcomer])
    for r in residents:
        want = old if r.sequences[0].lora_name == "a" else None
        assert r.sequences[0].output_ids == _want(r, want)
    tick_until(core, lambda: acks.calls)
    assert acks.calls == [("replaced a", None)]
    assert core.tel.counters().get("spills", 0) >= 1
    assert_accounted(core)


def test_a_preempted_sequence_recomputes_under_its_adapter():
    core = make_core(max_loras=1, swap=False, num_blocks=12, block_size=4, budget=32, chunk=32)
    w = add_adapter(core, "a", 2.0)
    reqs = [make_request(P1, 16, lora="a"), make_request(P2, 16, lora="a"),
            make_request(P1[:9], 12)]
    run(core, reqs)
    assert core.tel.counters().get("preemptions", 0) > 0
    for r in reqs:
        assert r.sequences[0].output_ids == _want(r, w if r.sequences[0].lora_name else None)
    assert_accounted(core)


# ---- caches keyed by adapter -----------------------------------------------------------------

@pytest.mark.parametrize("has_ssm", [False, True])
def test_prefix_blocks_and_snapshots_are_shared_per_adapter_only(has_ssm):
    core = make_core(max_loras=2, has_ssm=has_ssm, budget=64, chunk=64)
    wa, wb = add_adapter(core, "a", 1.0), add_adapter(core, "b", 2.0)
    prompt = list(range(1, 18))  # 4 full blocks of 4

    def hits():
        return core.pool.stats.prefix_hit_tokens

    first = make_request(prompt, 3, lora="a")
    run(core, [first])
    before = hits()
    other = make_request(prompt, 3, lora="b")
    run(core, [other])
    assert hits() == before  # another adapter: nothing reused
    base = make_request(prompt, 3)
    run(core, [base])
    assert hits() == before  # nor the base model
    again = make_request(prompt, 3, lora="a")
    run(core, [again])
    assert hits() > before  # the same adapter reuses its blocks (and, on SSM, its snapshot)
    assert first.sequences[0].output_ids == again.sequences[0].output_ids == _want(first, wa)
    assert other.sequences[0].output_ids == _want(other, wb)
    assert base.sequences[0].output_ids == _want(base)
    assert_accounted(core)


def test_snapshot_reports_adapters():
    core = make_core(max_loras=2, rotation_hold_ticks=100)
    add_adapter(core, "a")
    add_adapter(core, "b")
    add_adapter(core, "c")
    running = make_request(P1, 10, lora="a")
    core.inbox.submit(running)
    core.tick()  # quiescent: "a" is loaded at this tick, admitted at the next
    tick_until(core, lambda: core.active)
    core.inbox.submit(make_request(P2, 2, lora="b"))
    core.inbox.submit(make_request(P2, 2, lora="c"))
    core.tick()
    snap = core.tel.snapshot
    assert snap.max_loras == 2
    assert "a" in snap.lora_loaded
    assert dict(snap.lora_running) == {"a": 1}
    assert set(snap.lora_waiting) <= {"b", "c"}


@pytest.mark.parametrize("park", ["spill", "preempt"])
def test_replace_waits_while_the_only_sequence_left_is_parked(park):
    """Nothing runs but one parked sequence: the tick is not quiescent, so a queued replace
    of its adapter waits until it has resumed and finished under the old weights."""
    core = make_core(max_loras=1, pipeline=False)
    old = add_adapter(core, "a", 1.0)
    req = make_request(P1, 8, lora="a")
    core.inbox.submit(req)
    seq = req.sequences[0]
    tick_until(core, lambda: len(seq.output_ids) >= 2)
    if park == "spill":
        assert core._swap_out(seq)
    else:
        core.preempt(seq)
    acks = Acks()
    core.inbox.submit(LoadAdapter("a", "/adapters/a2", fake_weights("a", 9.0), acks,
                                  replace=True))
    core.tick()
    assert acks.calls == []
    drive(core, [req])
    assert seq.output_ids == _want(req, old)
    tick_until(core, lambda: acks.calls)
    assert acks.calls == [("replaced a", None)]
    assert_accounted(core)


def test_rotation_hold_ticks_is_a_validated_lever():
    from metrale_jax.scheduler.levers import LeverError

    core = make_core()
    assert core.levers.set(rotation_hold_ticks=0).rotation_hold_ticks == 0
    with pytest.raises(LeverError, match="rotation_hold_ticks"):
        core.levers.set(rotation_hold_ticks=-1)
