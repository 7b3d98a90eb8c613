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
            "empty": np.zeros((4, 0), np.int32),
            "odd": np.arange(3, dtype=np.int8), "scalar": np.float32(-2.5),
            "after": np.array([1 << 30, -7], np.int32)}  # after an unaligned leaf
    buffers, layout = pack(tree)
    assert list(buffers) == ["bytes"] and buffers["bytes"].dtype == np.uint8  # one transfer
    out = jax.jit(unpack, static_argnums=1)(jax.device_put(buffers), layout)
    for key, want in tree.items():
        got = np.asarray(out[key])
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
