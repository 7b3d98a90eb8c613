"""`TensorParallel`: the `tp` mesh, the shardings of parameters, caches and step inputs, and
putting arrays on them.

The runner holds one of these when `tensor_parallel_size` > 1 (None otherwise: the
single-device path is untouched). Parameters and caches are committed to their shardings
once: the parameters by the loader itself, which gets an equal placement from the engine
(`param_placement`) and builds each on its sharding, so `place_params` finds them there.
The jitted step and the programs beside it (slot copies, swap) declare their outputs'
shardings, so every call after the first finds the program it compiled, and donation keeps
updating the very same per-device buffers. Host inputs (the packed step inputs, swap-in
pages) are replicated or split as they go to the devices.

Across processes (`ParallelConfig.num_processes` > 1) the mesh spans every process's
devices, so no array on it is fully addressable. What the host reads is replicated (the
step's outputs, the swap gather's rows), and reading a replicated array reads this
process's own copy; host inputs are identical in every process (lockstep), so
each process puts its devices' parts of them there itself (`TensorParallel.put`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from metrale_jax.config import ModelConfig
from metrale_jax.model.caches import DeviceCaches
from metrale_jax.parallel.config import ParallelConfig, ParallelConfigError
from metrale_jax.parallel.ops import ShardedOps
from metrale_jax.parallel.specs import AXIS, REPLICATED, cache_specs, param_specs
from pallas_kernels.backend import KernelOps

if TYPE_CHECKING:
    from metrale_jax.loader.targets import Placement


def make_tp_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over the first `tp` devices. `Auto` axis type: XLA propagates the
    shardings through the step (with `Explicit`, the default of `jax.make_mesh`, a matmul
    over a split contracting dimension would need an explicit `out_sharding`)."""
    devices = list(devices if devices is not None else jax.devices())
    _require_devices(tp, devices, "tensor_parallel_size")
    return Mesh(np.array(devices[:tp]), (AXIS,), axis_types=(AxisType.Auto,))


def device_groups(config: ParallelConfig, devices: Sequence[jax.Device] | None = None,
                  ) -> list[list[jax.Device]]:
    """Data parallel: engine i's devices, `devices[i * tp:(i + 1) * tp]`."""
    devices = list(devices if devices is not None else jax.devices())
    _require_devices(config.num_devices, devices,
                     "data_parallel_size x tensor_parallel_size")
    tp = config.tp
    return [devices[i * tp:(i + 1) * tp] for i in range(config.dp)]


def _require_devices(need: int, devices: list, what: str) -> None:
    if len(devices) < need:
        raise ParallelConfigError(
            f"{what}: {need} devices needed, this process sees {len(devices)} "
            f"({devices[0].platform}); on the CPU, simulate them with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} set before jax is "
            f"imported")


class TensorParallel:
    def __init__(self, config: ParallelConfig, model_config: ModelConfig,
                 devices: Sequence[jax.Device] | None = None):
        config.check_model(model_config)
        self.config = config
        self.model_config = model_config
        self.mesh = make_tp_mesh(config.tp, devices)
        self.replicated = NamedSharding(self.mesh, REPLICATED)

    @classmethod
    def for_engine(cls, config: ParallelConfig, model_config: ModelConfig,
                   devices: Sequence[jax.Device] | None = None) -> "TensorParallel | None":
        """The placement of an engine split over `tensor_parallel_size` > 1 devices, or of
        one given its own `devices` (a data-parallel replica); None for the default device:
        the single-device path."""
        if config.tp == 1 and devices is None:
            return None
        return cls(config, model_config, devices)

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def multi_process(self) -> bool:
        return self.config.multi_process

    @property
    def stored_kv_heads(self) -> int:
        return self.config.stored_kv_heads(self.model_config.num_kv_heads)

    def kernel_ops(self, ops: KernelOps) -> ShardedOps:
        return ShardedOps(ops, self.mesh)

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def param_shardings(self, paths: Sequence[tuple], leaves: Sequence,
                        ) -> list[NamedSharding]:
        """The sharding of each parameter leaf (arrays or `jax.ShapeDtypeStruct`s, with their
        key paths): what the loader reads straight into and `place_params` checks."""
        specs = param_specs(paths, leaves, self.model_config, self.tp)
        return [self.sharding(s) for s in specs]

    def place_params(self, paths: Sequence[tuple], leaves: Sequence[jax.Array],
                     ) -> list[jax.Array]:
        """The model's parameter leaves (with their key paths), each on its sharding. A
        leaf the loader already put there (given the engine's `param_placement`) is kept
        as it is: no second copy, the very buffers the loader filled."""
        shardings = self.param_shardings(paths, leaves)
        return [x if _on(x, s) else self.put(x, s) for x, s in zip(leaves, shardings)]

    def cache_shardings(self, caches: DeviceCaches) -> DeviceCaches:
        return jax.tree.map(self.sharding, cache_specs(caches),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def place_caches(self, caches: DeviceCaches) -> DeviceCaches:
        return self.put(caches, self.cache_shardings(caches))

    def place_swap_rows(self, kv: tuple, conv: tuple, ssm: tuple) -> tuple:
        """Swapped-in host rows onto their pools' shardings: KV pages
        `[n, kv_heads, bs, hd]` and SSM states `[H, P, N]` by head, conv tails replicated."""
        return (self.put(kv, self.sharding(PartitionSpec(None, AXIS, None, None))),
                self.put(conv, self.replicated),
                self.put(ssm, self.sharding(PartitionSpec(AXIS, None, None))))

    def replicate(self, tree):
        """Host or device arrays, a full copy on every device of the mesh."""
        return self.put(tree, self.replicated)

    def put(self, tree, shardings):
        """`jax.device_put(tree, shardings)` (one sharding, or a tree of them). Across
        processes each process fills its own devices' parts from its host copy, which
        lockstep makes the same everywhere: `jax.device_put` of host data onto a sharding
        spanning processes would first all-gather it to compare (a collective per step,
        serialised behind the step in flight), and refuses a committed local array."""
        if not self.multi_process:
            return jax.device_put(tree, shardings)
        if isinstance(shardings, jax.sharding.Sharding):
            return jax.tree.map(lambda x: _put_local_parts(x, shardings), tree)
        return jax.tree.map(_put_local_parts, tree, shardings)


def param_placement(config: ParallelConfig, devices: Sequence[jax.Device] | None = None,
                    ) -> "Placement | None":
    """What the loader needs to load an engine's parameters straight onto their shards: a
    function of the model's config (known only once the checkpoint's config is read)
    giving the engine's `TensorParallel`, equal to the one its runner builds from the same
    config and devices. None on the single-device path (the loader's own, unchanged)."""
    if config.tp == 1 and devices is None:
        return None
    return lambda model_config: TensorParallel(config, model_config, devices)


def _on(x, sharding: NamedSharding) -> bool:
    return isinstance(x, jax.Array) and x.sharding == sharding


def _put_local_parts(x, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # already across processes: a reshard
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
