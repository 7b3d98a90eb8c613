"""Tensor and data parallel: the config's checks here, and tp=2 / tp=4 / dp=2 against one
device on simulated CPU devices in a subprocess (tests/tp_equivalence.py: the device count
must be set before jax is imported, which this worker has already done)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from metrale_jax.config import EngineConfig, ModelConfig
from metrale_jax.parallel.config import ParallelConfig, ParallelConfigError

ROOT = pathlib.Path(__file__).parent.parent
# Tolerance of log-probabilities (log-softmax of the logits) against one device: the shards'
# partial sums are added in another order.
LOGPROB_TOL = 1e-4


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size"):
        ParallelConfig(0)
    with pytest.raises(ParallelConfigError, match="data_parallel_size"):
        ParallelConfig(1, 0)
    assert EngineConfig().parallel.tp == 1 and ParallelConfig(2, 3).num_devices == 6


def test_heads_must_split_evenly():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, layer_pattern="AFM", num_heads=6,
                      num_kv_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=8)
    with pytest.raises(ParallelConfigError, match="num_heads=6"):
        ParallelConfig(4).check_model(cfg)
    with pytest.raises(ParallelConfigError, match="mamba_num_heads=4"):
        ParallelConfig(3).check_model(cfg.replace(num_heads=6, num_kv_heads=3))
    with pytest.raises(ParallelConfigError, match="num_kv_heads=3"):
        ParallelConfig(2).check_model(cfg.replace(num_heads=6, num_kv_heads=3))
    ParallelConfig(2).check_model(cfg)  # KV heads 2 split, Mamba2 group 1 widened
    assert ParallelConfig(4).stored_kv_heads(1) == 4
    assert ParallelConfig(2).kv_heads_per_device(4) == 2


def test_more_devices_than_there_are_is_refused():
    import jax

    from metrale_jax.parallel.placement import device_groups, make_tp_mesh

    with pytest.raises(ParallelConfigError, match="xla_force_host_platform_device_count=8"):
        make_tp_mesh(8, jax.devices()[:1])
    with pytest.raises(ParallelConfigError, match="data_parallel_size x tensor_parallel_size"):
        device_groups(ParallelConfig(2, 2), jax.devices()[:1])
    assert device_groups(ParallelConfig(1, 1), jax.devices()[:1]) == [jax.devices()[:1]]


def test_parameter_specs_follow_megatron():
    from jax.sharding import PartitionSpec as P

    from metrale_jax.parallel.specs import param_spec

    cfg = ModelConfig(vocab_size=64, hidden_size=32, layer_pattern="AFM", num_heads=4,
                      num_kv_heads=1, head_dim=8, mamba_num_heads=4, mamba_head_dim=8)
    spec = lambda path, shape: param_spec(tuple(path.split(".")), shape, cfg, 2)  # noqa: E731
    assert spec("blocks.0.mixer.q_proj.kernel", (32, 32)) == P(None, "tp")
    assert spec("blocks.0.mixer.k_proj.kernel", (32, 8)) == P()  # 1 KV head: replicated
    assert spec("blocks.0.mixer.o_proj.kernel", (32, 32)) == P("tp", None)
    assert spec("blocks.1.mixer.down_proj.kernel", (64, 32)) == P("tp", None)
    assert spec("blocks.2.mixer.a_log", (4,)) == P("tp")
    assert spec("blocks.2.mixer.norm.scale", (32,)) == P("tp")
    assert spec("blocks.2.mixer.conv_weight", (4, 48)) == P()
    assert spec("blocks.2.norm.scale", (32,)) == P()
    assert spec("embed.embedding", (64, 32)) == P("tp", None)
    assert spec("embed.embedding", (63, 32)) == P()  # an odd vocabulary is replicated


@pytest.fixture(scope="module")
def tp_runs() -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.tp_equivalence"], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _close(a: list, b: list) -> bool:
    """Same token ids at every position, log-probabilities within the tolerance."""
    return len(a) == len(b) and all(
        [t for t, _ in x] == [t for t, _ in y]
        and all(abs(p - q) <= LOGPROB_TOL for (_, p), (_, q) in zip(x, y))
        for x, y in zip(a, b))


def test_tensor_parallel_equals_one_device(tp_runs):
    """tp=2 and tp=4 (the built-in model: tp=2, its 6 heads; the NemotronH shape: tp=4,
    see tests/tp_equivalence.py) give the greedy outputs
    and log-probabilities of tp=1, through spills and resumes, prefix-cache hits and the
    async pipeline; after warm-up, a sharded engine compiles nothing while serving."""
    single = {r["model"]: r for r in tp_runs if r.get("tp") == 1}
    sharded = [r for r in tp_runs if r.get("tp", 1) > 1]
    assert set(single) == {"llama", "nemotronh", "default"}
    assert {(r["model"], r["tp"]) for r in sharded} == {
        ("llama", 2), ("llama", 4), ("nemotronh", 4), ("default", 2)}
    for r in sharded:
        one = single[r["model"]]
        where = f'{r["model"]} tp={r["tp"]}'
        assert r["outputs"] == one["outputs"], where
        assert r["scored"] == one["scored"], where
        assert _close(r["logprobs"], one["logprobs"]), where
        assert _close(r["prompt_logprobs"], one["prompt_logprobs"]), where
        assert r["spills"] > 0 and r["swap_ins"] > 0, where
        assert r["prefix_hit_tokens"] > 0, where
        assert r["compiled_while_serving"] == [], where


def test_kernels_run_per_shard(tp_runs):
    """The paged attention (CPU FFI kernel and Pallas) and the SSM kernels under shard_map,
    with the KV head and B/C group widened, equal the ops on one device."""
    diffs = next(r["ops"] for r in tp_runs if "ops" in r)
    assert {k.split()[0] for k in diffs} >= {"pallas-interpret"}
    assert max(diffs.values()) <= 1e-5, diffs


def test_data_parallel_equals_one_engine(tp_runs):
    """dp=2 (two engines on devices 0 and 1 behind the prefix-affinity router): every
    request of a mixed batch finishes with one engine's output; the shared-prefix prompts
    all went to one engine, the other prompt to the other."""
    one = next(r for r in tp_runs if r.get("model") == "llama" and r["tp"] == 1)
    dp = next(r for r in tp_runs if r.get("dp") == 2)
    assert dp["outputs"] == [one["scored"]] + one["outputs"]
    assert dp["engines"] == [0, 1, 1, 1, 1]


def test_tp_that_does_not_divide_the_heads_is_refused(tp_runs):
    refused = [r["refused"] for r in tp_runs if "refused" in r]
    assert refused and "num_heads=6" in refused[0]
