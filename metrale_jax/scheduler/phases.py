"""The pre-step phases of `plan_tick`, in the seed's order (see the package docstring).

Each phase is a function of the state it needs; `SchedulerCore.plan_tick` calls them in
order and marks each one's telemetry section.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from metrale_jax.scheduler.levers import LeverValues
from metrale_jax.scheduler.policy import AdmissionPolicy
from metrale_jax.scheduler.snapshot import SchedulerSnapshot
from metrale_jax.scheduler.state import Pending
from metrale_jax.sequence import Sequence

if TYPE_CHECKING:
    from metrale_jax.scheduler.core import SchedulerCore

logger = logging.getLogger(__name__)


def drain_pending(pending: Pending, policy: AdmissionPolicy, levers: LeverValues,
                  num_running: int, has_parked: bool) -> list[Sequence]:
    """Phase 1: pick what to admit. Parked sequences resume before new work is admitted."""
    if has_parked:
        return []
    room = levers.max_batch_size - num_running
    if room <= 0 or not pending.queue:
        return []
    picked = policy.order(pending.queue)[:room]
    chosen = set(map(id, picked))
    pending.queue = [s for s in pending.queue if id(s) not in chosen]
    return picked


def gate_admissions(core: "SchedulerCore", new: list[Sequence]) -> list[Sequence]:
    """Phase 2: hold back, in pending, what does not fit; reject what never can."""
    levers = core.levers_now
    pool, bs = core.pool, core.block_size
    usable = pool.num_usable
    watermark = int(levers.admit_watermark * usable)
    # Room: free blocks, plus what phase 7 or allocation can reclaim.
    room = pool.num_free + pool.num_cached
    if levers.swap_enabled and core.spill is not None:
        room += sum(len(s.block_table) for s in core.active if s.grammar_state is None)
    busy = bool(core.active or core.prefilling)
    admitted, held = [], []
    for seq in new:
        if held:  # keep the policy's order: nothing overtakes a held-back sequence
            held.append(seq)
            continue
        prompt_len = len(seq.prompt_ids)
        if prompt_len >= core.max_seq_len:
            core.fail_sequence(seq, f"prompt: {prompt_len} tokens do not fit max_seq_len="
                                    f"{core.max_seq_len}; nothing was truncated")
            continue
        needed = prompt_len // bs + 1
        if core.runner_has_kv and needed > usable:
            core.fail_sequence(seq, f"prompt: {prompt_len} tokens need {needed} KV blocks; "
                                    f"the pool has {usable}")
            continue
        fits = not core.runner_has_kv or room - needed >= watermark or not (busy or admitted)
        if not fits or not core.slots.num_free:
            held.append(seq)
            continue
        room -= needed
        admitted.append(seq)
    core.pending.queue[:0] = held
    return admitted


def build_snapshot(core: "SchedulerCore", new: list[Sequence]) -> SchedulerSnapshot:
    """Phase 4: every field of the seed's snapshot."""
    used, total = core.snapshot_occupancy()
    return SchedulerSnapshot(
        active_seqs=len(core.active), prefilling_seqs=len(core.prefilling),
        swapped_seqs=len(core.swapped) + len(core.preempted), pending_len=len(new),
        waiting_len=len(core.pending.queue), kv_blocks_free=core.pool.num_free,
        kv_blocks_cached=core.pool.num_cached, kv_blocks_total=core.pool.num_usable,
        ssm_slots_used=used, ssm_slots_total=total, mtp_mode="off", delivered_tps=0.0,
        steps_total=core.steps_total, published_at=core.clock.now())


def apply_rotations(core: "SchedulerCore", new: list[Sequence]) -> bool:
    """Phase 5: queued adapter commands run only when nothing is in flight anywhere
    (a parked sequence keeps the adapter it was prefilled under); each is acknowledged."""
    quiet = not (core.active or core.prefilling or new or core.swapped or core.preempted)
    if not quiet or not core.pending.rotations:
        return False
    rotations, core.pending.rotations = core.pending.rotations, []
    for rotation in rotations:
        try:
            result, error = rotation.apply(), None
        except Exception as exc:  # the caller gets the error; the engine keeps serving
            result, error = None, exc
        rotation.ack(result, error)
    return True


def should_shut_down(core: "SchedulerCore", new: list[Sequence], rotated: bool) -> bool:
    """Phase 6: on an idle tick that applied no rotation, poll the inbox without waiting;
    stop once it is closed and every accepted request is finished or answered."""
    idle = not (rotated or new or core.active or core.prefilling or core.swapped
                or core.preempted or core.pending.queue)
    if not idle:
        return False
    core.absorb(core.inbox.recv(wait=False))
    return core.pending.closed and not core.pending.queue and not core.pending.rotations


def swap_out_for_admissions(core: "SchedulerCore", new: list[Sequence],
                            spill_one: Callable[[Sequence], bool]) -> None:
    """Phase 7: make room for each admitted prompt. Reclaim cached prefix blocks first
    (never the prefix this request will reuse; a prompt-logprobs request reuses nothing),
    then spill the active sequence holding the most blocks, grammar-constrained ones
    excluded. A failed spill stops spilling for this tick."""
    if core.spill is None or not core.levers_now.swap_enabled:
        return
    usable = (lambda h: h in core.snapshots) if core.runner.has_ssm else None
    for seq in new:
        reused = [] if seq.params.prompt_logprobs is not None else seq.prompt_ids

        def reclaim() -> int:
            # Spilled blocks with hashes land in the cache list, not the free list: reclaim
            # again after every spill or the loop would spill more than it needs.
            return core.pool.reclaim_prefix_blocks_for(
                reused, seq.adapter_id, len(seq.prompt_ids) // core.block_size + 1,
                usable).target

        target = reclaim()
        while core.pool.num_free < target and core.active:
            candidates = [s for s in core.active if s.grammar_state is None]
            if not candidates:
                logger.warning("no swappable sequences (all grammar-constrained)")
                break
            victim = max(candidates, key=lambda s: len(s.block_table))
            if not spill_one(victim):
                return
            target = reclaim()
