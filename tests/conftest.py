"""Test-wide setup: JAX's persistent compilation cache, so compiled steps survive between
runs and processes on 2 cores.

Set through JAX's own environment variables rather than `jax.config`, so that this file does
not import jax: the host-side tests (scheduler, block pool, server protocol) run without
loading it, and JAX picks the settings up whenever a test module does import it (and so do
the server processes the process tests start).
"""

import os
import pathlib

_CACHE = pathlib.Path(os.environ.get("METRALE_TEST_JAX_CACHE",
                                     pathlib.Path(__file__).parent.parent / ".jax_cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
