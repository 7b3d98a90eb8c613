"""The spill store (host, no jax) and swap gather/scatter (device): round trips, atomic
writes, corruption and write errors reported by key, and a full swap-out/swap-in cycle."""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from metrale_jax.cache import spill
from metrale_jax.cache.spill import (SpillBackend, SpillCorrupt, SpillHandle, SpillStore,
                                     SpillWriteError)
from metrale_jax.config import ModelConfig
from metrale_jax.model.caches import DeviceCaches, allocate_caches
from metrale_jax.runner import swap
from metrale_jax.runner.swap import gather_sequence, scatter_sequence

CFG = ModelConfig(vocab_size=64, hidden_size=32, layer_pattern="MAF", num_heads=2,
                  num_kv_heads=1, head_dim=8, intermediate_size=32, ssm_state_size=4,
                  mamba_num_heads=2, mamba_head_dim=8)
NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS = 16, 4, 4


class FailingSpillStore:
    """A spill backend whose every write fails, as a full disk would."""

    def __init__(self, reason: str = "disk full"):
        self.reason = reason
        self.attempts: list[str] = []

    def write(self, key: str, arrays: Mapping[str, np.ndarray], meta: Mapping) -> SpillHandle:
        self.attempts.append(key)
        raise SpillWriteError(f"spill {key!r}: {self.reason}")

    def read(self, handle: SpillHandle) -> tuple[dict[str, np.ndarray], dict]:
        raise SpillCorrupt(f"spill {handle.key!r}: never written")

    def remove(self, handle: SpillHandle) -> None:
        pass

    def keys(self) -> list[str]:
        return []


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "f32": rng.standard_normal((3, 4, 5)).astype(np.float32),
        "i32": rng.integers(-2**31, 2**31 - 1, (7,), dtype=np.int32),
        "bf16": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((4,)).astype(np.float16),
        "mask": rng.random((5,)) > 0.5,
        "scalar": np.array(3.5, np.float64),
        "empty": np.zeros((0, 8), np.float32),
        "strided": rng.standard_normal((6, 6)).astype(np.float32)[::2, ::3],
    }


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@pytest.fixture
def store(tmp_path: Path) -> SpillStore:
    return SpillStore(tmp_path / "spill")


# -- the store -------------------------------------------------------------------------------

def test_round_trip_keeps_values_dtypes_and_meta(store: SpillStore) -> None:
    arrays = _arrays()
    meta = {"request_id": "r1", "num_tokens": 13, "blocks": [3, 5], "nested": {"x": 1.5}}
    handle = store.write("seq-1", arrays, meta)
    got, got_meta = store.read(handle)
    assert got_meta == meta
    assert got.keys() == arrays.keys()
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        assert got[name].tobytes() == a.tobytes(), name
    assert handle.nbytes == sum(a.nbytes for a in arrays.values())
    assert store.keys() == ["seq-1"]
    assert store.bytes_used() > handle.nbytes


def test_rewrite_replaces_the_old_set(store: SpillStore) -> None:
    store.write("k", {"a": np.ones(4, np.float32)}, {"v": 1})
    handle = store.write("k", {"a": np.zeros(2, np.int32)}, {"v": 2})
    arrays, meta = store.read(handle)
    assert meta == {"v": 2} and arrays["a"].dtype == np.int32
    assert _files(store.directory) == sorted(["k.json", handle.files[0].name])


def test_remove_is_idempotent(store: SpillStore) -> None:
    handle = store.write("k", _arrays(), {})
    other = store.write("k2", _arrays(1), {})
    store.remove(handle)
    store.remove(handle)
    assert store.keys() == ["k2"]
    assert all(name.startswith("k2.") for name in _files(store.directory))
    store.read(other)


def test_bad_key_and_name_are_rejected(store: SpillStore) -> None:
    with pytest.raises(ValueError, match="spill key"):
        store.write("../escape", {}, {})
    with pytest.raises(ValueError, match="array name"):
        store.write("k", {"a.b": np.zeros(1)}, {})
    assert _files(store.directory) == []


def test_failure_mid_write_leaves_nothing(store: SpillStore, monkeypatch) -> None:
    real = SpillStore._write_array
    calls = []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("crash in the middle")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SpillStore, "_write_array", flaky)
    with pytest.raises(RuntimeError, match="crash"):
        store.write("k", _arrays(), {})
    assert store.keys() == [] and _files(store.directory) == []


def test_failed_manifest_replace_leaves_nothing(store: SpillStore, monkeypatch) -> None:
    real = spill.os.replace

    def replace(src, dst):
        if str(dst).endswith(".json"):
            raise OSError(errno.EIO, "I/O error")
        return real(src, dst)

    monkeypatch.setattr(spill.os, "replace", replace)
    with pytest.raises(SpillWriteError, match="'k'.*I/O error"):
        store.write("k", _arrays(), {})
    assert store.keys() == [] and _files(store.directory) == []


def test_failed_rewrite_keeps_the_old_set(store: SpillStore, monkeypatch) -> None:
    handle = store.write("k", {"a": np.arange(4)}, {"v": 1})
    before = _files(store.directory)
    monkeypatch.setattr(spill.os, "fsync", _raise_enospc)
    with pytest.raises(SpillWriteError):
        store.write("k", {"a": np.arange(8)}, {"v": 2})
    assert _files(store.directory) == before
    arrays, meta = store.read(handle)
    assert meta == {"v": 1}
    np.testing.assert_array_equal(arrays["a"], np.arange(4))


def _raise_enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_is_a_write_error_naming_the_key(store: SpillStore, monkeypatch) -> None:
    real_open = open

    class FullFile:
        def __init__(self, f):
            self.f, self.written = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.written += len(memoryview(data))
            if self.written > 16:
                _raise_enospc()
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(spill, "open", lambda *a, **k: FullFile(real_open(*a, **k)),
                        raising=False)
    with pytest.raises(SpillWriteError, match="'seq-9'.*No space left") as info:
        store.write("seq-9", _arrays(), {})
    assert isinstance(info.value, spill.SpillError)
    assert _files(store.directory) == []


def test_vanished_directory_is_a_write_error(store: SpillStore) -> None:
    shutil.rmtree(store.directory)
    with pytest.raises(SpillWriteError, match="'k'"):
        store.write("k", _arrays(), {})
    assert not store.directory.exists()


def test_non_json_meta_fails_before_any_file(store: SpillStore) -> None:
    with pytest.raises(TypeError):
        store.write("k", _arrays(), {"bad": object()})
    assert _files(store.directory) == []


def _flip_byte(handle: SpillHandle) -> None:
    path = handle.files[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(handle: SpillHandle) -> None:
    path = handle.files[0]
    path.write_bytes(path.read_bytes()[:-3])


def _edit_manifest(edit):
    def corrupt(handle: SpillHandle) -> None:
        manifest = json.loads(handle.manifest.read_text())
        edit(manifest)
        handle.manifest.write_text(json.dumps(manifest))
    return corrupt


CORRUPTIONS = {
    "flipped byte": (_flip_byte, "checksum mismatch"),
    "truncated": (_truncate, "truncated"),
    "data file deleted": (lambda h: h.files[0].unlink(), "missing"),
    "manifest deleted": (lambda h: h.manifest.unlink(), "manifest .* missing"),
    "manifest not json": (lambda h: h.manifest.write_text("{not json"), "unreadable"),
    "manifest cut short": (lambda h: h.manifest.write_bytes(h.manifest.read_bytes()[:20]),
                           "unreadable"),
    "manifest wrong shape": (_edit_manifest(lambda m: m["arrays"][0].update(shape=[7])),
                             "bytes"),
    "manifest bad dtype": (_edit_manifest(lambda m: m["arrays"][0].update(dtype="nope")),
                           "malformed"),
    "manifest other key": (_edit_manifest(lambda m: m.update(key="other")), "wrong format"),
    "manifest no arrays": (_edit_manifest(lambda m: m.pop("arrays")), "wrong format"),
}


@pytest.mark.parametrize("what", CORRUPTIONS)
def test_corruption_is_reported_by_key(store: SpillStore, what: str) -> None:
    corrupt, message = CORRUPTIONS[what]
    handle = store.write("seq-7", {"a": np.arange(12, dtype=np.float32).reshape(3, 4)}, {})
    corrupt(handle)
    with pytest.raises(SpillCorrupt, match=f"'seq-7'.*{message}"):
        store.read(handle)


def test_new_store_sweeps_orphans_of_a_crash(store: SpillStore) -> None:
    handle = store.write("kept", {"a": np.arange(3)}, {})
    (store.directory / "lost.abc.a.tmp").write_bytes(b"half")
    (store.directory / "lost.abc.a.bin").write_bytes(b"whole but unclaimed")
    reopened = SpillStore(store.directory)
    assert _files(reopened.directory) == sorted(["kept.json", handle.files[0].name])
    assert reopened.keys() == ["kept"]


def test_failing_fake_satisfies_the_protocol() -> None:
    fake: SpillBackend = FailingSpillStore()
    real: SpillBackend = SpillStore  # type: ignore[assignment]  # both follow the protocol
    assert all(callable(getattr(real, m)) for m in ("write", "read", "remove", "keys"))
    with pytest.raises(SpillWriteError, match="'s'.*disk full"):
        fake.write("s", {}, {})
    assert fake.keys() == []


# -- swap: device <-> host ---------------------------------------------------------------------

def _random_caches(cfg: ModelConfig, seed: int) -> DeviceCaches:
    caches = allocate_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: jax.numpy.asarray(rng.standard_normal(a.shape).astype(a.dtype)), caches)


def _host(caches: DeviceCaches) -> DeviceCaches:
    return jax.tree.map(np.asarray, jax.device_get(caches))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swap_out_and_in_to_other_blocks_and_slot(store: SpillStore, dtype: str) -> None:
    cfg = dataclasses.replace(CFG, dtype=dtype)
    src_blocks, src_slot = [3, 5, 7, 11, 2], 2
    dst_blocks, dst_slot = [9, 1, 14, 6, 12], 3
    source = _random_caches(cfg, seed=1)
    before = _host(source)

    handle = store.write("seq", gather_sequence(source, src_blocks, src_slot), {"len": 17})
    arrays, meta = store.read(handle)
    target = _random_caches(cfg, seed=2)
    untouched = _host(target)
    after = _host(scatter_sequence(target, arrays, dst_blocks, dst_slot))

    assert meta == {"len": 17}
    for (k0, v0), (k1, v1), (k2, v2) in zip(before.kv, after.kv, untouched.kv):
        np.testing.assert_array_equal(k1[dst_blocks], k0[src_blocks])
        np.testing.assert_array_equal(v1[dst_blocks], v0[src_blocks])
        others = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
        np.testing.assert_array_equal(k1[others], k2[others])
        np.testing.assert_array_equal(v1[others], v2[others])
    for name in ("conv", "ssm"):
        layers = zip(getattr(before, name), getattr(after, name), getattr(untouched, name))
        for x0, x1, x2 in layers:
            np.testing.assert_array_equal(x1[dst_slot], x0[src_slot])
            others = [s for s in range(NUM_SLOTS) if s != dst_slot]
            np.testing.assert_array_equal(x1[others], x2[others])


def test_without_a_slot_only_kv_moves() -> None:
    source, target = _random_caches(CFG, 1), _random_caches(CFG, 2)
    arrays = gather_sequence(source, [4], None)
    assert sorted(arrays) == ["kv0_k", "kv0_v"]
    untouched = _host(target)
    after = _host(scatter_sequence(target, arrays, [8], None))
    np.testing.assert_array_equal(after.kv[0][0][8], _host(source).kv[0][0][4])
    np.testing.assert_array_equal(after.conv[0], untouched.conv[0])
    np.testing.assert_array_equal(after.ssm[0], untouched.ssm[0])


def test_scatter_donates_the_caches() -> None:
    caches = _random_caches(CFG, 1)
    arrays = gather_sequence(caches, [2, 3], 1)
    scatter_sequence(caches, arrays, [4, 5], 2)
    assert caches.kv[0][0].is_deleted()


def test_block_counts_share_a_compiled_bucket() -> None:
    caches = _random_caches(CFG, 1)
    gather_sequence(caches, [1, 2, 3, 4, 5], 1)
    compiled = swap._gather._cache_size()
    for n in (6, 7, 8):
        gather_sequence(caches, list(range(1, n + 1)), 1)
    assert swap._gather._cache_size() == compiled


@pytest.mark.parametrize("bad, message", [
    ({"kv0_k": np.zeros((2, BLOCK_SIZE, 1, 9), np.float32)}, "'kv0_k'.*need"),
    ({"ssm0": np.zeros((2, 8, 4), np.float16)}, "'ssm0'.*float16"),
    ({"conv0": None}, r"missing \['conv0'\]"),
    ({"extra": np.zeros(1)}, r"unexpected \['extra'\]"),
])
def test_scatter_rejects_mismatched_arrays(bad, message) -> None:
    caches = _random_caches(CFG, 1)
    arrays = {**gather_sequence(caches, [2, 3], 1), **bad}
    arrays = {k: v for k, v in arrays.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        scatter_sequence(caches, arrays, [4, 5], 2)
    assert not caches.kv[0][0].is_deleted()  # validation happens before donation


@pytest.mark.parametrize("blocks, slot, message", [
    ([0, 4], 1, "null block"), ([4, 99], 1, "outside"), ([4, 4], 1, "repeats"),
    ([4, 5], 0, "null slot"), ([4, 5], NUM_SLOTS, "slot"),
])
def test_scatter_rejects_bad_targets(blocks, slot, message) -> None:
    caches = _random_caches(CFG, 1)
    arrays = gather_sequence(caches, [2, 3], 1)
    with pytest.raises(ValueError, match=message):
        scatter_sequence(caches, arrays, blocks, slot)
