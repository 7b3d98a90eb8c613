"""Where the loaders put each parameter: on one device (the default), or straight onto the
shards of an engine split over devices.

A `Placement` is a function of the model's config giving the engine's `TensorParallel`
(parallel/placement.py, `param_placement`): the loader calls it once the checkpoint's config
is read (the shardings depend on the model's shapes), then builds every parameter on its
sharding, each device receiving only its own part. The runner later finds the parameters
already there (`TensorParallel.place_params` keeps them as they are).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from metrale_jax.config import ModelConfig

if TYPE_CHECKING:
    from metrale_jax.parallel.placement import TensorParallel

Placement = Callable[[ModelConfig], "TensorParallel"]
StatePath = tuple[Any, ...]  # a pure-dict path, e.g. ('blocks', 0, 'mixer', 'q_proj', 'kernel')


def param_shardings(placement: Placement | None, cfg: ModelConfig,
                    flat: Sequence[tuple[tuple, jax.ShapeDtypeStruct]],
                    ) -> dict[StatePath, jax.sharding.Sharding] | None:
    """Each leaf's target sharding, keyed by its path (plain keys), from the abstract
    model's flattened pure dict; None without a placement (one device)."""
    if placement is None:
        return None
    paths = [path for path, _ in flat]
    shardings = placement(cfg).param_shardings(paths, [leaf for _, leaf in flat])
    return {plain_path(path): s for path, s in zip(paths, shardings)}


def plain_path(path: tuple) -> StatePath:
    """A pure dict's key path as its keys: ('blocks', 0, 'mixer', 'q_proj', 'kernel')."""
    return tuple(k.key for k in path)
