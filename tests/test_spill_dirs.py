"""Private spill directories carry their process id; the next engine start removes those
whose process is gone (a `kill -9` used to leave them in the temp folder for good)."""

import os
import subprocess
import sys

from metrale_jax.cache.spill_dirs import PREFIX, make_private_dir, remove_stale_dirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_the_directories_of_dead_processes_go(tmp_path):
    mine = make_private_dir(str(tmp_path))
    dead = tmp_path / f"{PREFIX}{_dead_pid()}-abc"
    (dead / "seq-1").mkdir(parents=True)
    (dead / "seq-1" / "kv0_k.npy").write_bytes(b"x" * 10)
    unrelated = tmp_path / f"{PREFIX}notapid"
    unrelated.mkdir()
    assert remove_stale_dirs(str(tmp_path)) == [dead]
    assert not dead.exists() and os.path.isdir(mine) and unrelated.is_dir()
    assert os.path.basename(mine).startswith(f"{PREFIX}{os.getpid()}-")
