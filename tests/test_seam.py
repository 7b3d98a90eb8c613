"""The seam between host and device, and between the server and the engine, holds."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from tests.scheduler_harness import make_core, make_request

ROOT = pathlib.Path(__file__).parent.parent


def test_host_side_imports_no_jax():
    code = ("import sys, metrale_jax.scheduler.core, metrale_jax.sequence, metrale_jax.types, "
            "metrale_jax.request, metrale_jax.outputs, tests.fake_runner; "
            "print('jax' in sys.modules, 'flax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_scheduler_parts_do_not_import_the_core():
    parts = [p for p in (ROOT / "metrale_jax" / "scheduler").glob("*.py") if p.name != "core.py"]
    for part in parts:
        assert "SchedulerCore" not in part.read_text().split('"""', 2)[-1], part.name


def test_server_goes_through_async_llm_only():
    pattern = re.compile(r"llm\.engine\b|\.core\.")
    for path in (ROOT / "server").glob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.name}:{n}: {line.strip()}"


def test_idle_loop_publishes_a_current_snapshot_before_it_waits():
    core = make_core()
    request = make_request(list(range(1, 12)), 3)
    core.inbox.submit(request)
    seen, recv = [], core.inbox.recv

    def recv_and_close(wait=False, timeout=None):
        if wait:  # the loop is about to block: what would /metrics read now?
            seen.append(core.tel.snapshot)
            core.inbox.close()
        return recv(wait=wait, timeout=timeout)

    core.inbox.recv = recv_and_close
    core.run(wait=0)
    assert request.finished and seen
    snap = seen[0]
    assert snap.running_seqs == 0 and snap.requests_len == 0 and snap.kv_blocks_used == 0
    assert snap.waiting_len == 0 and snap.swapped_seqs == 0
