"""The prefix tier on real models (the built-in hybrid and a tiny Llama): prefix blocks and
SSM snapshots evicted from a small KV pool go to host RAM / disk and come back, through the
runner's real gather and scatter; greedy outputs equal those computed with no reuse at
all, with corrupt files read as misses."""

from __future__ import annotations

import pathlib

import pytest

from metrale_jax.engine import LLMEngine
from metrale_jax.request import SamplingParams
from tests.hf_models import save_tiny_llama
from tests.scheduler_harness import assert_accounted

ENGINE = dict(max_batch_size=2, max_tokens_per_tick=32, max_seq_len=64, seq_buckets=(2,),
              token_buckets=(16, 32), query_buckets=(1, 8, 32), block_buckets=(16,),
              max_logprobs=2, num_ssm_snapshots=4, block_size=4, num_kv_blocks=20,
              prefill_chunk_size=8, check_every_tick=True)
SHARED = list(range(200, 236))  # 9 blocks of 4
# A RAM level smaller than a prefix's run (a block is 2-4 KB here): small runs stay in RAM,
# the prefixes below go to disk, and files pushed out of RAM join them.
TIER = {"host_bytes": 8 << 10, "disk_bytes": 64 << 20}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-prefix-tier")
    save_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module", params=["default", "llama"])
def engine(request, llama_dir, tmp_path_factory):
    model = None if request.param == "default" else llama_dir
    spill = tmp_path_factory.mktemp(f"spill-{request.param}")
    built = LLMEngine(model, prefix_tier=TIER, spill_dir=str(spill), **ENGINE)
    yield built
    built.close()


def _generate(engine, prompt, max_tokens=6, reuse=True):
    engine.levers.set(prefix_cache_enabled=reuse)
    try:
        request = engine.make_request({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        engine.submit(request)
        while not request.finished:
            engine.step()
        engine.drain()
        return request.sequences[0].output_ids
    finally:
        engine.levers.set(prefix_cache_enabled=True)


def _evict_everything(engine):
    for seed in range(2):
        _generate(engine, [(37 * i + 101 * seed) % 1500 + 300 for i in range(56)], 2)


def test_an_evicted_prefix_is_restored_exactly(engine):
    offload = engine.core.memory.prefix_tier
    _generate(engine, SHARED + [7, 8, 9])
    _evict_everything(engine)
    assert offload.stats.blocks_stored >= 9
    restored = offload.stats.blocks_restored
    for tail in ([11, 12], [13, 14, 15, 16, 17]):
        prompt = SHARED + tail
        want = _generate(engine, prompt, reuse=False)
        assert _generate(engine, prompt) == want
    assert offload.stats.blocks_restored > restored
    assert offload.tier.stats.to_disk > 0
    if engine.runner.has_ssm:
        assert offload.stats.snapshots_restored + offload.stats.snapshots_stored >= 1
    assert_accounted(engine.core)


def test_corrupt_tier_files_are_misses(engine):
    offload = engine.core.memory.prefix_tier
    _generate(engine, SHARED[:20] + [5, 6])
    _evict_everything(engine)
    directory = pathlib.Path(engine.engine_config.spill_dir) / "prefix-tier"
    files = [f for f in directory.iterdir() if f.suffix == ".bin"]
    assert files
    for f in files:
        f.write_bytes(b"\1" * f.stat().st_size)
    misses = offload.stats.misses
    prompt = SHARED[:20] + [21, 22, 23]
    assert _generate(engine, prompt) == _generate(engine, prompt, reuse=False)
    assert offload.stats.misses > misses
    assert_accounted(engine.core)
