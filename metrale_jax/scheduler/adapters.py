"""The adapter cohort (phase 2) and the rotations (phase 5) of the tick, for multi-LoRA.

The rules, and why:
  * Slots change only at a quiescent tick (nothing active, prefilling, newly admitted,
    swapped or preempted). So a running or parked sequence always finds, in the slot it was
    admitted with, the weights it started with: a spilled or preempted sequence resumes
    under the same adapter version even when a replace of that adapter was queued while it
    was parked, because the replace waits for it. (Loading into another slot instead would
    need a second copy of one name's weights live at once; waiting is simpler and rare.)
  * Admission binds a sequence to its adapter's current version and slot
    (`Sequence.adapter_id`, `adapter_slot`); they never change while it lives.
  * The cohort gate admits only sequences whose adapter holds a slot. Slots never change
    between quiescent ticks, so the distinct adapters running never exceed `max_loras`.
  * A sequence whose adapter is registered but has no slot waits in pending and makes the
    adapter "wanted". A wanted load, like a queued rotation, lets other work be admitted for
    `rotation_hold_ticks` ticks (`RotationHold`), then holds all new work so the engine
    drains; at the quiescent tick the head of the waiting queue gets its adapters loaded
    (evicting the least recently used adapters it does not need), and the tick after a
    rotation always admits. So the oldest waiting request is admitted within
    `rotation_hold_ticks` + (the drain of what ran when the hold began) + 2 ticks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

from metrale_jax.lora.registry import Adapter, AdapterRegistry
from metrale_jax.lora.weights import LoraError
from metrale_jax.scheduler.state import LoadAdapter, UnloadAdapter
from metrale_jax.sequence import Sequence
from metrale_jax.types import Runner

logger = logging.getLogger(__name__)


class RotationHold:
    """When admission stops so queued rotations can run (see the module docstring)."""

    def __init__(self) -> None:
        self.since: int | None = None    # tick the current wait for a rotation began
        self.rotated_at = -2             # tick of the last rotation round

    def holds(self, tick: int, waiting_rotation: bool, quiet: bool, hold_ticks: int) -> bool:
        if not waiting_rotation:
            self.since = None
            return False
        if self.since is None:
            self.since = tick
        if self.rotated_at == tick - 1:
            return False  # the cohort a rotation just loaded is admitted first
        return quiet or tick - self.since >= hold_ticks

    def rotated(self, tick: int) -> None:
        self.rotated_at, self.since = tick, None


class AdapterCohort:
    def __init__(self, registry: AdapterRegistry | None, runner: Runner):
        self.registry, self.runner = registry, runner

    @property
    def max_loras(self) -> int:
        return self.registry.max_loras if self.registry is not None else 0

    # ---- phase 2 --------------------------------------------------------------------------

    def ready(self, seq: Sequence) -> bool:
        """May this sequence be admitted now: the base model, or its adapter has a slot."""
        if seq.lora_name is None:
            return True
        adapter = self.registry.get(seq.lora_name) if self.registry is not None else None
        return adapter is not None and adapter.slot > 0

    def lost(self, waiting: Seq[Sequence]) -> list[tuple[Sequence, str]]:
        """Waiting sequences whose adapter was unloaded after they were accepted."""
        return [(s, f"lora: adapter {s.lora_name!r} was unloaded before the request ran")
                for s in waiting if s.lora_name is not None
                and (self.registry is None or s.lora_name not in self.registry)]

    def wanted(self, ordered: Seq[Sequence]) -> list[str]:
        """Registered adapters with no slot that waiting sequences need, oldest need first."""
        names: list[str] = []
        for seq in ordered:
            name = seq.lora_name
            if name is not None and name not in names and not self.ready(seq) \
                    and name in self.registry:
                names.append(name)
        return names

    def bind(self, seq: Sequence, tick: int) -> None:
        """Admission: the sequence keeps this adapter version and slot for its life."""
        if seq.lora_name is None:
            seq.adapter_id = seq.adapter_slot = 0
            return
        adapter = self.registry.get(seq.lora_name)
        seq.adapter_id, seq.adapter_slot = adapter.version, adapter.slot
        self.registry.touch(adapter, tick)

    # ---- phase 5 (quiescent ticks only) ---------------------------------------------------

    def apply(self, command: LoadAdapter | UnloadAdapter) -> str:
        if self.registry is None:
            raise LoraError("LoRA is not enabled on this engine")
        if isinstance(command, UnloadAdapter):
            adapter = self.registry.get(command.name)
            if adapter is None:
                raise LoraError(f"adapter {command.name!r}: is not loaded")
            if adapter.slot:
                self.runner.unload_adapter(adapter.slot)
            self.registry.remove(command.name)
            return f"unloaded {command.name}"
        if command.replace and command.name in self.registry:
            return self._replace(command)
        adapter = self.registry.register(command.name, command.path, command.weights,
                                         command.int_id)
        try:
            self._load(adapter, keep=())
        except BaseException:
            self.registry.remove(adapter.name)  # the caller hears of it; nothing stays
            raise
        return f"loaded {command.name} into slot {adapter.slot}"

    def _replace(self, command: LoadAdapter) -> str:
        old = self.registry.get(command.name)
        if old.slot:
            try:
                self.runner.load_adapter(old.slot, command.weights)
            except BaseException:
                self._forget_slot(old.slot)
                raise
        self.registry.replace(command.name, command.path, command.weights)
        return f"replaced {command.name}"

    def load_cohort(self, ordered_waiting: Seq[Sequence]) -> list[tuple[str, BaseException]]:
        """Load the adapters the head of the waiting queue needs: walking it in admission
        order, up to `max_loras` distinct adapters (resident ones count), evicting least
        recently used adapters outside that cohort. Returns the loads that failed."""
        if self.registry is None:
            return []
        cohort: list[str] = []
        for seq in ordered_waiting:
            name = seq.lora_name
            if name is not None and name not in cohort and name in self.registry:
                if len(cohort) == self.max_loras:
                    break
                cohort.append(name)
        failed = []
        for name in cohort:
            adapter = self.registry.get(name)
            if adapter.slot:
                continue
            try:
                self._load(adapter, keep=cohort)
            except Exception as exc:  # noqa: BLE001 - its waiting requests get the error
                logger.error("loading adapter %r failed: %s", name, exc)
                failed.append((name, exc))
        return failed

    def _load(self, adapter: Adapter, keep: Seq[str]) -> None:
        slot = self.registry.choose_slot(keep)
        if slot is None:
            raise LoraError(f"adapter {adapter.name!r}: every one of the {self.max_loras} "
                            f"slots holds an adapter in use")
        try:
            self.runner.load_adapter(slot, adapter.weights)
        except BaseException:
            self._forget_slot(slot)
            raise
        evicted = self.registry.place(adapter, slot)
        if evicted is not None:
            logger.info("adapter %r evicted from slot %d for %r", evicted.name, slot,
                        adapter.name)

    def _forget_slot(self, slot: int) -> None:
        """A failed load may have left the slot half written: nothing may run on it."""
        self.registry.vacate(slot)

    # ---- views ----------------------------------------------------------------------------

    def view(self, running: Seq[Sequence], waiting: Seq[Sequence], rotations: int,
             ) -> dict:
        """The snapshot's LoRA fields."""
        if self.registry is None:
            return {}
        counts: dict[str, int] = {}
        for seq in running:
            if seq.lora_name is not None:
                counts[seq.lora_name] = counts.get(seq.lora_name, 0) + 1
        waiting_names = dict.fromkeys(s.lora_name for s in waiting if s.lora_name is not None)
        return {"max_loras": self.max_loras,
                "lora_loaded": tuple(a.name for a in self.registry.resident()),
                "lora_running": tuple(sorted(counts.items())),
                "lora_waiting": tuple(waiting_names),
                "rotations_waiting": rotations}

