"""A server under test, in its own process: started, waited for, stopped.

The serving benchmark loads a server over loopback exactly as a user's client would, so our
own server runs as `metrale serve` in a child process, the way llama-server runs for the peer.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: pathlib.Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """Runs `command`, waits until GET {base_url}{health} answers 200; a context manager."""

    def __init__(self, name: str, command: list[str], base_url: str, *,
                 health: str = "/health", startup_timeout_s: float = 900.0,
                 log_path: str | pathlib.Path | None = None, env: dict | None = None,
                 settle: bool = False):
        """`settle`: `start` also waits until the server compiles nothing beside serving
        (`metrale serve`'s `/health` counts `compiling_variants`), so no measurement
        shares the cores with a compiler or runs padded shapes."""
        self.name, self.command, self.base_url = name, command, base_url
        self.health, self.startup_timeout_s = health, startup_timeout_s
        self.settle = settle
        self.log_path = pathlib.Path(log_path) if log_path else pathlib.Path(
            tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None  # time.monotonic() at exec
        self.startup_s: float | None = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        log = open(self.log_path, "wb")
        t0 = self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        log.close()
        deadline = t0 + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it "
                                   f"was ready; log {self.log_path}:\n{log_tail(self.log_path)}")
            if self._healthy():
                self.startup_s = time.monotonic() - t0
                if self.settle and self.wait_settled(deadline - time.monotonic()) is None:
                    self.stop()
                    raise RuntimeError(f"{self.name} still compiled after "
                                       f"{self.startup_timeout_s:.0f} s; log {self.log_path}")
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} was not ready after {self.startup_timeout_s:.0f}"
                                   f" s; log {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.25)  # polling a child process, not a test waiting on the engine

    def wait_settled(self, timeout_s: float) -> float | None:
        """Seconds from exec until `/health` counts no step variant compiling beside
        serving (at once for a server that does not count them); None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.base_url + self.health, timeout=5) as resp:
                    left = json.loads(resp.read()).get("compiling_variants", 0)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
                left = None
            if left == 0:
                return time.monotonic() - self.started_at
            time.sleep(0.5)  # polling a child process, not a test waiting on the engine
        return None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + self.health, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def metrale_server(model: str | None, *, max_batch_size: int, max_seq_len: int,
                   block_size: int = 16, port: int | None = None,
                   extra_args: tuple[str, ...] = (), log_path: str | None = None
                   ) -> ServerProcess:
    """`metrale serve` with a KV pool that holds every slot's full context at once, as
    llama-server's --ctx-size = parallel x per-slot context does: the comparison is of
    engines, not of how each one preempts when memory runs short."""
    port = port or free_port()
    blocks = max_batch_size * -(-max_seq_len // block_size) + 1
    command = [sys.executable, "-m", "metrale_jax.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--max-batch-size", str(max_batch_size),
               "--max-seq-len", str(max_seq_len), "--block-size", str(block_size),
               "--num-kv-blocks", str(blocks),
               "--max-tokens-per-tick", str(max(512, max_batch_size)), *extra_args]
    if model is not None:
        command += ["--model", model]
    return ServerProcess("metrale-serve", command, f"http://127.0.0.1:{port}",
                         log_path=log_path, env=dict(os.environ), settle=True)
