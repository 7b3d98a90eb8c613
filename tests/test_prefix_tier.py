"""The prefix tier on the fake runner: cached prefix blocks and SSM snapshots the device
evicts go to host RAM / disk and come back on a hit; corrupt or missing entries are misses;
budgets hold; every output equals the one computed from scratch (no jax, no sleep)."""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_jax.cache.prefix_hash import hash_blocks
from metrale_jax.cache.spill import SpillStore
from metrale_jax.cache.tiers import StateTier
from tests.fake_runner import reference_continuation
from tests.scheduler_harness import (assert_accounted, make_core, make_request,
                                     poison_free_slots, run)

LEVELS = {"host": (1 << 20, 0), "disk": (0, 1 << 20), "both": (2048, 1 << 20)}


@pytest.fixture
def tier_dir():
    path = pathlib.Path(tempfile.mkdtemp(prefix="prefix-tier-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _core(tier_dir, level: str, has_ssm: bool, num_blocks: int = 12, **kw):
    host, disk = LEVELS[level]
    tier = StateTier(host, disk, SpillStore(tier_dir, durable=False))
    core = make_core(num_blocks=num_blocks, block_size=4, chunk=8, has_ssm=has_ssm,
                     prefix_tier=tier, **kw)
    return core, tier


def _evict_everything(core, filler_len: int = 40) -> None:
    """Unrelated prompts that need the whole pool: every cached block is evicted."""
    for seed in range(2):
        filler = [(7 * i + 11 * seed) % 90 + 3 for i in range(filler_len)]
        run(core, [make_request(filler, 2)])


@pytest.mark.parametrize("has_ssm", [False, True])
@pytest.mark.parametrize("level", ["host", "disk", "both"])
def test_an_evicted_prefix_comes_back_from_the_tier(tier_dir, level, has_ssm):
    core, tier = _core(tier_dir, level, has_ssm)
    shared = [(5 * i) % 83 + 2 for i in range(24)]  # 6 blocks of 4
    run(core, [make_request(shared + [1, 2], 3)])
    _evict_everything(core)
    stats = core.memory.prefix_tier.stats
    assert stats.blocks_stored >= 6
    hits = core.pool.stats.prefix_hit_tokens
    prompt = shared + [9, 9, 9]
    request = make_request(prompt, 5)
    run(core, [request])
    assert request.sequences[0].output_ids == reference_continuation(prompt, 5)
    assert stats.blocks_restored >= 1 and stats.hit_tokens >= 4
    assert core.pool.stats.prefix_hit_tokens - hits >= 4
    if has_ssm:
        assert stats.snapshots_restored + stats.snapshots_stored >= 1
    assert_accounted(core)


def test_restored_blocks_are_the_devices_again(tier_dir):
    """A restored block is committed to the prefix cache: the next request hits it on
    the device, and the tier no longer holds it (every entry is in one place)."""
    core, tier = _core(tier_dir, "host", has_ssm=False)
    shared = [(3 * i) % 80 + 4 for i in range(16)]
    run(core, [make_request(shared + [1], 2)])
    _evict_everything(core)
    offload = core.memory.prefix_tier
    hashes = hash_blocks(shared, 4, 0)
    assert all(h in offload._blocks for h in hashes)
    run(core, [make_request(shared + [2], 2)])
    restored = offload.stats.blocks_restored
    assert restored == 4 and not any(h in offload._blocks for h in hashes)
    hits = core.pool.stats.prefix_hit_tokens
    request = make_request(shared + [3], 4)
    run(core, [request])
    assert core.pool.stats.prefix_hit_tokens - hits == 16
    assert core.memory.prefix_tier.stats.blocks_restored == restored  # from the device
    assert request.sequences[0].output_ids == reference_continuation(shared + [3], 4)
    assert_accounted(core)


@pytest.mark.parametrize("has_ssm", [False, True])
def test_corrupt_or_missing_tier_files_are_misses(tier_dir, has_ssm):
    core, tier = _core(tier_dir, "disk", has_ssm)
    shared = [(5 * i) % 83 + 2 for i in range(24)]
    run(core, [make_request(shared + [1, 2], 3)])
    _evict_everything(core)
    files = sorted(f for f in tier_dir.iterdir() if f.suffix != ".json")
    assert files
    for f in files[::2]:
        f.write_bytes(b"\1" * f.stat().st_size)
    for f in files[1::4]:
        f.unlink()
    prompt = shared + [9, 9]
    request = make_request(prompt, 5)
    run(core, [request])
    assert request.sequences[0].output_ids == reference_continuation(prompt, 5)
    assert core.memory.prefix_tier.stats.misses >= 1
    assert_accounted(core)


def test_budgets_push_the_oldest_entries_out(tier_dir):
    # The fake's block is 4 int64 entries: 32 bytes; room for 3 on the host, 4 on disk.
    tier = StateTier(96, 128, SpillStore(tier_dir, durable=False))
    core = make_core(num_blocks=12, block_size=4, chunk=8, has_ssm=False, prefix_tier=tier)
    for seed in range(4):
        prompt = [(seed * 13 + 3 * i) % 80 + 4 for i in range(20)]
        run(core, [make_request(prompt, 2)])
    _evict_everything(core)
    assert tier.host_used <= 96 and tier.disk_used <= 128
    assert 0 < len(core.memory.prefix_tier) <= 7 and tier.stats.dropped > 0
    assert_accounted(core)  # the index agrees with the tier and its files


def test_prompt_logprobs_requests_reuse_nothing_from_the_tier(tier_dir):
    core, tier = _core(tier_dir, "host", has_ssm=True)
    shared = [(5 * i) % 83 + 2 for i in range(24)]
    run(core, [make_request(shared + [1], 2)])
    _evict_everything(core)
    request = make_request(shared + [1], 2, prompt_logprobs=1)
    run(core, [request])
    assert core.memory.prefix_tier.stats.blocks_restored == 0
    assert len(request.sequences[0].output_ids) == 2
    assert_accounted(core)


# ---- mixed workloads ------------------------------------------------------------------------

configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "chunk": st.sampled_from([1, 3, 64]),
    "budget": st.sampled_from([4, 16, 64]),
    "pipeline": st.booleans(),
    "swap": st.booleans(),
    "has_ssm": st.booleans(),
    "pool": st.sampled_from(["tight", "small", "roomy"]),
    # off / RAM / disk / RAM spilling to disk / budgets of a few blocks / every file
    # corrupted as soon as it is written.
    "tier": st.sampled_from(["off", "host", "disk", "both", "tiny", "corrupt"]),
})

workloads = st.lists(st.tuples(
    st.integers(0, 3),                                   # which shared prefix
    st.integers(0, 40),                                  # its length
    st.lists(st.integers(0, 96), min_size=1, max_size=8),  # the request's own suffix
    st.integers(1, 8),                                   # max_tokens
    st.integers(0, 90),                                  # arrival tick
), min_size=3, max_size=12)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, work=workloads)
def test_shared_prefix_workloads_equal_solo_runs(cfg, work):
    """Requests over a few shared prefixes, in a pool small enough that cached blocks and
    snapshots are evicted (to the tier, when on) and come back: every output equals the
    one computed from scratch, and the books (pool, snapshots, tier index, tier files,
    budgets) balance after every tick and at the end."""
    bs, max_len = cfg["block_size"], 64
    tier_dir = pathlib.Path(tempfile.mkdtemp(prefix="prefix-tier-hyp-"))
    block_bytes = bs * 8
    host, disk = {"off": (0, 0), "host": (1 << 20, 0), "disk": (0, 1 << 20),
                  "both": (4 * block_bytes, 1 << 20), "corrupt": (0, 1 << 20),
                  "tiny": (2 * block_bytes, 3 * block_bytes)}[cfg["tier"]]
    tier = StateTier(host, disk, SpillStore(tier_dir, durable=False))
    num_blocks = {"tight": max_len // bs + 2, "small": 2 * max_len // bs,
                  "roomy": 4 * max_len // bs}[cfg["pool"]]
    core = make_core(num_blocks=num_blocks, block_size=bs, max_batch=4,
                     budget=max(cfg["budget"], 4), chunk=cfg["chunk"],
                     pipeline=cfg["pipeline"], swap=cfg["swap"], has_ssm=cfg["has_ssm"],
                     max_seq_len=max_len, prefix_tier=tier)
    prefixes = [[(p * 17 + 5 * i) % 90 + 3 for i in range(40)] for p in range(4)]
    requests = []
    for which, length, suffix, max_tokens, _ in work:
        prompt = (prefixes[which][:length] + suffix)[:max_len - 10]
        requests.append(make_request(prompt, max_tokens, max_len=max_len))
    arrivals = [w[4] for w in work]
    for tick in range(5000):
        for request, at in zip(requests, arrivals):
            if at == tick:
                core.inbox.submit(request)
        if tick > max(arrivals) and all(r.finished for r in requests):
            break
        core.tick()
        poison_free_slots(core)
        core.runner.kv[core.pool._free] = -7  # a free block's pages mean nothing
        if cfg["tier"] == "corrupt":
            for f in tier_dir.iterdir():
                if f.suffix != ".json":
                    f.write_bytes(b"\1" * f.stat().st_size)
    else:
        raise AssertionError("workload did not finish")
    core.drain()
    for request in requests:
        seq = request.sequences[0]
        assert seq.output_ids == reference_continuation(seq.prompt_ids, seq.params.max_tokens)
    assert_accounted(core)
    assert tier.host_used <= host and tier.disk_used <= disk
    stored = {f.name.split(".")[0] for f in tier_dir.iterdir()}
    assert len(stored) == len(tier._disk)  # no file beyond the tier's entries
    shutil.rmtree(tier_dir)
