"""The spill store: a swapped-out sequence's KV pages and SSM state as files on disk.

Host only (no jax). One spilled sequence is one *file set* in the spill directory:

    <key>.<token>.<name>.bin   raw bytes of each array, C order
    <key>.json                 the manifest: meta, and each array's file, shape, dtype, checksum

The manifest is written last, with an atomic `os.replace`; it is what makes a file set valid.
A crash before it lands leaves only data files that `keys()` does not list and `remove` or the
next `SpillStore` sweeps away. Raw bytes (not pickle, not `np.save`) keep bfloat16 and other
ml_dtypes arrays exact, and let `read` fill a preallocated array chunk by chunk while hashing.
Every failure on write is a `SpillWriteError`; anything wrong on read is a `SpillCorrupt`;
both name the key, so the scheduler can log it and keep the sequence (DESIGN.md, tick phase 7).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

_FORMAT = 1


def _dtype(name: str) -> np.dtype:
    # ml_dtypes registers bfloat16 & co. with numpy; imported only when a spill is read back,
    # since it costs seconds at import and the host-only tests never need it otherwise.
    import ml_dtypes  # noqa: F401

    return np.dtype(name)

_CHUNK = 8 << 20  # bytes hashed and copied per read/write call: bounds extra host memory
# Keys have no dots, so `<key>.*` matches exactly one key's files.
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_NAME_RE = re.compile(r"[A-Za-z0-9_]{1,64}")


class SpillError(Exception):
    """Base of every spill failure; the scheduler catches this one."""


class SpillWriteError(SpillError):
    """A file set could not be written (disk full, permissions, ...); nothing was left."""


class SpillCorrupt(SpillError):
    """A file set is missing, truncated or does not match its manifest."""


@dataclasses.dataclass(frozen=True)
class SpillHandle:
    key: str
    directory: Path
    manifest: Path               # <key>.json
    files: tuple[Path, ...]      # one data file per array, in manifest order
    nbytes: int                  # array bytes written (manifest excluded)


class SpillBackend(Protocol):
    """What the scheduler needs of a spill store; tests inject fakes."""

    def write(self, key: str, arrays: Mapping[str, np.ndarray], meta: Mapping) -> SpillHandle: ...
    def read(self, handle: SpillHandle) -> tuple[dict[str, np.ndarray], dict]: ...
    def remove(self, handle: SpillHandle) -> None: ...
    def keys(self) -> list[str]: ...


class SpillStore:
    """Spill file sets in one directory, owned by one engine."""

    def __init__(self, directory: Path, durable: bool = True):
        self.directory = Path(directory)
        # False: no fsync. For stores nothing reads after this process (the state tiers,
        # caches of what can be recomputed): atomic renames and checksums still hold, a
        # power loss only loses the cache.
        self.durable = durable
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sweep_orphans()

    # -- write ---------------------------------------------------------------------------

    def write(self, key: str, arrays: Mapping[str, np.ndarray], meta: Mapping) -> SpillHandle:
        """Write a file set; on any failure remove what this call wrote and raise."""
        _check_names(key, arrays)
        meta = json.loads(json.dumps(dict(meta)))  # fails early, before any file, if not JSON
        old = self._data_files_of(key)  # a rewrite replaces an earlier set of the same key
        token = uuid.uuid4().hex[:12]
        written: list[Path] = []
        try:
            entries = [self._write_array(key, token, name, np.asarray(a), written)
                       for name, a in arrays.items()]
            manifest = {"format": _FORMAT, "key": key, "meta": meta, "arrays": entries}
            self._write_atomic(self._manifest(key), json.dumps(manifest).encode(), written)
            if self.durable:
                _fsync_dir(self.directory)
        except OSError as e:
            self._unlink_all(written)
            raise SpillWriteError(f"spill {key!r}: could not write to {self.directory}: {e}") from e
        except BaseException:
            self._unlink_all(written)
            raise
        new_files = {entry["file"] for entry in entries}
        self._unlink_all([p for p in old if p.name not in new_files])
        return self._handle(key, entries)

    def _write_array(self, key: str, token: str, name: str, a: np.ndarray,
                     written: list[Path]) -> dict[str, Any]:
        """Write one array's bytes (hashed on the way) and describe it for the manifest."""
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        digest = hashlib.blake2b(digest_size=32)
        final = self.directory / f"{key}.{token}.{name}.bin"
        tmp = final.with_suffix(".tmp")
        written.append(tmp)
        with open(tmp, "wb") as f:
            for start in range(0, raw.size, _CHUNK):
                chunk = memoryview(raw[start:start + _CHUNK])
                digest.update(chunk)
                f.write(chunk)
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
        written.append(final)
        os.replace(tmp, final)
        return {"name": name, "file": final.name, "shape": list(a.shape), "dtype": str(a.dtype),
                "nbytes": int(raw.size), "blake2b": digest.hexdigest()}

    def _write_atomic(self, path: Path, data: bytes, written: list[Path]) -> None:
        tmp = path.with_name(path.name + f".{uuid.uuid4().hex[:8]}.tmp")
        written.append(tmp)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)  # the manifest is not in `written`: once it lands, we succeeded

    # -- read ----------------------------------------------------------------------------

    def read(self, handle: SpillHandle) -> tuple[dict[str, np.ndarray], dict]:
        """Read and verify every array of a file set; raise SpillCorrupt on any mismatch."""
        key = handle.key
        manifest = self._load_manifest(key)
        try:
            arrays = {e["name"]: self._read_array(key, e) for e in manifest["arrays"]}
            meta = manifest["meta"]
        except (KeyError, TypeError, ValueError) as e:
            raise SpillCorrupt(f"spill {key!r}: malformed manifest: {e!r}") from e
        return arrays, meta

    def _load_manifest(self, key: str) -> dict:
        try:
            manifest = json.loads(self._manifest(key).read_bytes())
        except FileNotFoundError as e:
            raise SpillCorrupt(f"spill {key!r}: manifest {self._manifest(key)} is missing") from e
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise SpillCorrupt(f"spill {key!r}: manifest is unreadable: {e}") from e
        if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT \
                or manifest.get("key") != key or not isinstance(manifest.get("arrays"), list):
            raise SpillCorrupt(f"spill {key!r}: manifest has the wrong format, key or arrays")
        return manifest

    def _read_array(self, key: str, entry: Mapping[str, Any]) -> np.ndarray:
        name, path = entry["name"], self.directory / entry["file"]
        out = np.empty(tuple(entry["shape"]), _dtype(entry["dtype"]))
        if out.nbytes != entry["nbytes"]:
            raise SpillCorrupt(f"spill {key!r}: array {name!r}: shape {entry['shape']} and dtype "
                               f"{entry['dtype']} make {out.nbytes} bytes, manifest says "
                               f"{entry['nbytes']}")
        try:
            size = path.stat().st_size
            if size != out.nbytes:
                raise SpillCorrupt(f"spill {key!r}: array {name!r}: file {path.name} has {size} "
                                   f"bytes, expected {out.nbytes} (truncated?)")
            digest = _read_into(path, out.reshape(-1).view(np.uint8))
        except FileNotFoundError as e:
            raise SpillCorrupt(f"spill {key!r}: array {name!r}: file {path.name} is missing") from e
        except OSError as e:
            raise SpillCorrupt(
                f"spill {key!r}: array {name!r}: cannot read {path.name}: {e}") from e
        if digest != entry["blake2b"]:
            raise SpillCorrupt(f"spill {key!r}: array {name!r}: checksum mismatch in {path.name}")
        return out

    # -- bookkeeping ---------------------------------------------------------------------

    def remove(self, handle: SpillHandle) -> None:
        """Delete the file set, manifest first so a half-removed set never looks valid."""
        self._unlink_all([self._manifest(handle.key)])
        self._unlink_all(self._data_files_of(handle.key))

    def keys(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.json") if _KEY_RE.fullmatch(p.stem))

    def bytes_used(self) -> int:
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file())

    def _manifest(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _data_files_of(self, key: str) -> list[Path]:
        return [p for p in self.directory.glob(f"{key}.*") if p.name != f"{key}.json"]

    def _handle(self, key: str, entries: list[dict[str, Any]]) -> SpillHandle:
        return SpillHandle(key=key, directory=self.directory, manifest=self._manifest(key),
                           files=tuple(self.directory / e["file"] for e in entries),
                           nbytes=sum(e["nbytes"] for e in entries))

    def _sweep_orphans(self) -> None:
        """Remove temp files and data files no manifest claims (left by a crash)."""
        claimed: set[str] = set()
        for key in self.keys():
            try:
                claimed.update(e["file"] for e in self._load_manifest(key)["arrays"])
            except (SpillCorrupt, KeyError, TypeError):
                claimed.update(p.name for p in self._data_files_of(key))  # keep for diagnosis
        self._unlink_all([p for p in self.directory.iterdir() if p.is_file()
                          and not p.name.endswith(".json") and p.name not in claimed])

    @staticmethod
    def _unlink_all(paths: list[Path]) -> None:
        for p in paths:
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass  # best effort: cleanup must not mask the error being reported


def _check_names(key: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Keys and array names become file names: keep them to a safe alphabet."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"spill key {key!r} must match {_KEY_RE.pattern} (it names files)")
    for name in arrays:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"spill {key!r}: array name {name!r} must match {_NAME_RE.pattern}")


def _read_into(path: Path, out: np.ndarray) -> str:
    """Fill the uint8 view `out` from `path` chunk by chunk; return the blake2b hex digest."""
    digest = hashlib.blake2b(digest_size=32)
    view = memoryview(out)
    with open(path, "rb") as f:
        for start in range(0, out.size, _CHUNK):
            chunk = view[start:start + _CHUNK]
            got = f.readinto(chunk)
            if got != len(chunk):
                raise OSError(f"short read: {got} of {len(chunk)} bytes")
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable; some filesystems refuse fsync on a directory, which is fine."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
