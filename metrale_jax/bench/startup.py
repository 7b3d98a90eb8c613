"""Start-up time of `metrale serve`: from exec to `/health` answering 200, cold and cached.

Cold: an empty compilation cache, so every step variant compiles. Cached: the same command
again over the cache the cold start filled, as a user's second start is. Each run is a fresh
process, so imports and model loading count too. The server answers once the shapes that
cover every batch are compiled and compiles the rest beside serving; each run also records
how long a first completion then takes (`first_completion_s`, 32 greedy tokens) and when
the last shape is ready (`all_compiled_s`, from exec, as `/health` counts them).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request

from metrale_jax.bench.servers import ServerProcess, free_port

ALL_COMPILED_TIMEOUT_S = 900.0


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _first_completion(base: str) -> float:
    model = _get(base + "/v1/models")["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 32,
                       "temperature": 0.0, "ignore_eos": True}).encode()
    request = urllib.request.Request(base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(request, timeout=300) as resp:
        resp.read()
    return time.monotonic() - t0


def _start_once(model: str | None, cache_dir: str, extra: list[str]) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "metrale_jax.cli", "serve", "--port", str(port),
               "--compilation-cache", cache_dir, *(["--model", model] if model else []), *extra]
    with ServerProcess("metrale-startup", command, base) as server:
        first = _first_completion(base)
        compiled = server.wait_settled(ALL_COMPILED_TIMEOUT_S)
        return {"ready_s": round(float(server.startup_s), 2),
                "first_completion_s": round(first, 2),
                "all_compiled_s": None if compiled is None else round(compiled, 2)}


def startup(model: str | None, extra: list[str] = (), cached_runs: int = 2) -> dict:
    with tempfile.TemporaryDirectory(prefix="metrale-startup-cache-") as cache:
        cold = _start_once(model, cache, list(extra))
        cached = [_start_once(model, cache, list(extra)) for _ in range(cached_runs)]
    return {"cold_start_s": cold["ready_s"],
            "cached_start_s": min(c["ready_s"] for c in cached),
            "cached_runs_s": [c["ready_s"] for c in cached],
            "cold": cold, "cached_runs": cached, "serve_args": list(extra)}
