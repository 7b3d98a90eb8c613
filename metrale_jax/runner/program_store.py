"""A directory of lowered programs, each filed under a key that names everything it depends on.

The store knows nothing of JAX programs: it files opaque payloads under a key text. The key
text is the caller's description of the program (shapes, options, model) plus what this
module adds for every entry: the store format, the versions of Python, jax, jaxlib and flax,
the backend and processor, the jax settings that change tracing, and a digest of the engine's
own source files. A payload is only ever handed back for the identical key text, so an entry
from other code, another jax or another machine is never used, even if a file is copied in
under the right name.

An entry that cannot be read (truncated, corrupt, another format) is a miss with a warning:
the caller builds the program anew and files it again. Writes go to a temporary file first
and are renamed into place, so a process killed mid-write leaves no half entry and two
processes filing the same program do not interleave.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pathlib
import platform
import sys
import tempfile

logger = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"METRALE-PROGRAM\n"
SUFFIX = ".program"
# The packages whose source shapes a traced program: the engine and its kernels.
SOURCE_PACKAGES = ("metrale_jax", "pallas_kernels")
SOURCE_GLOBS = ("*.py", "*.cc")
# Inside JAX's compilation-cache directory (whose own eviction only looks at '*-cache' files).
SUBDIR = "metrale-programs"


class ProgramStore:
    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)

    @classmethod
    def from_setting(cls, setting: str | None) -> "ProgramStore | None":
        """`EngineConfig.program_cache`: "auto" keeps the store inside JAX's persistent
        compilation cache directory when one is set (without it a stored program would
        still be compiled at every start, so there is little to gain); "none" or None turns
        it off; anything else is the directory."""
        if setting is None or setting.lower() == "none":
            return None
        if setting == "auto":
            import jax

            cache_dir = jax.config.jax_compilation_cache_dir
            return cls(pathlib.Path(cache_dir) / SUBDIR) if cache_dir else None
        return cls(setting)

    def path_for(self, key: str) -> pathlib.Path:
        digest = hashlib.sha256(self._full_key(key).encode()).hexdigest()
        return self.directory / f"{digest[:40]}{SUFFIX}"

    def load(self, key: str) -> bytes | None:
        """The payload filed under `key`, or None (absent, or unreadable: logged)."""
        path = self.path_for(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            logger.warning("program store: cannot read %s (%s); building the program anew",
                           path, err)
            return None
        payload, why = _unpack(blob, self._full_key(key).encode())
        if payload is None:
            logger.warning("program store: ignoring %s (%s); building the program anew",
                           path, why)
        return payload

    def save(self, key: str, payload: bytes) -> None:
        """File `payload` under `key`; a failure is logged, never raised (the program runs
        anyway, the next start just builds it again)."""
        path = self.path_for(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".tmp-",
                                             delete=False) as tmp:
                tmp.write(_pack(self._full_key(key).encode(), payload))
            os.replace(tmp.name, path)
        except OSError as err:
            logger.warning("program store: cannot write %s (%s)", path, err)

    def _full_key(self, key: str) -> str:
        return f"{environment_key()}\n{key}"


def _pack(key: bytes, payload: bytes) -> bytes:
    digest = hashlib.sha256(key + payload).digest()
    return MAGIC + digest + len(key).to_bytes(8, "little") + key + payload


def _unpack(blob: bytes, key: bytes) -> tuple[bytes | None, str]:
    """(payload, "") for an intact entry of exactly `key`, else (None, why not)."""
    head = len(MAGIC) + 32 + 8
    if len(blob) < head or not blob.startswith(MAGIC):
        return None, "not a program entry"
    digest = blob[len(MAGIC):len(MAGIC) + 32]
    key_len = int.from_bytes(blob[head - 8:head], "little")
    stored_key, payload = blob[head:head + key_len], blob[head + key_len:]
    if hashlib.sha256(stored_key + payload).digest() != digest:
        return None, "checksum mismatch: truncated or corrupt"
    if stored_key != key:
        return None, "filed for other code, versions, machine or shapes"
    return payload, ""


@functools.cache
def environment_key() -> str:
    """What every entry depends on beyond its own description (computed once a process:
    the sources do not change under a running engine)."""
    import flax
    import jax
    import jaxlib

    device = jax.devices()[0]
    lines = [
        f"format {FORMAT}",
        f"python {sys.version.split()[0]} jax {jax.__version__} jaxlib {jaxlib.__version__} "
        f"flax {flax.__version__}",
        f"backend {jax.default_backend()} {device.platform} {device.device_kind}",
        f"cpu {_cpu_description()}",
        f"x64 {jax.config.jax_enable_x64} matmul {jax.config.jax_default_matmul_precision}",
        f"sources {source_digest()}",
    ]
    return "\n".join(lines)


def source_digest() -> str:
    """sha256 over the engine's and kernels' source files (paths and contents)."""
    h = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        root = pathlib.Path(importlib.import_module(package).__file__).parent
        files = sorted({p for pattern in SOURCE_GLOBS for p in root.rglob(pattern)})
        for path in files:
            h.update(f"{package}/{path.relative_to(root)}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _cpu_description() -> str:
    """The processor's model and feature flags (XLA:CPU code is built for them)."""
    wanted = {}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in ("model name", "flags") and name not in wanted:
                wanted[name] = value.strip()
    except OSError:
        pass
    return " | ".join(wanted.values()) or f"{platform.machine()} {platform.processor()}"
