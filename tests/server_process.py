"""`metrale serve` as a child process on loopback, for the process tests: start it, wait
until /health says ready (bounded), and read its health."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

MODEL = os.environ.get("METRALE_TEST_MODEL") or None
ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = os.environ.get("METRALE_TEST_JAX_CACHE", str(ROOT / ".jax_cache"))
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(base: str) -> tuple[int, dict] | None:
    """(HTTP status, body) of /health, or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)
    except (urllib.error.URLError, ConnectionError):
        return None


def start_server(args: list[str], log: pathlib.Path, env: dict | None = None) -> dict:
    """Start `metrale serve ARGS` and wait until it is ready. Returns {"base", "proc",
    "log", "seen"} (`seen`: the /health statuses seen while it started)."""
    port = free_port()
    cmd = [sys.executable, "-m", "metrale_jax.cli", "serve", "--port", str(port),
           "--compilation-cache", CACHE, *args]
    if MODEL:
        cmd += ["--model", MODEL]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    seen = set()
    while time.monotonic() < deadline:  # bounded: poll /health until ready
        state = health(base)
        if state is not None:
            seen.add(state[1]["status"])
            if state[0] == 200:
                return {"base": base, "proc": proc, "log": log, "seen": seen}
        try:
            proc.wait(timeout=0.1)  # doubles as the poll interval; returns if it died
            pytest.fail(f"metrale serve exited early:\n{log.read_text()}")
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    pytest.fail(f"metrale serve not ready in {START_TIMEOUT_S}s:\n{log.read_text()}")


def stop_server(server: dict) -> None:
    proc = server["proc"]
    if proc.poll() is None:
        proc.kill()
        proc.wait()
