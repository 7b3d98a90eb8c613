"""`ParallelConfig`: how the model is spread over devices (host only: no jax import).

Tensor parallelism (`tensor_parallel_size` = N) splits every layer over a mesh axis `tp` of N
devices: attention and KV heads, MLP columns/rows, Mamba2 heads and their SSM state, the
vocabulary. What must divide N is checked against the model at start-up (`check_model`), so a
bad N fails there with the count it does not divide, never inside a compile.

Several processes (`num_processes` > 1, e.g. one per host) run one engine together in
lockstep: each runs the same host loop on the same inputs and owns its local devices, and
the `tp` mesh spans every process's devices (parallel/distributed.py says how they join).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metrale_jax.config import ModelConfig


class ParallelConfigError(ValueError):
    """An invalid parallel setting; the message names the field and the count at fault."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    # Devices one model is split over (the mesh axis `tp`); 1 is the single-device path.
    tensor_parallel_size: int = 1
    # Engines side by side, each on its own group of tensor_parallel_size devices, behind a
    # prefix-affinity router (parallel/data_parallel.py); 1: one engine.
    data_parallel_size: int = 1
    # Processes running this engine together (jax.distributed); 1: this process alone.
    num_processes: int = 1
    # This process's rank among them, 0..num_processes-1; process 0 hosts the coordinator.
    process_id: int = 0
    # "host:port" of process 0's coordinator service; needed when num_processes > 1.
    coordinator_address: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "num_processes"):
            n = getattr(self, name)
            if type(n) is not int or n < 1:
                raise ParallelConfigError(f"{name}: must be a positive integer, got {n!r}")
        if type(self.process_id) is not int or not 0 <= self.process_id < self.num_processes:
            raise ParallelConfigError(
                f"process_id: must be an integer in 0..{self.num_processes - 1} "
                f"(num_processes={self.num_processes}), got {self.process_id!r}")
        if self.multi_process:
            self._check_multi_process()

    def _check_multi_process(self) -> None:
        address = self.coordinator_address
        host, _, port = (address or "").rpartition(":")
        if not isinstance(address, str) or not host or not port.isdigit():
            raise ParallelConfigError(
                f"coordinator_address: num_processes={self.num_processes} needs process 0's "
                f"address as 'host:port', got {address!r}")
        if self.dp > 1:
            raise ParallelConfigError(
                f"data_parallel_size: {self.dp} is not supported across processes "
                f"(num_processes={self.num_processes}); use tensor parallel only")
        if self.tp % self.num_processes:
            raise ParallelConfigError(
                f"tensor_parallel_size: {self.tp} must be a multiple of "
                f"num_processes={self.num_processes} (each process owns tp / num_processes "
                f"of the mesh's devices)")

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    def check_model(self, cfg: "ModelConfig") -> None:
        """Raise unless the model splits evenly over `tp` devices. Query heads and Mamba2
        heads must divide by tp; KV heads (and Mamba2 B/C groups) either divide by tp or
        divide tp, in which case each is replicated on tp / count devices (as vLLM does)."""
        tp = self.tp
        if tp == 1:
            return
        attention = "A" in cfg.layer_pattern or (cfg.num_mtp_modules and "A" in cfg.mtp_pattern)
        if attention:
            _divisible("num_heads", cfg.num_heads, tp)
            _divides_or_divisible("num_kv_heads", cfg.num_kv_heads, tp)
        if "M" in cfg.layer_pattern:
            _divisible("mamba_num_heads", cfg.mamba_num_heads, tp)
            _divides_or_divisible("mamba_groups", cfg.mamba_groups, tp)

    def stored_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads the paged pool holds: the model's, or tp when it has fewer (each device
        then stores the one KV head its query heads read)."""
        return max(num_kv_heads, self.tp)

    def kv_heads_per_device(self, num_kv_heads: int) -> int:
        return self.stored_kv_heads(num_kv_heads) // self.tp


def _divisible(name: str, count: int, tp: int) -> None:
    if count % tp:
        raise ParallelConfigError(
            f"tensor_parallel_size: {tp} does not divide {name}={count}; pick a size that "
            f"divides it")


def _divides_or_divisible(name: str, count: int, tp: int) -> None:
    if count % tp and tp % count:
        raise ParallelConfigError(
            f"tensor_parallel_size: {tp} neither divides {name}={count} nor is a multiple "
            f"of it")
