"""Fault injection for the reliability tests: through the runner and the spill backend,
never through hooks in the engine's own code, and never by sleeping."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from metrale_jax.cache.spill import SpillHandle, SpillStore


class InjectedFault(RuntimeError):
    """What the faulty runner raises (a device or runtime error, as far as the engine knows)."""


class FaultyRunner:
    """Wraps a runner (the real one or the fake) and raises on chosen dispatches and
    collects, counted from 1 over the runner's life. With `lose_caches`, the failure takes
    the device caches with it, as a step that consumed its donated buffers would."""

    def __init__(self, inner):
        self.inner = inner
        self.dispatches = self.collects = 0
        self.fail_dispatch: set[int] = set()
        self.fail_collect: set[int] = set()
        self.always = False
        self.lose_caches = False
        self.fired = 0                     # failures raised so far
        self._fake_lost = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def arm(self, *, dispatch: int | None = None, collect: int | None = None,
            lose_caches: bool = False) -> None:
        """Fail the `dispatch`-th dispatch / `collect`-th collect from now (1: the next)."""
        if dispatch is not None:
            self.fail_dispatch.add(self.dispatches + dispatch)
        if collect is not None:
            self.fail_collect.add(self.collects + collect)
        self.lose_caches = lose_caches

    def disarm(self) -> None:
        self.fail_dispatch.clear()
        self.fail_collect.clear()
        self.always = self.lose_caches = False

    def dispatch(self, rows):
        self.dispatches += 1
        if self.always or self.dispatches in self.fail_dispatch:
            self._fail(f"injected fault at dispatch {self.dispatches}")
        return self.inner.dispatch(rows)

    def collect(self, handle):
        self.collects += 1
        results = self.inner.collect(handle)  # the device finished; the host fails after
        if self.collects in self.fail_collect:
            self._fail(f"injected fault at collect {self.collects}")
        return results

    def recover(self) -> bool:
        if self._fake_lost:  # the fake's "device" arrays come back empty, as re-allocated
            self._fake_lost = False
            self.inner.kv.fill(-1)
            self.inner.ssm.fill(0)
            self.inner.future.fill(0)
            return True
        return self.inner.recover()

    def _fail(self, message: str) -> None:
        self.fired += 1
        if self.lose_caches:
            self._lose()
        raise InjectedFault(message)

    def _lose(self) -> None:
        if hasattr(self.inner, "caches"):  # the real runner: the donated buffers are gone
            import jax

            for leaf in jax.tree.leaves((self.inner.caches, self.inner.tables)):
                leaf.delete()
        else:  # the fake: garbage where the state was, until recover() re-allocates
            self.inner.kv.fill(-7)
            self.inner.ssm.fill(12345)
            self._fake_lost = True


def install(core, runner) -> None:
    """Put a runner wrapper where the scheduler reaches its runner."""
    core.runner = runner
    core.parking.runner = runner


class FaultySpill(SpillStore):
    """A real spill store whose disk misbehaves on demand (`mode`):
      enospc    every data-file write fails with ENOSPC (the store wraps it: SpillWriteError)
      eio       `write` itself raises a bare OSError (a backend that does not wrap it)
      corrupt   writes succeed, then one byte of a data file flips
      truncate  writes succeed, then a data file loses its second half
    `writes` and `reads` count the calls."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self.mode: str | None = None
        self.writes = self.reads = 0

    def write(self, key: str, arrays: Mapping[str, np.ndarray], meta: Mapping) -> SpillHandle:
        self.writes += 1
        if self.mode == "eio":
            raise OSError(errno.EIO, "input/output error (injected)")
        handle = super().write(key, arrays, meta)
        if self.mode in ("corrupt", "truncate"):
            _damage(handle.files[0], self.mode)
        return handle

    def read(self, handle: SpillHandle):
        self.reads += 1
        return super().read(handle)

    def _write_array(self, key, token, name, a, written):
        if self.mode == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super()._write_array(key, token, name, a, written)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[len(data) // 2] ^= 0x5A
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
