"""SchedulerCore: the state of the tick loop and the tick itself.

`tick()` = `plan_tick()` (the seed's phases, in order) + `run_lanes()` (pack one ragged
batch, dispatch it, process the previous or this step's results). Everything here runs on
the engine thread; other threads talk to it only through the inbox and the levers.
"""

from __future__ import annotations

import itertools
import logging

from metrale_jax.cache.block_pool import BlockPool, SlotPool
from metrale_jax.cache.prefix_hash import ROOT_HASH
from metrale_jax.cache.spill import SpillBackend
from metrale_jax.cache.ssm_snapshots import SnapshotPool
from metrale_jax.runner.model_runner import StepHandle
from metrale_jax.scheduler import phases, swap
from metrale_jax.scheduler.commit import process_step
from metrale_jax.scheduler.inbox import Inbox, Received
from metrale_jax.scheduler.lanes import PackedRow, mark_dispatched, pack_lanes, start_prefills
from metrale_jax.scheduler.levers import Levers, LeverValues
from metrale_jax.scheduler.policy import AdmissionPolicy
from metrale_jax.scheduler.state import Lane, LaneKind, OutputSink, Pending, Request, TickPlan
from metrale_jax.sequence import Sequence, Status
from metrale_jax.telemetry import Clock, Phase, Telemetry

logger = logging.getLogger(__name__)


class SchedulerCore:
    def __init__(self, *, runner, tokenizer, levers: Levers, policy: AdmissionPolicy,
                 clock: Clock, sink: OutputSink, max_seq_len: int, block_size: int,
                 spill: SpillBackend | None = None, snapshot_slots: list[int] | None = None,
                 check_every_tick: bool = False):
        self.runner, self.tokenizer, self.levers, self.policy = runner, tokenizer, levers, policy
        self.clock, self.sink, self.spill = clock, sink, spill
        self.max_seq_len, self.block_size = max_seq_len, block_size
        self.check_every_tick = check_every_tick
        self.tel = Telemetry(clock)
        self.pool = BlockPool(runner.num_blocks, block_size)
        self.slots = SlotPool(runner.num_seq_slots)
        self.snapshots = SnapshotPool(snapshot_slots or [])
        self.inbox = Inbox()
        self.pending = Pending()
        self.active: list[Sequence] = []
        self.prefilling: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.inflight: tuple[StepHandle, list[PackedRow]] | None = None
        self.steps_total = 0
        self.levers_now: LeverValues = levers.get()
        self._order = itertools.count()
        self.runner_has_kv = runner.num_blocks > 1

    # ---- the tick -------------------------------------------------------------------------

    def tick(self) -> bool:
        """One tick; False once the loop should stop (inbox closed, nothing left)."""
        self.levers_now = self.levers.get()  # one consistent reading per tick
        plan = self.plan_tick()
        if plan.shutdown:
            self.settle()
            return False
        self.run_lanes(plan)
        if self.check_every_tick or self.is_idle:
            self.check_integrity()
        return True

    def plan_tick(self) -> TickPlan:
        t = self.clock.now()
        self.absorb(self.inbox.recv(wait=False))
        new = phases.drain_pending(self.pending, self.policy, self.levers_now,
                                   len(self.active) + len(self.prefilling),
                                   bool(self.swapped or self.preempted))
        new = phases.gate_admissions(self, new)
        self.tel.mark(Phase.DRAIN, t)
        if self.inflight and (new or self.prefilling or self.swapped or self.preempted):
            self.settle()
        t = self.clock.now()
        self.steps_total += 1
        self.tel.publish(phases.build_snapshot(self, new))
        self.tel.mark(Phase.SNAPSHOT, t)
        t = self.clock.now()
        rotated = phases.apply_rotations(self, new)
        self.tel.mark(Phase.ROTATIONS, t)
        if phases.should_shut_down(self, new, rotated):
            return TickPlan(lanes=[], shutdown=True)
        t = self.clock.now()
        phases.swap_out_for_admissions(self, new, lambda victim: swap.swap_out(self, victim))
        self.tel.mark(Phase.SWAP_OUT, t)
        return TickPlan(lanes=[Lane(LaneKind.START_PREFILLS, new),
                               Lane(LaneKind.CONTINUE_PREFILLS), Lane(LaneKind.DECODE)])

    def run_lanes(self, plan: TickPlan) -> None:
        t = self.clock.now()
        new = plan.lanes[0].sequences
        # Parked sequences resume on ticks that admit nothing new (drain admits nothing while
        # they wait), never in the tick that parked them to make room for an admission.
        if (self.swapped or self.preempted) and not new:
            swap.resume_parked(self)
        self.tel.mark(Phase.RESUME, t)
        t = self.clock.now()
        start_prefills(self, new)
        if self.inflight and any(s.params.repetition_penalty != 1.0 or s.params.presence_penalty
                                 or s.params.frequency_penalty for s in self.active):
            self.settle()  # penalties need every output token on the host
        packed = pack_lanes(self)
        self.tel.mark(Phase.PACK, t)
        if not packed:
            self.settle()
            return
        t = self.clock.now()
        handle = self.runner.dispatch([p.row for p in packed])
        mark_dispatched(self, packed)
        self.tel.mark(Phase.DISPATCH, t)
        previous, self.inflight = self.inflight, (handle, packed)
        if previous is not None:
            self._process(*previous)
        if not self.levers_now.pipeline_enabled:
            self.settle()

    def settle(self) -> None:
        """Wait for the step running ahead of the host and apply its results."""
        if self.inflight is not None:
            t = self.clock.now()
            inflight, self.inflight = self.inflight, None
            self._process(*inflight)
            self.tel.mark(Phase.SETTLE, t)

    def _process(self, handle: StepHandle, packed: list[PackedRow]) -> None:
        t = self.clock.now()
        process_step(self, handle, packed)
        self.tel.mark(Phase.PROCESS, t)

    # ---- requests in and out --------------------------------------------------------------

    def absorb(self, received: Received) -> None:
        self.pending.absorb(received, self._accept, self.abort)

    def _accept(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for seq in request.sequences:
            seq.order = next(self._order)
            seq.arrival = self.clock.now() if not seq.arrival else seq.arrival

    def emit(self, seq: Sequence) -> None:
        request = self.requests.get(seq.request_id)
        if request is not None:
            self.sink.on_update(request, seq)

    def finish(self, seq: Sequence) -> None:
        """A sequence is done (stop, length, error or abort): free everything it holds."""
        self._remove(seq)
        self.release_memory(seq)
        self.discard_spill(seq)
        seq.status = Status.FINISHED
        request = self.requests.get(seq.request_id)
        if request is None:
            return
        self.sink.on_update(request, seq)
        # Released, not just flagged: a sibling that stopped in the same step is reported
        # before the request is.
        if all(s.status is Status.FINISHED for s in request.sequences):
            del self.requests[request.request_id]
            self.sink.on_finished(request)

    def fail_sequence(self, seq: Sequence, message: str) -> None:
        """Answer the whole request with an error; everyone else keeps being served."""
        logger.warning("request %s failed: %s", seq.request_id, message)
        request = self.requests.get(seq.request_id)
        for s in request.sequences if request else [seq]:
            if not s.finished:
                s.error, s.finish_reason = message, "error"
                self.finish(s)

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return  # finished already, or never accepted: nothing to do
        for seq in request.sequences:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.finish(seq)

    def _remove(self, seq: Sequence) -> None:
        for group in (self.active, self.prefilling, self.swapped, self.preempted,
                      self.pending.queue):
            if seq in group:
                group.remove(seq)

    # ---- memory -------------------------------------------------------------------------

    def release_memory(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.release(seq.block_table)
            seq.block_table = []
        if seq.slot:
            self.slots.free(seq.slot)
            seq.slot = 0

    def discard_spill(self, seq: Sequence) -> None:
        if seq.spill is not None:
            self.spill.remove(seq.spill)
            seq.spill = None

    def commit_blocks(self, seq: Sequence) -> int:
        """Offer the sequence's newly full blocks to the prefix cache: only blocks whose KV
        is computed and whose tokens are all read back."""
        known = min(seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids))
        bs, ids, added = self.block_size, None, 0
        while (len(seq.block_hashes) + 1) * bs <= known:
            ids = ids or seq.all_ids
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(self.pool.commit_block(
                seq.block_table[i], parent if parent is not None else ROOT_HASH,
                ids[i * bs:(i + 1) * bs], seq.adapter_id))
            added += 1
        return added

    def make_room(self, seq: Sequence, in_batch: set[int]) -> bool:
        """A decode found no free block: spill (when on) or preempt another sequence."""
        self.settle()
        victims = [s for s in self.active + self.prefilling
                   if s is not seq and id(s) not in in_batch and not s.finished]
        if not victims:
            return False
        if self.spill is not None and self.levers_now.swap_enabled:
            spillable = [s for s in victims if s.status is Status.RUNNING
                         and s.grammar_state is None]
            if spillable and swap.swap_out(self, max(spillable, key=lambda s: len(s.block_table))):
                return True
        self.preempt(max(victims, key=lambda s: s.order))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and slot; it recomputes everything when it resumes."""
        self.settle()
        self._remove(seq)
        self.release_memory(seq)
        seq.num_computed, seq.inflight, seq.block_hashes = 0, 0, []
        seq.epoch += 1
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # scored again with the prompt
        seq.status = Status.PREEMPTED
        self.preempted.append(seq)
        self.tel.count("preemptions")

    # ---- views --------------------------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        return not (self.active or self.prefilling or self.swapped or self.preempted
                    or self.pending.queue or self.inflight)

    @property
    def has_work(self) -> bool:
        return not self.is_idle

    def snapshot_occupancy(self) -> tuple[int, int]:
        return self.snapshots.used, self.snapshots.total

    def live_sequences(self) -> list[Sequence]:
        return self.active + self.prefilling

    def check_integrity(self) -> None:
        """No block owned twice, pool books balanced, slots and spill files accounted for."""
        live = self.live_sequences()
        self.pool.check_integrity({id(s): s.block_table for s in live})
        held = [s.slot for s in live if s.slot]
        if len(set(held)) != len(held) or self.slots.num_free + len(held) != \
                self.slots.num_slots - 1:
            raise AssertionError(f"SSM slots out of balance: held {sorted(held)}, "
                                 f"{self.slots.num_free} free of {self.slots.num_slots - 1}")
        if self.spill is not None:
            spilled = sorted(swap.spill_key(s) for s in self.swapped)
            if sorted(self.spill.keys()) != spilled:
                raise AssertionError(f"spill directory {sorted(self.spill.keys())} != "
                                     f"swapped sequences {spilled}")

