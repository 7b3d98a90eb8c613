"""Several processes, one engine: `jax.distributed` with JAX's coordinator and, on the CPU,
gloo collectives. The one place where the multi-process settings are read and applied.

Lockstep, offline (a multi-controller SPMD program, as JAX multi-host requires):
1. Every process starts the same script with the same inputs, and its own `process_id`;
   process 0 also hosts the coordinator at `coordinator_address`.
2. `initialize` joins them before anything touches a JAX backend; `jax.devices()` is then
   every process's devices, and the engine's `tp` mesh spans them all (each process owns
   tp / num_processes of them).
3. Every process runs the same host loop: the scheduler is deterministic, so each
   dispatches the same sequence of jitted steps, whose collectives meet across processes.
   What the host reads back (sampled tokens, logprobs, swapped-out state) is replicated, so
   each process reads its local copy; host inputs are the same on every process.
What would let processes diverge is refused where it is set (`check_engine`): the HTTP
server (requests arrive at one process, at times of their own), the MTP gate's "auto"
(it measures wall-clock time), data parallel, sessions.

Settings come from `LLM(..., distributed={...})`, the flags `--num-processes`,
`--process-id`, `--coordinator-address`, or the environment (`ENV_VARS`): jax.distributed
itself reads only JAX_COORDINATOR_ADDRESS; the other two names follow it.
This module imports jax only inside `initialize`: the CLI parsers stay light.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping

from metrale_jax.parallel.config import ParallelConfig, ParallelConfigError

logger = logging.getLogger(__name__)

# ParallelConfig field -> environment variable.
ENV_VARS = {"num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID",
            "coordinator_address": "JAX_COORDINATOR_ADDRESS"}
FIELDS = tuple(ENV_VARS)
# Seconds process 0 waits for the others to join (and they for it) before jax gives up.
JOIN_TIMEOUT_S = 120


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict:
    """The multi-process settings the environment sets (only those it sets)."""
    environ = os.environ if environ is None else environ
    out: dict = {}
    for field, var in ENV_VARS.items():
        value = environ.get(var)
        if value is None or value == "":
            continue
        if field == "coordinator_address":
            out[field] = value
            continue
        try:
            out[field] = int(value)
        except ValueError:
            raise ParallelConfigError(f"{var}: must be an integer, got {value!r}") from None
    return out


def with_distributed(parallel: ParallelConfig, distributed: Mapping | str | None,
                     ) -> ParallelConfig:
    """`parallel` with the multi-process settings of `distributed`: a mapping of
    num_processes / process_id / coordinator_address, "env" (read `ENV_VARS`), or None
    (unchanged)."""
    if distributed is None:
        return parallel
    if distributed == "env":
        distributed = settings_from_env()
    if not isinstance(distributed, Mapping):
        raise ParallelConfigError(
            f"distributed: expected a mapping of {', '.join(FIELDS)} or 'env', got "
            f"{distributed!r}")
    unknown = sorted(set(distributed) - set(FIELDS))
    if unknown:
        raise ParallelConfigError(f"distributed: unknown settings {unknown}; expected "
                                  f"{', '.join(FIELDS)}")
    return dataclasses.replace(parallel, **distributed)


def initialize(config: ParallelConfig) -> None:
    """Join this process to the others (num_processes > 1) and check the devices they
    bring; nothing for one process. Idempotent: a second engine in the same process finds
    it joined, with the same settings or an error. Must run before any JAX backend use
    (JAX's own error says so otherwise); an unreachable coordinator is JAX's own timeout."""
    if not config.multi_process:
        return
    import jax

    if not jax.distributed.is_initialized():
        # gloo over TCP: the CPU backend's cross-process collectives (JAX's default in
        # 0.10, set here so a changed default or a stray flag cannot turn them off).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        logger.info("joining %d processes as process %d (coordinator %s)",
                    config.num_processes, config.process_id, config.coordinator_address)
        jax.distributed.initialize(config.coordinator_address,
                                   num_processes=config.num_processes,
                                   process_id=config.process_id,
                                   initialization_timeout=JOIN_TIMEOUT_S)
    elif (jax.process_count(), jax.process_index()) != (config.num_processes,
                                                          config.process_id):
        raise ParallelConfigError(
            f"num_processes/process_id: this process already joined as process "
            f"{jax.process_index()} of {jax.process_count()}, not {config.process_id} of "
            f"{config.num_processes}")
    check_devices(config, jax.device_count(), jax.local_device_count())


def check_devices(config: ParallelConfig, global_count: int, local_count: int) -> None:
    """The `tp` mesh spans every device of every process: tp devices in all, tp /
    num_processes on each."""
    per_process = config.tp // config.num_processes
    if global_count != config.tp or local_count != per_process:
        raise ParallelConfigError(
            f"tensor_parallel_size: {config.tp} over num_processes={config.num_processes} "
            f"needs {per_process} device(s) per process and {config.tp} in all; this "
            f"process has {local_count} of {global_count} (on the CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={per_process} in every "
            f"process)")


def check_engine(config: ParallelConfig, *, mtp_gate: str | None) -> None:
    """Refuse what would make the processes' host loops diverge."""
    if config.multi_process and mtp_gate == "auto":
        raise ParallelConfigError(
            "speculative gate 'auto' measures wall-clock time, which differs between "
            f"processes (num_processes={config.num_processes}); use gate 'on' or 'off'")


def refuse_serving(config: ParallelConfig) -> None:
    """The HTTP server: requests reach one process at times of its own, so the processes
    could not run the same loop."""
    if config.multi_process:
        raise ParallelConfigError(
            f"num_processes={config.num_processes} (process {config.process_id}): serving "
            f"over HTTP across processes is not supported; multi-host runs are offline and "
            f"lockstep only for now (every process runs the same LLM.generate script)")


# -- command-line flags ---------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--num-processes, --process-id, --coordinator-address (defaults: `ENV_VARS`)."""
    g = parser.add_argument_group(
        "multi-process", "one engine over several processes (jax.distributed; offline, "
        "lockstep); defaults come from " + ", ".join(ENV_VARS.values()))
    g.add_argument("--num-processes", type=int, default=None,
                   help="processes running the engine together (default 1)")
    g.add_argument("--process-id", type=int, default=None,
                   help="this process's rank, 0..num-processes-1 (0 hosts the coordinator)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's coordinator address")


def from_arguments(args: argparse.Namespace) -> dict:
    """The flags' settings over the environment's, as `distributed=` takes them."""
    settings = settings_from_env()
    for field in FIELDS:
        value = getattr(args, field, None)
        if value is not None:
            settings[field] = value
    return settings
