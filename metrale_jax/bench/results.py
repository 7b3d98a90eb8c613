"""Where results go and what each result file records beside its figures: the exact command,
the date, the machine and the versions of everything measured."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import sys

# benchmarks/results of the source tree this package sits in (an editable install or a
# checkout); elsewhere, the current directory's benchmarks/results.
_TREE = pathlib.Path(__file__).resolve().parents[2]
RESULTS_DIR = (_TREE / "benchmarks" / "results" if (_TREE / "benchmarks").is_dir()
               else pathlib.Path.cwd() / "benchmarks" / "results")

_PACKAGES = ("metrale-jax", "jax", "jaxlib", "flax", "torch", "transformers",
             "llama_cpp_python", "aiohttp", "numpy")


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The vector extensions the kernels and XLA choose their paths by: "AMD EPYC" alone names
# both the AVX2-only Zen 3 machines and the AVX-512 + bf16 Zen 4 ones, whose figures differ 2x.
_VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_features() -> dict:
    """The processor's family/model numbers and which of `_VECTOR_FLAGS` it has."""
    info: dict[str, str] = {}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("cpu family", "model", "flags") and key not in info:
                info[key] = value.strip()
    except OSError:
        return {}
    flags = set(info.get("flags", "").split())
    return {"family": info.get("cpu family"), "model": info.get("model"),
            "vector_flags": [f for f in _VECTOR_FLAGS if f in flags]}


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine_facts() -> dict:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    facts = {"cpu": cpu_model(), "cpu_features": cpu_features(), "cores": os.cpu_count(),
             "memory_bytes": memory_bytes(),
             "os": platform.platform(), "python": platform.python_version(),
             "versions": versions}
    if "jax" in sys.modules:
        import jax

        facts["jax_backend"] = jax.default_backend()
        facts["devices"] = [str(d) for d in jax.devices()]
    return facts


def record(payload: dict, command: str) -> dict:
    return {"command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_facts(), **payload}


def write_json(path: str | pathlib.Path, payload: dict, command: str) -> pathlib.Path:
    """`payload` with the command that produced it, the date and the machine."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(payload, command), indent=2, default=float) + "\n")
    return path
