"""Hybrid state reuse on the fake runner: decode-time SSM snapshots (a finished turn's last
block boundary is a prefix hit for the next turn), their density cap, the snapshot pool's
states, and multi-turn workloads whose outputs equal solo runs (no jax, no sleep)."""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_jax.cache.spill import SpillStore
from metrale_jax.cache.ssm_snapshots import SnapshotPool
from metrale_jax.cache.tiers import StateTier
from metrale_jax.scheduler.sessions import CloseSession, SessionConfig
from tests.fake_runner import reference_continuation
from tests.scheduler_harness import (assert_accounted, make_core, make_request,
                                     poison_free_slots, run)


# ---- the pool's states ------------------------------------------------------------------

def test_staged_snapshot_is_not_matchable_until_published():
    pool = SnapshotPool([7, 8])
    slot = pool.hold("seq", 16)
    assert slot in (7, 8) and pool.held_at("seq") == 16 and pool.used == 1
    assert pool.hold("seq", 32) is None  # one staged per sequence
    assert b"h" not in pool
    assert pool.publish("seq", b"h") and pool.lookup(b"h") == slot
    assert pool.held_at("seq") is None
    pool.check_integrity(owners=[])


def test_publishing_a_known_boundary_frees_the_staged_copy():
    pool = SnapshotPool([1, 2])
    kept = pool.reserve(b"h")
    pool.hold("seq", 8)
    assert not pool.publish("seq", b"h")
    assert pool.lookup(b"h") == kept and pool.used == 1
    pool.check_integrity(owners=[])


def test_held_states_are_never_evicted_and_need_an_owner():
    pool = SnapshotPool([1, 2])
    pool.reserve(b"a")
    held = pool.hold("session", 5)
    pool.reserve(b"b")  # evicts a, never the held state
    assert b"a" not in pool and b"b" in pool and pool.held_slot("session") == held
    assert pool.hold("s", 4) is not None  # evicts b
    assert pool.reserve(b"c") is None and pool.hold("t", 4) is None  # every slot held
    with pytest.raises(AssertionError, match="owners gone"):
        pool.check_integrity(owners=["session"])
    pool.drop_held("s")
    pool.check_integrity(owners=["session"])
    with pytest.raises(ValueError, match="still held"):
        pool.clear()


# ---- decode-time snapshots in the scheduler -----------------------------------------------

@pytest.mark.parametrize("pipeline", [False, True])
def test_next_turn_reuses_the_last_decode_boundary(pipeline):
    core = make_core(block_size=4, pipeline=pipeline, chunk=64)
    prompt = [3, 1, 4, 1, 5]
    first = make_request(prompt, 10)
    run(core, [first])
    # 5 prompt + 9 fed outputs = 14 computed: boundaries at 4 (prompt), 8 and 12 (decode);
    # the cap keeps only the newest decode one.
    reply = first.sequences[0].output_ids
    assert core.snapshots.used == 2
    history = prompt + reply
    second = make_request(history + [9, 2, 6], 4)
    hits_before = core.pool.stats.prefix_hit_tokens
    run(core, [second])
    assert core.pool.stats.prefix_hit_tokens - hits_before == 12
    assert second.sequences[0].output_ids == reference_continuation(history + [9, 2, 6], 4)
    assert_accounted(core)


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_prompt_leaving_a_shared_prefix_snapshots_where_it_leaves(pipeline):
    """Chunks long enough that a prompt is snapshotted only at its own last boundary: the
    second prompt sharing the prefix finds its KV cached with no state there, so its
    prefill stops at that block once; every later one reuses the whole prefix."""
    core = make_core(block_size=4, chunk=64, budget=64, pipeline=pipeline)
    shared = list(range(10, 30))  # 5 blocks
    prompts = [shared + tail for tail in ([1, 2, 3, 4, 5, 6, 7], [9] * 5, [7] * 5, [8] * 6)]
    hits = []
    for prompt in prompts:
        before = core.pool.stats.prefix_hit_tokens
        request = make_request(prompt, 3)
        run(core, [request])
        hits.append(core.pool.stats.prefix_hit_tokens - before)
        assert request.sequences[0].output_ids == reference_continuation(prompt, 3)
    assert hits == [0, 0, 20, 20]
    assert_accounted(core)


def test_a_long_decode_keeps_one_decode_snapshot():
    core = make_core(block_size=2, chunk=64, max_seq_len=64)
    request = make_request([1, 2, 3], 40)
    core.inbox.submit(request)
    peak = 0
    while not request.finished:
        core.tick()
        peak = max(peak, core.snapshots.used)
    core.drain()
    # The prompt's boundary at 2, plus at most one decode-time snapshot (two while the
    # next one is staged and not yet published).
    assert peak <= 3
    assert core.snapshots.used == 2
    assert_accounted(core)


# ---- multi-turn exactness ------------------------------------------------------------------

configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "budget": st.sampled_from([4, 16, 64]),
    "chunk": st.sampled_from([1, 3, 64]),
    "pipeline": st.booleans(),
    "prefix": st.sampled_from([True, True, False]),
    "swap": st.booleans(),
    "tight": st.booleans(),  # a KV pool just big enough for one sequence: spill, preempt
    "sessions": st.sampled_from([True, True, False]),
    "session_blocks": st.sampled_from([2, 512, 512]),
    "pinned_fraction": st.sampled_from([0.25, 1.0]),
    # The second tier for tails leaving the device: off, RAM, disk, disk with every file
    # corrupted as soon as it is written.
    "tier": st.sampled_from(["off", "host", "disk", "corrupt"]),
    # The prefix tier for evicted prefix blocks and snapshots (its files are corrupted too
    # when "tier" is "corrupt").
    "prefix_tier": st.sampled_from(["off", "host", "disk"]),
})

# A turn: (new message, max_tokens, whether the next turn keeps this reply in its history).
chats = st.lists(st.fixed_dictionaries({
    "turns": st.lists(st.tuples(st.lists(st.integers(0, 96), min_size=1, max_size=12),
                                st.integers(1, 10), st.sampled_from([True, True, False])),
                      min_size=2, max_size=4),
    "arrive": st.integers(0, 4),
    "gap": st.integers(0, 8),             # ticks between a reply and the next turn
    "delete_at": st.one_of(st.none(), st.integers(0, 60)),  # DELETE of its session
}), min_size=2, max_size=4)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, work=chats)
def test_multi_turn_outputs_equal_solo_runs(cfg, work):
    """Each turn's prompt is the chat so far (prompts and replies; or, for an "edited"
    turn, without the last reply) plus a new message; with sessions on or off, and
    whatever is reused or evicted, every reply equals the one computed from scratch, and
    once the sessions close everything is back (no tier entry or file left)."""
    bs, max_len = cfg["block_size"], 64
    tier_dir = pathlib.Path(tempfile.mkdtemp(prefix="tier-test-"))
    host, disk = {"off": (0, 0), "host": (1 << 20, 0)}.get(cfg["tier"], (0, 1 << 20))
    tier = StateTier(host, disk, SpillStore(tier_dir))
    prefix_dir = tier_dir / "prefix"
    prefix_tier = StateTier(*{"off": (0, 0), "host": (1 << 20, 0),
                              "disk": (0, 1 << 20)}[cfg["prefix_tier"]],
                            SpillStore(prefix_dir, durable=False))
    num_blocks = (max_len // bs + 2) if cfg["tight"] else 4 * max_len // bs
    core = make_core(num_blocks=num_blocks, block_size=bs, max_batch=4,
                     budget=max(cfg["budget"], 4), chunk=cfg["chunk"],
                     pipeline=cfg["pipeline"], prefix=cfg["prefix"], swap=cfg["swap"],
                     max_seq_len=max_len, tier=tier, prefix_tier=prefix_tier,
                     sessions=SessionConfig(max_session_blocks=cfg["session_blocks"],
                                            max_pinned_fraction=cfg["pinned_fraction"]))
    history = [[] for _ in work]
    current = [None] * len(work)
    turn = [0] * len(work)
    ready_at = [0] * len(work)
    for tick in range(5000):
        for i, chat in enumerate(work):
            request = current[i]
            if request is not None and request.finished:
                seq = request.sequences[0]
                want = reference_continuation(seq.prompt_ids, seq.params.max_tokens)
                assert seq.output_ids == want, (cfg, chat, turn[i])
                keep_reply = chat["turns"][turn[i]][2]
                history[i] = seq.prompt_ids + (seq.output_ids if keep_reply else [])
                current[i], turn[i] = None, turn[i] + 1
                ready_at[i] = tick + chat["gap"]
            if current[i] is None and tick >= max(chat["arrive"], ready_at[i]) \
                    and turn[i] < len(chat["turns"]):
                message, max_tokens, _ = chat["turns"][turn[i]]
                prompt = (history[i] + message)[-(max_len - 10):]
                session = f"chat{i}" if cfg["sessions"] else None
                current[i] = make_request(prompt, max_tokens, max_len=max_len,
                                          session_id=session)
                core.inbox.submit(current[i])
            if cfg["sessions"] and chat["delete_at"] == tick:
                core.inbox.submit(CloseSession(f"chat{i}", lambda *_: None))
        if all(t == len(c["turns"]) for t, c in zip(turn, work)):
            break
        core.tick()
        poison_free_slots(core)
        if cfg["tier"] == "corrupt":
            for f in [*tier_dir.iterdir(), *prefix_dir.iterdir()]:
                if f.is_file() and f.suffix != ".json":
                    f.write_bytes(b"\1" * f.stat().st_size)
    else:
        raise AssertionError("workload did not finish")
    core.drain()
    for i in range(len(work)):
        core.sessions.close(f"chat{i}")
    assert_accounted(core)
    assert core.snapshots.num_held == 0
    assert len(tier) == 0 and list(tier_dir.iterdir()) == [prefix_dir]
    # The prefix tier keeps what it caches, within budget, its files exactly its entries.
    assert prefix_tier.host_used <= prefix_tier.host_bytes
    assert prefix_tier.disk_used <= prefix_tier.disk_bytes
    assert len({f.name.split(".")[0] for f in prefix_dir.iterdir()}) == len(prefix_tier._disk)
    shutil.rmtree(tier_dir)
