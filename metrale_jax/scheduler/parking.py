"""Parking: sequences taken off the device to make room, and their way back.

Two kinds of parked sequence (together "parked"; the seed's snapshot counts both as
`swapped_seqs`):
  swapped   — KV pages and SSM/conv state spilled through the runner (`jax.device_get`)
              into one checksummed file set; swap-in reads them back into newly allocated
              blocks and a slot, and the sequence continues exactly where it stopped.
  preempted — blocks and slot freed; the sequence recomputes its prompt and outputs so far.
A write that fails leaves the sequence where it was, untouched, and pauses spilling (with a
back-off); a file found corrupt or truncated at swap-in (checksums and sizes, `cache/spill`)
is dropped and the sequence recomputes exactly, like a preempted one. Parked sequences resume
oldest first, before any new work is admitted.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from metrale_jax.cache.spill import SpillBackend, SpillCorrupt, SpillError
from metrale_jax.scheduler.memory import Memory
from metrale_jax.sequence import Sequence, Status
from metrale_jax.telemetry import Clock, Telemetry
from metrale_jax.types import Runner

logger = logging.getLogger(__name__)


def spill_key(seq: Sequence) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{seq.request_id}-{seq.index}-{seq.epoch}")[:128]


@dataclasses.dataclass
class Resumed:
    """What one resume pass brought back (the core puts them in its running lists)."""

    decoding: list[Sequence] = dataclasses.field(default_factory=list)    # swapped in
    prefilling: list[Sequence] = dataclasses.field(default_factory=list)  # recompute


# After a failed spill (a full disk, say) spilling pauses, the pause doubling with each
# failure in a row: retrying at every preemption only repeats the error, and recompute works.
SPILL_BACKOFF_S = (5.0, 300.0)  # first pause, longest pause


class Parking:
    def __init__(self, *, runner: Runner, memory: Memory, spill: SpillBackend | None,
                 tel: Telemetry, clock: Clock):
        self.runner, self.memory, self.spill, self.tel = runner, memory, spill, tel
        self.clock = clock
        self.swapped: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self._failures_in_a_row = 0
        self._paused_until = float("-inf")

    def can_spill(self) -> bool:
        """A spill backend is there and no failure has paused spilling."""
        return self.spill is not None and self.clock.now() >= self._paused_until

    @property
    def parked(self) -> int:
        return len(self.swapped) + len(self.preempted)

    def __bool__(self) -> bool:
        return bool(self.swapped or self.preempted)

    def remove(self, seq: Sequence) -> None:
        for group in (self.swapped, self.preempted):
            if seq in group:
                group.remove(seq)

    # ---- parking --------------------------------------------------------------------------

    def swap_out(self, seq: Sequence) -> bool:
        """Spill one decoding sequence; False (and nothing changed) when the store fails.
        The caller takes it off its running list on True."""
        assert seq.inflight == 0, "settle the pipeline before spilling"
        slot = seq.slot if self.runner.has_ssm else None
        arrays = self.runner.gather(seq.block_table, slot)
        meta = {"request_id": seq.request_id, "index": seq.index,
                "num_computed": seq.num_computed, "blocks": len(seq.block_table)}
        try:
            handle = self.spill.write(spill_key(seq), arrays, meta)
        except (SpillError, OSError) as err:  # OSError: a backend that does not wrap it
            self._pause_after_failure(err)
            return False
        self._failures_in_a_row = 0
        logger.info("swap-out: seq %s/%d (%d tokens, %d blocks) to disk", seq.request_id,
                    seq.index, seq.num_computed, len(seq.block_table))
        seq.spilled_blocks = len(seq.block_table)
        self.memory.release(seq)
        seq.spill = handle
        seq.status = Status.SWAPPED
        self.swapped.append(seq)
        self.tel.count("spills")
        return True

    def _pause_after_failure(self, err: Exception) -> None:
        first, longest = SPILL_BACKOFF_S
        pause = min(first * 2 ** self._failures_in_a_row, longest)
        self._failures_in_a_row += 1
        self._paused_until = self.clock.now() + pause
        self.tel.count("spill_failures")
        logger.error("swap-out failed: %s; spilling paused for %.0f s (preempting by "
                     "recompute meanwhile)", err, pause)

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and slot; it recomputes everything when it resumes.
        The caller has settled the pipeline and taken it off its running list."""
        self.memory.release(seq)
        self._park_for_recompute(seq)
        self.tel.count("preemptions")

    def _park_for_recompute(self, seq: Sequence) -> None:
        """Nothing of the sequence is on the device any more: it restarts from its tokens."""
        seq.num_computed, seq.inflight, seq.block_hashes = 0, 0, []
        seq.epoch += 1
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # scored again with the prompt
        seq.status = Status.PREEMPTED
        self.preempted.append(seq)

    def discard_spill(self, seq: Sequence) -> None:
        if seq.spill is not None:
            self.spill.remove(seq.spill)
            seq.spill = None

    # ---- resuming -------------------------------------------------------------------------

    def resume(self, first_chunk: int) -> Resumed:
        """Parked sequences come back oldest first while there is room."""
        out = Resumed()
        for seq in list(self.swapped):
            if not self._swap_in(seq, out):
                return out
        for seq in list(self.preempted):
            if not self._requeue(seq, first_chunk, out):
                return out
        return out

    def _swap_in(self, seq: Sequence, out: Resumed) -> bool:
        """Bring a swapped sequence back; False when there is no room yet."""
        memory = self.memory
        needed = seq.spilled_blocks
        if not memory.slots.num_free or not memory.make_room(needed + 1):
            return False
        self.swapped.remove(seq)
        try:
            arrays, _ = self.spill.read(seq.spill)
        except (SpillCorrupt, OSError) as err:
            # The tokens are on the host: recompute is exact, so nothing is lost but time.
            logger.warning("swap-in: %s; seq %s/%d recomputes instead", err, seq.request_id,
                           seq.index)
            self.discard_spill(seq)
            self._park_for_recompute(seq)
            self.tel.count("spill_corrupt")
            return True
        blocks = memory.pool.allocate(needed)
        slot = memory.slots.allocate()
        self.runner.scatter(arrays, blocks, slot if self.runner.has_ssm else None)
        self.discard_spill(seq)
        seq.block_table, seq.slot = blocks, slot
        seq.block_hashes = []  # fresh blocks: committed again as they are read back
        seq.status = Status.RUNNING
        out.decoding.append(seq)
        self.tel.count("swap_ins")
        return True

    def _requeue(self, seq: Sequence, first_chunk: int, out: Resumed) -> bool:
        """A preempted sequence restarts as a prefill over its prompt and outputs so far."""
        memory = self.memory
        first = min(seq.virtual_len, first_chunk)
        if not memory.slots.num_free or not memory.make_room(memory.blocks_for(first)):
            return False
        self.preempted.remove(seq)
        seq.slot = memory.slots.allocate()
        seq.status = Status.PREFILLING
        out.prefilling.append(seq)
        return True

    def check_integrity(self) -> None:
        if self.spill is not None:
            spilled = sorted(spill_key(s) for s in self.swapped)
            if sorted(self.spill.keys()) != spilled:
                raise AssertionError(f"spill directory {sorted(self.spill.keys())} != "
                                     f"swapped sequences {spilled}")
