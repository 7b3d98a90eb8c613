"""Scale-out on JAX's own machinery: a `jax.sharding.Mesh` with a `tp` axis.

* `config.py`  — `ParallelConfig`, the one typed object for parallelism (host only, no jax).
* `specs.py`   — which `PartitionSpec` each parameter and cache array gets.
* `ops.py`     — `ShardedOps`: the kernel set run per shard with `jax.shard_map`.
* `placement.py` — `TensorParallel`: the mesh, the shardings, and putting arrays on them;
  `device_groups`: each data-parallel engine's devices.
* `router.py`  — data parallel: the prefix-affinity router (host only, no jax).
* `data_parallel.py` — `DataParallelLLM`: M engines behind the router (offline API).
* `async_data_parallel.py` — `DataParallelAsyncLLM`: M `AsyncLLM`s behind the router, with
  one `AsyncLLM`'s surface (`metrale serve --data-parallel-size`).
* `distributed.py` — one engine over several processes (`jax.distributed`, lockstep):
  the settings (flags, env), joining, and what is refused across processes.

Tensor parallelism of size 1 builds none of this: the runner's single-device path is
unchanged. This `__init__` imports nothing, so `metrale_jax.config` can import
`parallel.config` without loading jax.
"""
