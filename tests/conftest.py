"""Test-wide setup: JAX's persistent compilation cache, so compiled steps survive between
runs and processes on 2 cores."""

import os
import pathlib

import jax

_CACHE = pathlib.Path(os.environ.get("METRALE_TEST_JAX_CACHE",
                                     pathlib.Path(__file__).parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
