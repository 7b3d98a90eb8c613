"""llama.cpp as a peer: the same checkpoint converted to GGUF, the same token-id prompts,
greedy, every request forced to its full output length (end-of-sequence ignored).

Two ways in:

* `run_offline` drives the llama.cpp C API in-process through llama-cpp-python's low-level
  ctypes bindings, with our own continuous batching (up to `concurrency` sequences in
  flight, one KV stream each, a finished sequence's slot refilled at once), so the offline
  figures measure llama.cpp's kernels rather than its server's HTTP and JSON.
* `LlamaServer` starts the `llama-server` binary for the serving benchmark.

`greedy_tokens` returns what `run_offline` generates, for agreement checks against ours.

llama.cpp lives outside this repository and outside its dependencies: it is found by path,
and every "not found" error repeats the steps below.

How to make the peer (CPU, Linux; llama-cpp-python 0.3.36 vendors a matching llama.cpp):

1. Sources (the GGUF converter and the C++ code)::

       pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/dl
       tar -xzf /tmp/dl/llama_cpp_python-0.3.36.tar.gz -C /work/peers
       export METRALE_LLAMA_CPP_SRC=/work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp

   The converter also needs `sentencepiece`, `protobuf` and `torch` in this interpreter;
   its own `gguf-py` package is put on its PYTHONPATH here, not installed.

2. `llama-server` and the shared libraries, one build (about 15 minutes on 2 cores)::

       cmake -S $METRALE_LLAMA_CPP_SRC -B /work/peers/llama-build \\
             -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_OPENSSL=OFF \\
             -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       cmake --build /work/peers/llama-build --target llama-server -j 2
       export METRALE_LLAMA_SERVER=/work/peers/llama-build/bin/llama-server

   libllama.so and libggml*.so land beside it in /work/peers/llama-build/bin.

3. The Python bindings, reusing those libraries instead of compiling llama.cpp again::

       CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \\
           pip install --no-deps /work/peers/llama_cpp_python-0.3.36
       pip install diskcache   # imported by llama_cpp/__init__; numpy, jinja2 and
                               # typing_extensions are usually there already
       # find_spec, not import: `import llama_cpp` fails until the links below exist
       SITE=$(python -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('llama_cpp').origin))")
       mkdir -p $SITE/lib && ln -sf /work/peers/llama-build/bin/lib*.so* $SITE/lib/

   (`llama_cpp` loads libllama from $LLAMA_CPP_LIB_PATH or its own `lib/` folder, but its
   `_ggml` module looks only in `lib/`, hence the links rather than the variable.)
"""

from metrale_jax.bench.peers.llamacpp.batcher import context_tokens, greedy_continuous
from metrale_jax.bench.peers.llamacpp.convert import (convert_to_gguf, converter_command,
                                                      converter_env, gguf_is_current,
                                                      gguf_output_path)
from metrale_jax.bench.peers.llamacpp.locate import (CONVERTER, ENGINE, ENV_SERVER, ENV_SOURCE,
                                                     PeerNotFoundError, find_llama_cpp_source,
                                                     find_llama_server, import_llama_cpp)
from metrale_jax.bench.peers.llamacpp.offline import greedy_tokens, run_offline
from metrale_jax.bench.peers.llamacpp.server import LlamaServer, server_command

__all__ = ["CONVERTER", "ENGINE", "ENV_SERVER", "ENV_SOURCE", "LlamaServer", "PeerNotFoundError",
           "context_tokens", "convert_to_gguf", "converter_command", "converter_env",
           "find_llama_cpp_source", "find_llama_server", "gguf_is_current", "gguf_output_path",
           "greedy_continuous", "greedy_tokens", "import_llama_cpp", "run_offline",
           "server_command"]
