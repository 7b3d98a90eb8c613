"""Build and load the CPU custom-call library with the system compiler, once per machine.

No build step at install time: the first process that wants a CPU kernel compiles
`*.cc` beside this file with `c++` into a cache keyed by the sources, the jaxlib version and
the processor's flags (the library is built for this CPU with -march=native), then registers
its handlers with XLA. A machine without a compiler, or a failing build, gets `None` and a
warning naming the reason: callers then run the jnp reference instead.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)

SOURCES = sorted(pathlib.Path(__file__).parent.glob("*.cc"))
HEADERS = sorted(pathlib.Path(__file__).parent.glob("*.h"))
CACHE_DIR = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")
                         ) / "metrale_jax" / "cpu_kernels"
# -ffast-math lets the exps vectorize (the kernels keep every value finite for it), but only
# when compiling: linked with it, gcc adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process the moment the library loads. So: compile, then link.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC",
                 "-std=c++17", "-w"]
LINK_FLAGS = ["-shared", "-lmvec", "-lm"]
FLAGS = COMPILE_FLAGS + LINK_FLAGS
# name in XLA -> symbol in the library
TARGETS = {"metrale_paged_attention": "MetralePagedAttention",
           "metrale_ragged_paged_attention": "MetraleRaggedPagedAttention",
           "metrale_paged_attention_bf16": "MetralePagedAttentionBf16",
           "metrale_ragged_paged_attention_bf16": "MetraleRaggedPagedAttentionBf16",
           "metrale_write_kv_pages_bf16": "MetraleWriteKvPagesBf16",
           "metrale_small_matmul_f32": "MetraleSmallMatmulF32",
           "metrale_small_matmul_bf16": "MetraleSmallMatmulBf16",
           "metrale_packed_matmul_f32": "MetralePackedMatmulF32",
           "metrale_packed_matmul_bf16": "MetralePackedMatmulBf16",
           "metrale_packed_norm_matmul_f32": "MetralePackedNormMatmulF32",
           "metrale_packed_norm_matmul_bf16": "MetralePackedNormMatmulBf16",
           "metrale_amx_matmul_f32": "MetraleAmxMatmulF32",
           "metrale_amx_matmul_bf16": "MetraleAmxMatmulBf16"}


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _library_path(include: str) -> pathlib.Path:
    import jaxlib

    key = hashlib.sha256()
    for src in SOURCES + HEADERS:
        key.update(src.read_bytes())
    key.update(jaxlib.__version__.encode())
    key.update(include.encode())
    key.update(_cpu_flags().encode())
    key.update(" ".join(FLAGS).encode())
    return CACHE_DIR / f"metrale_cpu_kernels-{key.hexdigest()[:16]}.so"


def _compile(out: pathlib.Path, include: str) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=out.parent) as objects:
        try:
            objs = [os.path.join(objects, src.stem + ".o") for src in SOURCES]
            # One compiler per source, on every core: the first start on a machine waits
            # for this (12 s serially on 2 cores, ~7 s in parallel).
            with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                list(pool.map(lambda src, obj: _run([compiler, *COMPILE_FLAGS, f"-I{include}",
                                                     "-c", str(src), "-o", obj]),
                              SOURCES, objs))
            _run([compiler, *objs, *LINK_FLAGS, "-o", tmp])
            os.replace(tmp, out)  # atomic: a concurrent process sees the old file or the new
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _run(command: list[str]) -> None:
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{command[0]} failed: {e.stderr.strip()[-2000:]}") from e


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library with its handlers registered for the CPU platform, or None."""
    import jax

    try:
        include = jax.ffi.include_dir()
        path = _library_path(include)
        if not path.exists():
            logger.info("compiling the CPU attention kernel into %s (once per machine)", path)
            _compile(path, include)
        lib = ctypes.cdll.LoadLibrary(str(path))
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
        return lib
    except Exception as e:  # noqa: BLE001 - any failure means: use the reference
        logger.warning("CPU kernels unavailable (%s); attention runs on the XLA reference", e)
        return None
