"""Finding llama.cpp: its sources (for the GGUF converter), the llama-server binary and the
Python bindings. Each "not found" error carries the steps that make the missing piece."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

ENGINE = "llama.cpp"
ENV_SOURCE = "METRALE_LLAMA_CPP_SRC"
ENV_SERVER = "METRALE_LLAMA_SERVER"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CONVERTER = "convert_hf_to_gguf.py"

HOW_TO_GET_SOURCE = f"""\
get the llama.cpp sources (they hold {CONVERTER} and gguf-py):
    pip download --no-deps --no-binary :all: {LLAMA_CPP_PYTHON} -d /tmp/dl
    mkdir -p /work/peers && tar -xzf /tmp/dl/llama_cpp_python-0.3.36.tar.gz -C /work/peers
    export {ENV_SOURCE}=/work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp"""

HOW_TO_BUILD_SERVER = f"""\
build llama-server (and the shared libraries beside it) from the llama.cpp sources:
    cmake -S ${ENV_SOURCE} -B /work/peers/llama-build \\
          -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_OPENSSL=OFF \\
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build /work/peers/llama-build --target llama-server -j 2
    export {ENV_SERVER}=/work/peers/llama-build/bin/llama-server
where the sources come from: {HOW_TO_GET_SOURCE}"""

HOW_TO_INSTALL_BINDINGS = f"""\
make `import llama_cpp` work on the libraries built with llama-server (no second compile):
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \\
        {sys.executable} -m pip install --no-deps /work/peers/llama_cpp_python-0.3.36
    {sys.executable} -m pip install diskcache
    SITE=$({sys.executable} -c "import importlib.util as u, os; \\
        print(os.path.dirname(u.find_spec('llama_cpp').origin))")
    mkdir -p $SITE/lib && ln -sf /work/peers/llama-build/bin/lib*.so* $SITE/lib/
where /work/peers/llama-build comes from: {HOW_TO_BUILD_SERVER}"""


class PeerNotFoundError(RuntimeError):
    """llama.cpp (sources, binary or bindings) is not where we looked; the message says how
    to make it."""


# ---------------------------------------------------------------------------------------
# Finding the peer

def find_llama_cpp_source(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The llama.cpp source folder (the one holding convert_hf_to_gguf.py): `path`, else
    $METRALE_LLAMA_CPP_SRC. The llama-cpp-python root (holding vendor/llama.cpp) also does."""
    given = path if path is not None else os.environ.get(ENV_SOURCE)
    if not given:
        raise PeerNotFoundError(
            f"llama.cpp sources: no path given and ${ENV_SOURCE} is not set; "
            + HOW_TO_GET_SOURCE)
    root = pathlib.Path(given).expanduser()
    for candidate in (root, root / "vendor" / "llama.cpp"):
        if (candidate / CONVERTER).is_file():
            return candidate.resolve()
    raise PeerNotFoundError(f"llama.cpp sources: {root} holds no {CONVERTER}; "
                            + HOW_TO_GET_SOURCE)


def find_llama_server(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The llama-server binary: `path`, else $METRALE_LLAMA_SERVER, else the PATH."""
    given = path if path is not None else os.environ.get(ENV_SERVER)
    if given:
        binary = pathlib.Path(given).expanduser()
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary.resolve()
        raise PeerNotFoundError(f"llama-server: {binary} is not an executable file; "
                                + HOW_TO_BUILD_SERVER)
    found = shutil.which("llama-server")
    if found is None:
        raise PeerNotFoundError(
            f"llama-server: no path given, ${ENV_SERVER} is not set and it is not on PATH; "
            + HOW_TO_BUILD_SERVER)
    return pathlib.Path(found).resolve()


def import_llama_cpp():
    """The `llama_cpp` bindings module, with llama.cpp's own logging cut down to errors."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as e:
        # A missing package is an ImportError; a package without its libraries fails while
        # loading them, with FileNotFoundError (an OSError) or RuntimeError.
        raise PeerNotFoundError(f"cannot import llama_cpp ({type(e).__name__}: {e}); "
                                + HOW_TO_INSTALL_BINDINGS) from e
    _quiet_llama_logs(llama_cpp)
    return llama_cpp


_LOG_CALLBACK = None  # kept referenced: llama.cpp calls it from C for the process lifetime


def _quiet_llama_logs(llama_cpp) -> None:
    """Print llama.cpp's errors only; by default the bindings echo every load-time line."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return
    error, cont = 3, 5  # GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT (continues a message)
    last = [0]

    @llama_cpp.llama_log_callback
    def callback(level, text, _user_data):
        if level != cont:
            last[0] = level
        if last[0] == error:
            sys.stderr.write(text.decode("utf-8", "replace"))

    _LOG_CALLBACK = callback
    llama_cpp.llama_log_set(callback, None)


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
