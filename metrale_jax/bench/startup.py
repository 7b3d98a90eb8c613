"""Start-up time of `metrale serve`: from exec to `/health` answering 200, cold and cached.

Cold: an empty compilation cache, so every step variant compiles. Cached: the same command
again over the cache the cold start filled, as a user's second start is. Each run is a fresh
process, so imports and model loading count too.
"""

from __future__ import annotations

import sys
import tempfile

from metrale_jax.bench.servers import ServerProcess, free_port


def _start_once(model: str | None, cache_dir: str, extra: list[str]) -> float:
    port = free_port()
    command = [sys.executable, "-m", "metrale_jax.cli", "serve", "--port", str(port),
               "--compilation-cache", cache_dir, *(["--model", model] if model else []), *extra]
    with ServerProcess("metrale-startup", command, f"http://127.0.0.1:{port}") as server:
        return float(server.startup_s)


def startup(model: str | None, extra: list[str] = (), cached_runs: int = 2) -> dict:
    with tempfile.TemporaryDirectory(prefix="metrale-startup-cache-") as cache:
        cold = _start_once(model, cache, list(extra))
        cached = [_start_once(model, cache, list(extra)) for _ in range(cached_runs)]
    return {"cold_start_s": round(cold, 2), "cached_start_s": round(min(cached), 2),
            "cached_runs_s": [round(c, 2) for c in cached], "serve_args": list(extra)}
