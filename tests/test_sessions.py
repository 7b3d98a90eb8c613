"""Sessions on the fake runner: a turn's tail (blocks and exact SSM state) serves the next
turn, short chats included; TTL on the injected clock, DELETE and memory pressure end
sessions and give everything back; budgets; a prompt-logprobs turn reuses nothing."""

from __future__ import annotations

import pytest

from metrale_jax.scheduler.sessions import CloseSession, SessionConfig
from tests.fake_runner import reference_continuation
from tests.scheduler_harness import (assert_accounted, make_core, make_request,
                                     poison_free_slots, run)


def _turn(core, prompt, max_tokens, session="chat", **kw):
    request = make_request(prompt, max_tokens, session_id=session, **kw)
    poison_free_slots(core)
    run(core, [request])
    seq = request.sequences[0]
    assert seq.output_ids == reference_continuation(prompt, max_tokens), seq.error
    return seq


def _close_all(core):
    for sid in list(core.sessions._open):
        core.sessions.close(sid)


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_chat_shorter_than_a_block_hits_its_tail(pipeline):
    core = make_core(block_size=16, pipeline=pipeline)
    first = _turn(core, [5, 6, 7], 3)
    history = first.prompt_ids + first.output_ids
    assert core.sessions.num_tails == 1 and core.pool.num_used == 1
    _turn(core, history + [8, 9], 2)
    counters = core.tel.counters()
    assert counters["session_tail_hits"] == 1
    # The tail covers every token that went through the model: all but (without the
    # pipeline) the last reply token.
    assert counters["session_tail_tokens"] >= len(history) - 1
    _close_all(core)
    assert_accounted(core)
    assert core.snapshots.num_held == 0


def test_an_edited_history_falls_back_to_the_prefix_cache():
    core = make_core(block_size=2, pipeline=False)
    first = _turn(core, [1, 2, 3, 4, 5], 4)
    edited = first.prompt_ids + [50, 51]  # the reply was regenerated differently
    _turn(core, edited, 3)
    assert "session_tail_hits" not in core.tel.counters()
    assert core.pool.stats.prefix_hit_tokens >= 4  # the prompt's own boundary snapshot
    _close_all(core)
    assert_accounted(core)


def test_prompt_logprobs_reuse_nothing():
    core = make_core(block_size=4)
    first = _turn(core, [1, 2, 3, 4, 5, 6], 3)
    seq = _turn(core, first.prompt_ids + first.output_ids + [7], 2, prompt_logprobs=1)
    assert "session_tail_hits" not in core.tel.counters()
    assert len(seq.prompt_logprobs) == len(seq.prompt_ids)
    _close_all(core)
    assert_accounted(core)


def test_ttl_on_the_injected_clock_ends_idle_sessions():
    core = make_core(sessions=SessionConfig(ttl_s=30.0))
    _turn(core, [1, 2, 3, 4, 5], 3, session="a")
    core.clock.advance(10.0)
    _turn(core, [9, 8, 7], 2, session="b")
    core.clock.advance(25.0)  # a: idle 35 s, b: idle 25 s
    core.tick()
    assert "a" not in core.sessions and "b" in core.sessions
    assert core.tel.counters()["sessions_expired"] == 1
    core.clock.advance(10.0)
    core.tick()
    assert len(core.sessions) == 0
    assert_accounted(core)


def test_delete_frees_the_pins_and_answers_unknown_ids():
    core = make_core()
    _turn(core, [1, 2, 3, 4, 5, 6, 7], 3, session="s")
    assert core.pool.num_used > 0
    acks = []
    core.inbox.submit(CloseSession("s", lambda result, err: acks.append((result, err))))
    core.inbox.submit(CloseSession("nope", lambda result, err: acks.append((result, err))))
    core.tick()
    assert acks == [(True, None), (False, None)]
    assert core.tel.counters()["sessions_deleted"] == 1
    assert_accounted(core)


def test_memory_pressure_evicts_idle_sessions_exactly():
    # 16 usable blocks of 4: two chats of ~12 tokens pin 3-4 blocks each, then a long
    # prompt needs most of the pool.
    core = make_core(num_blocks=17, block_size=4, max_seq_len=64, swap=False,
                     sessions=SessionConfig(max_pinned_fraction=1.0))
    _turn(core, list(range(1, 10)), 4, session="a")
    _turn(core, list(range(20, 29)), 4, session="b")
    assert core.sessions.pinned_blocks >= 6
    long = make_request(list(range(40, 92)), 6)
    run(core, [long])
    assert long.sequences[0].output_ids == reference_continuation(list(range(40, 92)), 6)
    assert core.tel.counters()["sessions_evicted"] >= 1
    _close_all(core)
    assert_accounted(core)


def test_budgets_bound_what_sessions_pin():
    core = make_core(block_size=2, sessions=SessionConfig(max_session_blocks=3))
    _turn(core, list(range(1, 12)), 3)  # 13 computed tokens: 7 blocks > 3
    assert core.sessions.num_tails == 0
    assert core.tel.counters()["session_tails_over_budget"] == 1
    # Globally: four snapshot slots at fraction 0.5 hold two tails, the oldest gives way.
    core = make_core(block_size=4, sessions=SessionConfig(max_pinned_fraction=0.5))
    for name in "abc":
        _turn(core, [ord(name), 1, 2], 2, session=name)
    assert core.sessions.num_tails == 2 and "a" not in core.sessions
    assert core.tel.counters()["sessions_evicted"] == 1
    _close_all(core)
    assert_accounted(core)


def test_session_config_is_validated():
    with pytest.raises(ValueError, match="sessions.ttl_s"):
        SessionConfig(ttl_s=0)
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        SessionConfig(max_pinned_fraction=1.5)
    with pytest.raises(ValueError, match="unknown field"):
        SessionConfig.parse({"ttl": 3})
    assert SessionConfig.parse({"ttl_s": 3}).ttl_s == 3


# ---- the second tier -----------------------------------------------------------------------

def _tier(tmp_path, host_bytes, disk_bytes):
    from metrale_jax.cache.spill import SpillStore
    from metrale_jax.cache.tiers import StateTier

    return StateTier(host_bytes, disk_bytes, SpillStore(tmp_path / "tier"))


def test_state_tier_moves_old_entries_to_disk_and_reads_corrupt_files_as_misses(tmp_path):
    import numpy as np

    tier = _tier(tmp_path, host_bytes=16, disk_bytes=40)
    a = {"x": np.arange(2, dtype=np.int64)}  # 16 bytes each
    for key in ("a", "b", "c", "d"):
        assert tier.put(key, {"x": a["x"] + ord(key)})
        tier.check_integrity()
    # RAM holds d; the disk holds b and c (24 bytes would not fit a third); a was dropped.
    assert "a" not in tier and tier.stats.dropped == 1
    assert (tier.take("d")["x"] == a["x"] + ord("d")).all() and tier.stats.host_hits == 1
    assert (tier.take("c")["x"] == a["x"] + ord("c")).all() and tier.stats.disk_hits == 1
    for f in (tmp_path / "tier").glob("*.x.*"):
        f.write_bytes(b"\0" * f.stat().st_size)  # same size, wrong bytes
    assert tier.take("b") is None and tier.stats.corrupt == 1
    assert not tier.put("big", {"x": np.zeros(8, np.int64)})  # fits neither level
    tier.check_integrity()
    assert len(tier) == 0 and list((tmp_path / "tier").iterdir()) == []


@pytest.mark.parametrize("levels", ["host", "disk", "corrupt"])
def test_pressure_moves_a_tail_to_the_tier_and_the_next_turn_restores_it(tmp_path, levels):
    host, disk = (1 << 20, 0) if levels == "host" else (0, 1 << 20)
    tier = _tier(tmp_path, host, disk)
    core = make_core(num_blocks=17, block_size=4, swap=False, tier=tier,
                     sessions=SessionConfig(max_pinned_fraction=1.0))
    first = _turn(core, list(range(1, 10)), 4, session="a")
    history = first.prompt_ids + first.output_ids
    run(core, [make_request(list(range(40, 92)), 6)])  # needs the pool: a's tail leaves
    assert core.sessions.num_stored == 1 and core.sessions.pinned_blocks == 0
    if levels == "corrupt":
        for f in (tmp_path / "tier").iterdir():
            if f.suffix != ".json":
                f.write_bytes(b"\1" * f.stat().st_size)
    _turn(core, history + [7, 7], 3, session="a")
    counters = core.tel.counters()
    if levels == "corrupt":
        assert counters["session_tier_misses"] == 1 and "session_tier_restores" not in counters
    else:
        assert counters["session_tier_restores"] == 1
    _close_all(core)
    assert_accounted(core)
    assert len(tier) == 0 and list((tmp_path / "tier").iterdir()) == []
