"""The adapter registry (host only): which adapters exist and which holds which device slot.

Two kinds of change, on two kinds of thread:
  * Reading an adapter (`read`: a PEFT directory parsed into `LoraWeights`) is slow and runs
    on the caller's thread or a worker, never the engine's; registering a new name
    (`register`) is bookkeeping and may happen at any time: no sequence can hold it yet.
  * Slots, replacing and removing change what running rows compute with, so only the engine
    thread does them, in the quiescent rotation phase (`scheduler/adapters.py`), which also
    makes the device calls. The registry itself never touches the device.

Identities: `name` is what users say; `int_id` is vLLM's `lora_int_id` (given offline, or
numbered here); `version` is what a sequence and the prefix-cache keys carry. A replace gives
the name a new version, so blocks and SSM snapshots computed under the old weights can never
be reused by the new ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Collection

from metrale_jax.lora.config import LoraConfig
from metrale_jax.lora.request import LoRARequest
from metrale_jax.lora.weights import LoraError, LoraWeights

# (name, path) -> weights; raises LoraError (or OSError) when the directory is not usable.
AdapterLoader = Callable[[str, str], LoraWeights]


def peft_loader(model_config, lora_config: LoraConfig) -> AdapterLoader:
    """The production loader: the device side's PEFT reader, imported on first use (it
    brings numpy/safetensors work the host-only tests never need)."""

    def load(name: str, path: str) -> LoraWeights:
        from metrale_jax.lora.peft import load_peft_adapter

        return load_peft_adapter(path, model_config, lora_config, name)

    return load


@dataclasses.dataclass
class Adapter:
    name: str
    int_id: int
    path: str
    weights: LoraWeights
    version: int          # Sequence.adapter_id and the prefix-cache key: new on every replace
    slot: int = 0         # device slot 1..max_loras; 0: not resident
    last_used: int = 0    # tick of the last admission under it (LRU eviction)


class AdapterRegistry:
    def __init__(self, max_loras: int, loader: AdapterLoader):
        if max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._loader = loader
        self._lock = threading.Lock()  # names are read by front threads, changed by both
        self._by_name: dict[str, Adapter] = {}
        self._slots: list[Adapter | None] = [None] * (max_loras + 1)  # index 0 unused
        self._versions = itertools.count(1)
        self._int_ids = itertools.count(1_000_000)  # ids for adapters the server loads

    # ---- any thread ------------------------------------------------------------------------

    def read(self, name: str, path: str) -> LoraWeights:
        """Parse an adapter directory (slow: call it off the engine thread)."""
        try:
            weights = self._loader(name, path)
        except LoraError:
            raise
        except OSError as err:
            raise LoraError(f"adapter {name!r}: cannot read {path}: {err}") from None
        if not isinstance(weights, LoraWeights):
            raise LoraError(f"adapter {name!r}: the loader returned {type(weights).__name__}")
        return weights

    def register(self, name: str, path: str, weights: LoraWeights,
                 int_id: int | None = None) -> Adapter:
        """Add a new name (no device work: the cohort gate loads it when a request needs
        it). Raises LoraError when the name, or the int id, is taken by another adapter."""
        with self._lock:
            if name in self._by_name:
                raise LoraError(f"adapter {name!r}: is already loaded")
            self._check_int_id(name, int_id)
            adapter = Adapter(name, int_id if int_id is not None else next(self._int_ids),
                              path, weights, next(self._versions))
            self._by_name[name] = adapter
            return adapter

    def ensure(self, request: LoRARequest) -> Adapter:
        """The offline path: the adapter a `LoRARequest` names, read and registered on
        first use (on the caller's thread). The same name must keep its id and path."""
        adapter = self.get(request.lora_name)
        if adapter is None:
            weights = self.read(request.lora_name, request.lora_path)
            try:
                return self.register(request.lora_name, request.lora_path, weights,
                                     request.lora_int_id)
            except LoraError:
                adapter = self.get(request.lora_name)  # another thread registered it
                if adapter is None:
                    raise
        if (adapter.int_id, adapter.path) != (request.lora_int_id, request.lora_path):
            raise LoraError(f"lora_request: adapter {request.lora_name!r} is registered as "
                            f"id {adapter.int_id} from {adapter.path}, not id "
                            f"{request.lora_int_id} from {request.lora_path}")
        return adapter

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            return self._by_name.get(name)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._by_name

    def adapters(self) -> list[Adapter]:
        with self._lock:
            return list(self._by_name.values())

    def name_of(self, version: int) -> str | None:
        with self._lock:
            for adapter in self._by_name.values():
                if adapter.version == version:
                    return adapter.name
            return None

    def resident(self) -> list[Adapter]:
        """Adapters holding a device slot, by slot."""
        with self._lock:
            return [a for a in self._slots[1:] if a is not None]

    def _check_int_id(self, name: str, int_id: int | None) -> None:
        if int_id is None:
            return
        for other in self._by_name.values():
            if other.int_id == int_id and other.name != name:
                raise LoraError(f"lora_int_id: {int_id} already names adapter {other.name!r}")

    # ---- the engine thread, at a quiescent tick -------------------------------------------

    def choose_slot(self, keep: Collection[str]) -> int | None:
        """A slot to load into: a free one, else the least recently used adapter's among
        those not in `keep` (the names sequences hold, and those about to be used); None
        when every slot is kept."""
        with self._lock:
            for slot in range(1, self.max_loras + 1):
                if self._slots[slot] is None:
                    return slot
            evictable = [a for a in self._slots[1:] if a is not None and a.name not in keep]
            if not evictable:
                return None
            return min(evictable, key=lambda a: (a.last_used, a.slot)).slot

    def place(self, adapter: Adapter, slot: int) -> Adapter | None:
        """Record `adapter` in `slot` (after the device load succeeded); returns the adapter
        it evicted, if any."""
        with self._lock:
            evicted = self._slots[slot]
            if evicted is not None:
                evicted.slot = 0
            if adapter.slot:
                self._slots[adapter.slot] = None
            self._slots[slot], adapter.slot = adapter, slot
            return evicted

    def vacate(self, slot: int) -> None:
        """Forget what `slot` holds (after a failed load left it in an unknown state)."""
        with self._lock:
            adapter = self._slots[slot]
            if adapter is not None:
                adapter.slot = 0
            self._slots[slot] = None

    def replace(self, name: str, path: str, weights: LoraWeights) -> Adapter:
        """New weights under an existing name: a new version, the same slot (the caller
        loads them into it)."""
        with self._lock:
            old = self._require(name)
            new = dataclasses.replace(old, path=path, weights=weights,
                                      version=next(self._versions))
            self._by_name[name] = new
            if old.slot:
                self._slots[old.slot] = new
            return new

    def remove(self, name: str) -> Adapter:
        with self._lock:
            adapter = self._require(name)
            del self._by_name[name]
            if adapter.slot:
                self._slots[adapter.slot] = None
            return adapter

    def touch(self, adapter: Adapter, tick: int) -> None:
        adapter.last_used = tick

    def _require(self, name: str) -> Adapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise LoraError(f"adapter {name!r}: is not loaded")
        return adapter
