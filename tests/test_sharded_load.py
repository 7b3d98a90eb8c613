"""Checkpoints load straight onto their shards (tensor parallel): safetensors read part by
part from the memory-mapped files, orbax restored into the target shardings.

Run on 4 simulated CPU devices in a subprocess (tests/sharded_load_run.py: the device count
must be set before jax is imported, which this worker has already done), once for the
module: a tiny Llama and a tiny NemotronH (safetensors), the NemotronH as a metrale orbax
checkpoint and the built-in model, at tp=2 and tp=4, then `LLM(...)` at tp=2 against tp=1.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
LOADS = ["llama tp=2", "llama tp=4", "llama tp=2 bfloat16", "nemotronh tp=2",
         "nemotronh tp=4", "nemotronh tp=2 bfloat16", "nemotronh-orbax tp=2",
         "nemotronh-orbax tp=4", "nemotronh-orbax tp=2 bfloat16", "default tp=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.sharded_load_run",
                           str(tmp_path_factory.mktemp("sharded_load"))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in lines}


@pytest.mark.parametrize("case", LOADS)
def test_parameters_load_onto_their_shards(runs, case):
    """Every leaf equals the one-device load placed by `place_params` (cast the same), bit
    for bit; it sits on its sharding with each device holding its shard's shape, and
    `place_params` then keeps it as it is (no second copy)."""
    r = runs[case]
    assert r["differ"] == [] and r["wrong_sharding"] == [], r
    assert r["moved_by_place_params"] == 0, r
    assert r["split_leaves"] > 0, r


@pytest.mark.parametrize("case", [c for c in LOADS if "orbax" not in c and "default" not in c])
def test_safetensors_are_read_per_shard(runs, case):
    """Each split leaf's tensor is read as tp parts of a tp-th each (one per device), only
    replicated ones in one part whole; no tensor is read whole through `read`."""
    r = runs[case]
    assert r["read_split"] == r["split_leaves"], r
    assert r["read_split"] + r["read_whole"] == r["leaves"], r
    assert r["read_odd"] == [] and r["whole_reads"] == [], r


@pytest.mark.parametrize("case", [c for c in LOADS if "orbax" in c or "default" in c])
def test_orbax_puts_only_shards_on_devices(runs, case):
    """Orbax put on the devices exactly one shard of every leaf per device, nothing whole."""
    assert runs[case]["puts_are_shards"] is True, runs[case]


def test_tied_head_is_compared_per_shard(runs):
    r = runs["tied"]
    assert r["copy"] == "loaded", r
    assert "lm_head.weight differs from the input embedding" in r["differs"], r


def test_engine_loads_sharded_and_matches_one_device(runs):
    """`LLM(<tiny Llama dir>, tensor_parallel_size=2)`: the runner found every parameter on
    its shards already, and greedy decoding equals tp=1's."""
    r = runs["engine"]
    assert r["moved"] == [0], r
    assert r["tp2"] == r["tp1"] and len(r["tp1"]) == 6, r
