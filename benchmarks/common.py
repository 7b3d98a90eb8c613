"""What every benchmark records beside its figures: the command, the machine, the versions."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

RESULTS = pathlib.Path(__file__).parent / "results"


def machine_facts() -> dict:
    import jax
    import flax

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def write_result(name: str, payload: dict) -> pathlib.Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {
        "command": " ".join([pathlib.Path(sys.executable).name, "-m",
                             f"benchmarks.{name}"] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_facts(),
        **payload,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
