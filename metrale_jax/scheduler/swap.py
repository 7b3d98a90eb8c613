"""Swap-out to disk and the resumption of parked sequences (swapped or preempted).

A spilled sequence's KV pages and SSM/conv state leave the device through the runner
(`jax.device_get`) into one checksummed file set; swap-in reads them back into newly
allocated blocks and a slot, and the sequence continues exactly where it stopped. A write
that fails leaves the sequence active and untouched; a corrupt file fails that request alone.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from metrale_jax.cache.spill import SpillCorrupt, SpillError
from metrale_jax.sequence import Sequence, Status

if TYPE_CHECKING:
    from metrale_jax.scheduler.core import SchedulerCore

logger = logging.getLogger(__name__)


def spill_key(seq: Sequence) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{seq.request_id}-{seq.index}-{seq.epoch}")[:128]


def swap_out(core: "SchedulerCore", seq: Sequence) -> bool:
    """Spill one active sequence; False (and nothing changed) when the store fails."""
    assert seq.inflight == 0, "settle the pipeline before spilling"
    slot = seq.slot if core.runner.has_ssm else None
    arrays = core.runner.gather(seq.block_table, slot)
    meta = {"request_id": seq.request_id, "index": seq.index,
            "num_computed": seq.num_computed, "blocks": len(seq.block_table)}
    try:
        handle = core.spill.write(spill_key(seq), arrays, meta)
    except SpillError as err:
        logger.error("swap-out failed: %s", err)
        core.tel.count("spill_failures")
        return False
    logger.info("swap-out: seq %s/%d (%d tokens, %d blocks) to disk", seq.request_id,
                seq.index, seq.num_computed, len(seq.block_table))
    seq.spilled_blocks = len(seq.block_table)
    core.release_memory(seq)
    seq.spill = handle
    seq.status = Status.SWAPPED
    core.active.remove(seq)
    core.swapped.append(seq)
    core.tel.count("spills")
    return True


def swap_in(core: "SchedulerCore", seq: Sequence) -> bool:
    """Bring a swapped sequence back; False when there is no room yet."""
    needed = seq.spilled_blocks
    if not core.pool.can_allocate(needed + 1) or not core.slots.num_free:
        return False
    core.swapped.remove(seq)
    try:
        arrays, meta = core.spill.read(seq.spill)
    except SpillCorrupt as err:
        core.discard_spill(seq)
        core.fail_sequence(seq, f"swap-in failed, the spilled state is unusable: {err}")
        return True
    blocks = core.pool.allocate(needed)
    slot = core.slots.allocate()
    core.runner.scatter(arrays, blocks, slot if core.runner.has_ssm else None)
    core.discard_spill(seq)
    seq.block_table, seq.slot = blocks, slot
    seq.block_hashes = []  # fresh blocks: committed again as they are read back
    seq.status = Status.RUNNING
    core.active.append(seq)
    core.tel.count("swap_ins")
    return True


def requeue_preempted(core: "SchedulerCore", seq: Sequence) -> bool:
    """A preempted sequence restarts as a prefill over its prompt and outputs so far."""
    first = min(seq.virtual_len, core.levers_now.prefill_chunk_size)
    if not core.pool.can_allocate(-(-first // core.block_size)) or not core.slots.num_free:
        return False
    core.preempted.remove(seq)
    seq.slot = core.slots.allocate()
    seq.status = Status.PREFILLING
    core.prefilling.append(seq)
    return True


def resume_parked(core: "SchedulerCore") -> None:
    """Parked sequences come back oldest first, before any new work is admitted."""
    for seq in list(core.swapped):
        if not swap_in(core, seq):
            return
    for seq in list(core.preempted):
        if not requeue_preempted(core, seq):
            return
