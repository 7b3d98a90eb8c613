"""What every benchmark script records beside its figures: the command, the machine, the
versions (the same record `metrale bench` writes)."""

from __future__ import annotations

import pathlib
import sys

from metrale_jax.bench.results import RESULTS_DIR as RESULTS
from metrale_jax.bench.results import write_json


def write_result(name: str, payload: dict, file: str | None = None) -> pathlib.Path:
    """`file`: the result's file name without .json (default: the module's name)."""
    command = " ".join([pathlib.Path(sys.executable).name, "-m", f"benchmarks.{name}"]
                       + sys.argv[1:])
    return write_json(RESULTS / f"{file or name}.json", payload, command)
