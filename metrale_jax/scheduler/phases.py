"""The pre-step phases of `plan_tick`, in the seed's order (see the package docstring).

Each phase is a function of the parts it needs, never of the core; `SchedulerCore.plan_tick`
calls them in order, marks each one's telemetry section, and acts on what they return
(a rejected prompt is answered by the core, which owns the requests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from metrale_jax.scheduler.levers import LeverValues
from metrale_jax.scheduler.memory import Memory
from metrale_jax.scheduler.policy import AdmissionPolicy
from metrale_jax.scheduler.snapshot import SchedulerSnapshot
from metrale_jax.scheduler.state import Pending
from metrale_jax.sequence import Sequence
from metrale_jax.spec.gate import MtpGate

logger = logging.getLogger(__name__)


def drain_pending(pending: Pending, policy: AdmissionPolicy, levers: LeverValues,
                  num_running: int, has_parked: bool, hold: bool = False,
                  ready: Callable[[Sequence], bool] | None = None) -> list[Sequence]:
    """Phase 1: pick what to admit. Parked sequences resume before new work is admitted,
    and nothing is admitted while queued rotations hold admission (`adapters.RotationHold`).
    Only sequences `ready` are picked: the adapter-cohort rule of phase 2 (a sequence whose
    adapter has no device slot waits, without holding back those behind it)."""
    if has_parked or hold:
        return []
    room = levers.max_batch_size - num_running
    if room <= 0 or not pending.waiting:
        return []
    ordered = policy.order(pending.waiting)
    picked = [s for s in ordered if ready(s)][:room] if ready is not None else ordered[:room]
    chosen = set(map(id, picked))
    pending.waiting = [s for s in pending.waiting if id(s) not in chosen]
    return picked


def gate_admissions(new: list[Sequence], *, pending: Pending, memory: Memory,
                    levers: LeverValues, spillable_blocks: int, busy: bool,
                    max_seq_len: int) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
    """Phase 2: hold back, in pending, what does not fit; reject what never can.
    Returns (admitted, rejected with the reason)."""
    pool = memory.pool
    usable = pool.num_usable
    watermark = int(levers.admit_watermark * usable)
    # Room: free blocks, plus what phase 7 or allocation can reclaim.
    room = memory.reclaimable + spillable_blocks
    admitted, held, rejected = [], [], []
    for seq in new:
        if held:  # keep the policy's order: nothing overtakes a held-back sequence
            held.append(seq)
            continue
        prompt_len = len(seq.prompt_ids)
        if prompt_len >= max_seq_len:  # the front checks this too; the scheduler keeps its guard
            rejected.append((seq, f"prompt: {prompt_len} tokens do not fit max_seq_len="
                                  f"{max_seq_len}; nothing was truncated"))
            continue
        needed = memory.prompt_blocks(seq)
        if memory.has_kv and needed > usable:
            rejected.append((seq, f"prompt: {prompt_len} tokens need {needed} KV blocks; "
                                  f"the pool has {usable}"))
            continue
        fits = not memory.has_kv or room - needed >= watermark or not (busy or admitted)
        if not fits or not memory.slots.num_free:
            held.append(seq)
            continue
        room -= needed
        admitted.append(seq)
    pending.waiting[:0] = held
    return admitted, rejected


def build_snapshot(*, active: list[Sequence], prefilling: list[Sequence], num_parked: int,
                   new: list[Sequence], pending: Pending, memory: Memory, num_requests: int,
                   steps_total: int, now: float, gate: MtpGate | None = None,
                   lora: dict | None = None, sessions=None) -> SchedulerSnapshot:
    """Phase 4: every field of the seed's snapshot, plus the live counts the server reads.
    `mtp_mode` and `delivered_tps` are the MTP gate's (`observe()`); off without one."""
    pool = memory.pool
    stats = pool.stats
    mtp_mode, delivered = gate.observe() if gate is not None else ("off", 0.0)
    return SchedulerSnapshot(
        active_seqs=len(active), prefilling_seqs=len(prefilling), swapped_seqs=num_parked,
        pending_len=len(new), waiting_len=len(pending.waiting), kv_blocks_free=pool.num_free,
        kv_blocks_cached=pool.num_cached, kv_blocks_total=pool.num_usable,
        ssm_slots_used=memory.snapshots.used, ssm_slots_total=memory.snapshots.total,
        mtp_mode=str(getattr(mtp_mode, "value", mtp_mode)), delivered_tps=float(delivered),
        steps_total=steps_total, published_at=now,
        requests_len=num_requests, prefix_query_tokens=stats.prefix_query_tokens,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        sessions_open=len(sessions) if sessions is not None else 0,
        session_pinned_blocks=sessions.pinned_blocks if sessions is not None else 0,
        **(lora or {}))


def apply_rotations(pending: Pending, quiet: bool,
                    apply: Callable[[object], object] | None = None,
                    cohort_round: Callable[[], bool] | None = None) -> bool:
    """Phase 5: queued adapter commands run only when nothing is in flight anywhere
    (`quiet`: a parked sequence keeps the adapter it was prefilled under); each is
    acknowledged exactly once, in arrival order. `apply` runs a typed command (a generic
    `Rotation` runs its own `apply`); then `cohort_round` loads the adapters waiting
    requests need. True when anything ran."""
    if not quiet:
        return False
    rotations, pending.rotations = pending.rotations, []
    for rotation in rotations:
        try:
            run = getattr(rotation, "apply", None)
            result, error = (run() if callable(run) else apply(rotation)), None
        except Exception as exc:  # the caller gets the error; the engine keeps serving
            result, error = None, exc
        rotation.ack(result, error)
    loaded = cohort_round() if cohort_round is not None else False
    return bool(rotations) or loaded


def should_shut_down(pending: Pending, idle: bool, poll: Callable[[], None]) -> bool:
    """Phase 6: on an idle tick that applied no rotation, poll the inbox without waiting;
    stop once it is closed and every accepted request is finished or answered."""
    if not idle:
        return False
    poll()
    return pending.closed and not pending.waiting and not pending.rotations


def swap_out_for_admissions(new: list[Sequence], *, active: list[Sequence], memory: Memory,
                            spill_one: Callable[[Sequence], bool]) -> None:
    """Phase 7 (spilling on): make room for each admitted prompt. Reclaim cached prefix
    blocks first (never the prefix this request will reuse), then spill the active sequence
    holding the most blocks, grammar-constrained ones excluded. A failed spill stops
    spilling for this tick."""
    for seq in new:
        # Spilled blocks with hashes land in the cache list, not the free list: reclaim
        # again after every spill or the loop would spill more than it needs.
        target = memory.reclaim_for(seq)
        while memory.pool.num_free < target and active:
            candidates = [s for s in active if s.grammar_state is None]
            if not candidates:
                logger.warning("no swappable sequences (all grammar-constrained)")
                break
            victim = max(candidates, key=lambda s: len(s.block_table))
            if not spill_one(victim):
                return
            target = memory.reclaim_for(seq)
