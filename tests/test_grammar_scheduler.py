"""The scheduler's grammar rules on the fake runner (no jax, no llguidance): constrained
sequences are never spilled, the pipeline settles for them, their matcher sees exactly the
committed tokens (through preemption too), and the grammar's verdicts end sequences."""

from __future__ import annotations

import logging

from metrale_jax.scheduler import phases
from tests.fake_runner import reference_continuation
from tests.scheduler_harness import (TrackingGrammar, assert_accounted, drive, make_core,
                                     make_request, run, tick_until)


def _crowded_core(**kw):
    # 23 usable blocks of 4 tokens: three residents fill most of them (test_scheduler_rules).
    return make_core(num_blocks=24, block_size=4, max_batch=4, budget=64, chunk=64, **kw)


def _residents(grammar: list[bool]):
    reqs = [make_request(list(range(1, 30)), 8), make_request(list(range(40, 60)), 8),
            make_request(list(range(70, 78)), 8)]
    for r, constrained in zip(reqs, grammar):
        if constrained:
            r.sequences[0].grammar_state = TrackingGrammar()
    return reqs


def _assert_reference(reqs):
    for r in reqs:
        s = r.sequences[0]
        assert s.output_ids == reference_continuation(s.prompt_ids, s.params.max_tokens)
        if s.grammar_state is not None:
            assert s.grammar_state.tokens == s.output_ids


def test_a_grammar_sequence_is_never_a_victim_while_others_are():
    core = _crowded_core()
    reqs = _residents([True, False, False])  # the biggest is constrained
    for r in reqs:
        core.inbox.submit(r)
    tick_until(core, lambda: len(core.active) == 3)
    newcomer = make_request(list(range(100, 140)), 2)
    core.inbox.submit(newcomer)
    spilled = []
    real = core._swap_out
    core._swap_out = lambda seq: (spilled.append(seq.request_id), real(seq))[1]
    drive(core, reqs + [newcomer])
    assert spilled and reqs[0].request_id not in spilled  # every spill, not just the first
    _assert_reference(reqs + [newcomer])
    assert_accounted(core)


def test_with_only_grammar_candidates_nothing_is_spilled_and_nothing_is_lost():
    core = _crowded_core()
    reqs = _residents([True, True, True])
    for r in reqs:
        core.inbox.submit(r)
    tick_until(core, lambda: len(core.active) == 3)
    newcomer = make_request(list(range(100, 140)), 2)
    core.inbox.submit(newcomer)
    drive(core, reqs + [newcomer])
    assert core.tel.counters().get("spills", 0) == 0
    assert all(s.finish_reason == "length" for r in reqs + [newcomer] for s in r.sequences)
    _assert_reference(reqs + [newcomer])
    assert_accounted(core)


def test_phase_7_warns_and_spills_nothing_when_every_candidate_is_constrained(caplog):
    core = _crowded_core()
    reqs = _residents([True, True, True])
    for r in reqs:
        core.inbox.submit(r)
    tick_until(core, lambda: len(core.active) == 3)
    newcomer = make_request(list(range(100, 140)), 2).sequences[0]
    spilled = []
    with caplog.at_level(logging.WARNING, logger=phases.__name__):
        phases.swap_out_for_admissions([newcomer], active=core.active, memory=core.memory,
                                       spill_one=lambda s: spilled.append(s) or True)
    assert spilled == []
    assert "all grammar-constrained" in caplog.text
    drive(core, reqs)


def test_make_room_preempts_a_grammar_sequence_instead_of_spilling_it():
    # Decodes outgrow the pool; the only candidates are constrained: they recompute (their
    # matcher keeps exactly the committed tokens), and nothing is spilled.
    core = make_core(num_blocks=17, block_size=8, max_batch=4, budget=64, chunk=64)
    reqs = [make_request(list(range(1 + 10 * i, 20 + 10 * i)), 30, max_len=64)
            for i in range(4)]
    for r in reqs:
        r.sequences[0].grammar_state = TrackingGrammar()
    run(core, reqs)
    assert core.tel.counters().get("spills", 0) == 0
    assert core.tel.counters().get("preemptions", 0) > 0
    _assert_reference(reqs)
    assert_accounted(core)


def test_pipeline_settles_before_each_constrained_decode():
    core = make_core(pipeline=True)
    plain, constrained = make_request(list(range(20, 27)), 12), make_request(list(range(1, 9)), 12)
    constrained.sequences[0].grammar_state = TrackingGrammar()
    # grammar_masks raises if a mask is asked for with a token still on the device.
    run(core, [plain, constrained])
    _assert_reference([plain, constrained])
    assert constrained.sequences[0].grammar_state.masks_asked == 12
    # Unconstrained alone, the pipeline runs ahead again.
    alone = make_request(list(range(30, 37)), 12)
    core.inbox.submit(alone)
    tick_until(core, lambda: core.active and not core.prefilling)
    core.tick()
    assert core.inflight is not None


def test_grammar_verdicts_end_sequences():
    core = make_core()
    complete, rejected, cut = (make_request(list(range(1, 9)), 12) for _ in range(3))
    complete.sequences[0].grammar_state = TrackingGrammar(done_after=3)
    token = reference_continuation(rejected.sequences[0].prompt_ids, 3)[2]
    rejected.sequences[0].grammar_state = TrackingGrammar(reject=token)
    cut.sequences[0].grammar_state = TrackingGrammar()
    cut.sequences[0].params.max_tokens = 4
    run(core, [complete, rejected, cut])
    done = complete.sequences[0]
    assert done.finish_reason == "stop" and len(done.output_ids) == 3
    bad = rejected.sequences[0]
    assert bad.finish_reason == "error" and f"rejected {token}" in bad.error
    assert cut.sequences[0].finish_reason == "length" and len(cut.sequences[0].output_ids) == 4
    assert_accounted(core)
