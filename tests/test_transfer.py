"""The packed host->device transfer gives back exactly the pytree it was given."""

import jax
import numpy as np

from metrale_jax.runner.transfer import pack, unpack


def test_pack_unpack_round_trip_keeps_values_and_dtypes():
    rng = np.random.default_rng(0)
    tree = {"ids": rng.integers(-5, 9, (3, 4)).astype(np.int32),
            "mask": rng.random((2, 5)) > 0.5,
            "temps": rng.random(7).astype(np.float32),
            "seeds": rng.integers(0, 2**32, 3, dtype=np.uint64).astype(np.uint32),
            "empty": np.zeros((4, 0), np.int32)}
    buffers, layout = pack(tree)
    assert set(buffers) == {"int32", "uint8", "float32", "uint32"}  # one buffer per dtype
    out = jax.jit(unpack, static_argnums=1)(jax.device_put(buffers), layout)
    for key, want in tree.items():
        got = np.asarray(out[key])
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
