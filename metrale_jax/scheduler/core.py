"""SchedulerCore: the tick loop's running lists and requests, orchestrating its parts.

Parts that own their state: `Memory` (block pool, SSM slots, snapshots), `Parking` (swapped
and preempted sequences, the spill backend), `Pending` (waiting sequences, queued rotations)
and the `Inbox`. Phase functions (`phases`), packing (`lanes`) and reading results back
(`commit`) take the parts they need and return what happened; only the core moves sequences
between lists, settles the pipeline (`settle.must_settle`) and reports to the sink.

`tick()` = `plan_tick()` (the seed's phases, in order) + `run_lanes()` (the plain or the
overlapped variant, side by side). `run()` is the engine thread's loop. Everything here runs
on the engine thread; other threads talk to it only through the inbox, the levers and the
published snapshot.
"""

from __future__ import annotations

import itertools
import logging

from metrale_jax.cache.spill import SpillBackend
from metrale_jax.cache.tiers import StateTier
from metrale_jax.scheduler.prefix_tier import PrefixTier
from metrale_jax.lora.registry import AdapterRegistry
from metrale_jax.request import Request
from metrale_jax.scheduler import phases
from metrale_jax.scheduler.adapters import AdapterCohort, RotationHold
from metrale_jax.scheduler.commit import Committed, commit_step
from metrale_jax.scheduler.faults import EngineFailed, StepFailures
from metrale_jax.scheduler.inbox import Inbox, Received
from metrale_jax.scheduler.lanes import PackedRow, mark_dispatched, pack_lanes
from metrale_jax.scheduler.levers import Levers, LeverValues
from metrale_jax.scheduler.memory import Memory
from metrale_jax.scheduler.parking import Parking
from metrale_jax.scheduler.policy import AdmissionPolicy
from metrale_jax.scheduler.sessions import CloseSession, SessionConfig, Sessions
from metrale_jax.scheduler.settle import must_settle
from metrale_jax.scheduler.speculation import SpeculationChoice
from metrale_jax.scheduler.state import OutputSink, Pending, TickPlan
from metrale_jax.sequence import Sequence, Status
from metrale_jax.spec.gate import MtpGate
from metrale_jax.telemetry import Clock, Phase, Telemetry
from metrale_jax.types import Runner, StepHandle

logger = logging.getLogger(__name__)


class SchedulerCore:
    def __init__(self, *, runner: Runner, levers: Levers, policy: AdmissionPolicy,
                 clock: Clock, sink: OutputSink, max_seq_len: int, block_size: int,
                 spill: SpillBackend | None = None, snapshot_slots: list[int] | None = None,
                 check_every_tick: bool = False, gate: MtpGate | None = None,
                 adapters: AdapterRegistry | None = None,
                 sessions: SessionConfig | None = None, tier: StateTier | None = None,
                 prefix_tier: StateTier | None = None):
        self.runner, self.levers, self.policy = runner, levers, policy
        # Speculative decoding: the gate picks the plain or the speculative step per tick.
        self.gate = gate
        self.mode = SpeculationChoice(gate) if gate is not None else None
        self.spec_depth = runner.spec_depth if gate is not None else 0
        self.clock, self.sink = clock, sink
        self.max_seq_len, self.block_size = max_seq_len, block_size
        self.check_every_tick = check_every_tick
        self.tel = Telemetry(clock)
        self.memory = Memory(num_blocks=runner.num_blocks, block_size=block_size,
                             num_seq_slots=runner.num_seq_slots,
                             snapshot_slots=snapshot_slots or [], has_ssm=runner.has_ssm,
                             copy_slots=runner.copy_slots)
        # Multi-turn sessions keep their latest turn pinned (`sessions`); they give it
        # back when memory runs short, to the second tier (`tier`: host RAM, then disk).
        self.sessions = Sessions(sessions or SessionConfig(), self.memory, clock, self.tel,
                                 runner=runner, tier=tier)
        self.memory.pins = self.sessions
        # Evicted prefix blocks and SSM snapshots go to `prefix_tier` and come back on a hit.
        if prefix_tier is not None and prefix_tier.enabled:
            self.memory.attach_tier(PrefixTier(prefix_tier, runner, self.tel))
        self.parking = Parking(runner=runner, memory=self.memory, spill=spill, tel=self.tel,
                               clock=clock)
        self.inbox = Inbox()
        # Multi-LoRA: which adapter holds which slot (None: LoRA off) and the hold that
        # lets queued rotations reach a quiescent tick.
        self.cohort = AdapterCohort(adapters, runner)
        self.rotation_hold = RotationHold()
        self.pending = Pending()
        self.active: list[Sequence] = []       # decoding
        self.prefilling: list[Sequence] = []   # prompt (or a recompute) partly in the caches
        self.requests: dict[str, Request] = {}
        # The step dispatched and not yet read back (pipeline on), with its rows.
        self.inflight: tuple[StepHandle, list[PackedRow]] | None = None
        self.steps_total = 0                   # ticks (the seed's name), idle ones included
        self.failures = StepFailures()         # failed steps in a row (`faults`)
        self.halted: str | None = None         # why the loop stops after failed steps
        self._halt_done = False
        self.levers_now: LeverValues = levers.get()
        self._order = itertools.count()
        self._speculating = False              # this tick runs the speculative step
        self._ahead = False                    # ...its decodes packed before the one ahead

    # ---- the loop and the tick ------------------------------------------------------------

    def run(self, wait: float | None = 0.5) -> None:
        """Tick until the inbox closes and nothing is left. When idle, publish a fresh
        snapshot and block on the inbox for up to `wait` seconds instead of spinning."""
        while self.tick():
            if self.is_idle:
                self.publish_snapshot()
                self.absorb(self.inbox.recv(wait=True, timeout=wait))

    def tick(self) -> bool:
        """One tick; False once the loop should stop (inbox closed, nothing left, or the
        engine halted after repeated step failures)."""
        if self.halted is not None:
            self._halt()
            return False
        self.levers_now = self.levers.get()  # one consistent reading per tick
        plan = self.plan_tick()
        if plan.shutdown:
            self._settle_if(stopping=True)
            return False
        if self.halted is None:  # a step read back while planning may have decided a halt
            self.run_lanes(plan)
        if self.halted is not None:
            self._halt()
            return False
        if self.check_every_tick or self.is_idle:
            self.check_integrity()
        return True

    def plan_tick(self) -> TickPlan:
        t, tick = self.clock.now(), self.steps_total
        self.absorb(self.inbox.recv(wait=False))
        self.sessions.expire()
        hold = self._rotation_holds(tick)
        new = phases.drain_pending(self.pending, self.policy, self.levers_now,
                                   len(self.active) + len(self.prefilling), bool(self.parking),
                                   hold=hold, ready=self.cohort.ready)
        new = self._gate(new)
        for seq in new:
            self.cohort.bind(seq, tick)
        self.tel.mark(Phase.DRAIN, t)
        self._settle_if(batch_changes=bool(new or self.prefilling or self.parking))
        t = self.clock.now()
        self.steps_total += 1
        self.publish_snapshot(new)
        self.tel.mark(Phase.SNAPSHOT, t)
        t = self.clock.now()
        busy = bool(self.active or self.prefilling or new or self.parking)
        rotated = phases.apply_rotations(self.pending, quiet=not busy,
                                         apply=self.cohort.apply,
                                         cohort_round=self._load_cohort)
        if rotated:
            self.rotation_hold.rotated(tick)
        self.tel.mark(Phase.ROTATIONS, t)
        idle = not (rotated or busy or self.pending.waiting)
        if phases.should_shut_down(self.pending, idle, self._poll_inbox):
            return TickPlan(shutdown=True)
        t = self.clock.now()
        if self.levers_now.swap_enabled and self.parking.can_spill():
            phases.swap_out_for_admissions(new, active=self.active, memory=self.memory,
                                           spill_one=self._swap_out)
        self.tel.mark(Phase.SWAP_OUT, t)
        return TickPlan(admitted=new)

    def run_lanes(self, plan: TickPlan) -> None:
        self._speculating = self._choose_speculation(plan)
        # A row's length after a speculative step depends on how many drafts it accepted:
        # the host reads that back first, unless every decode can run ahead of it (the
        # device then starts each row where its accepted drafts end).
        ahead_speculative = self.inflight is not None and self.inflight[0].speculative
        self._ahead = self._runs_ahead()
        self._settle_if(speculative=(self._speculating or ahead_speculative)
                        and not self._ahead)
        if self.levers_now.pipeline_enabled:
            self._overlap_lanes(plan)
        else:
            self._normal_lanes(plan)

    def _normal_lanes(self, plan: TickPlan) -> None:
        """Plain: dispatch this tick's batch and read it back before the tick ends."""
        self._settle_if(pipeline=False)  # a step left by the pipelined variant, if any
        self._prepare_lanes(plan)
        packed = self._pack()
        handle = self._dispatch(packed) if packed else None
        if handle is not None:
            self.inflight = (handle, packed)
        self._settle_if(pipeline=False)

    def _overlap_lanes(self, plan: TickPlan) -> None:
        """Pipelined: dispatch this tick's batch, then read back the previous one while the
        device works."""
        self._prepare_lanes(plan)
        self._settle_if(penalties=any(s.params.repetition_penalty != 1.0
                                      or s.params.presence_penalty
                                      or s.params.frequency_penalty for s in self.active))
        self._settle_if(grammar=any(s.grammar_state is not None for s in self.active))
        packed = self._pack()
        if not packed:
            self._settle_if(empty_batch=True)
            return
        handle = self._dispatch(packed)
        if handle is None:
            return  # the step failed; the one running ahead (if any) is read back later
        previous, self.inflight = self.inflight, (handle, packed)
        if previous is not None:
            self._process(*previous)

    def drain(self) -> None:
        """Read back the step running ahead, if any (callers that stop ticking)."""
        self._settle_if(stopping=True)
        if self.halted is not None:
            self._halt()

    # ---- the pieces of a tick ---------------------------------------------------------------

    def _gate(self, new: list[Sequence]) -> list[Sequence]:
        spillable = 0
        if self.levers_now.swap_enabled and self.parking.can_spill():
            spillable = sum(len(s.block_table) for s in self.active if s.grammar_state is None)
        admitted, rejected = phases.gate_admissions(
            new, pending=self.pending, memory=self.memory, levers=self.levers_now,
            spillable_blocks=spillable, busy=bool(self.active or self.prefilling),
            max_seq_len=self.max_seq_len)
        for seq, reason in rejected:
            self.fail_sequence(seq, reason)
        return admitted

    # ---- adapters and rotations (`adapters`) ---------------------------------------------

    def _rotation_holds(self, tick: int) -> bool:
        """Phase 1's input: hold new work so queued rotations reach quiescence? Waiting
        sequences whose adapter was unloaded meanwhile are answered here."""
        for seq, reason in self.cohort.lost(self.pending.waiting):
            if not seq.finished:
                self.fail_sequence(seq, reason)
        wanted = self.cohort.wanted(self.pending.waiting) if self.cohort.registry else []
        quiet = not (self.active or self.prefilling or self.parking)
        return self.rotation_hold.holds(tick, bool(self.pending.rotations or wanted), quiet,
                                        self.levers_now.rotation_hold_ticks)

    def _load_cohort(self) -> bool:
        """Phase 5, after the queued commands: load the adapters the head of the waiting
        queue needs; requests waiting for an adapter that failed to load get the error."""
        if self.cohort.registry is None:
            return False
        ordered = self.policy.order(self.pending.waiting)
        if not self.cohort.wanted(ordered):
            return False
        for name, exc in self.cohort.load_cohort(ordered):
            for seq in [s for s in self.pending.waiting if s.lora_name == name]:
                if not seq.finished:
                    self.fail_sequence(seq, f"lora: adapter {name!r} could not be loaded: "
                                            f"{exc}")
        return True

    def _prepare_lanes(self, plan: TickPlan) -> None:
        """Resume parked sequences, then start the admitted prefills."""
        t = self.clock.now()
        # Parked sequences resume on ticks that admit nothing new (drain admits nothing while
        # they wait), never in the tick that parked them to make room for an admission.
        if self.parking and not plan.admitted:
            resumed = self.parking.resume(self.levers_now.prefill_chunk_size)
            self.active.extend(resumed.decoding)
            self.prefilling.extend(resumed.prefilling)
        self.tel.mark(Phase.RESUME, t)
        reuse = self.levers_now.prefix_cache_enabled
        for seq in plan.admitted:  # StartPrefills
            # A prompt-logprobs request needs every position scored: it reuses nothing.
            self.memory.admit(seq, reuse and seq.params.prompt_logprobs is None)
            seq.status = Status.PREFILLING
            self.prefilling.append(seq)

    def _choose_speculation(self, plan: TickPlan) -> bool:
        """Phase 8's mode (the seed's gate): speculate this tick?"""
        if self.mode is None:
            return False
        return self.mode.choose(self.levers_now.mtp_policy, self.runner.speculation_ready,
                                self.active, self.prefilling, plan.admitted)

    def _runs_ahead(self) -> bool:
        """Whether this speculative tick's decodes are packed before the speculative step
        ahead is read back: the pipeline is on, nothing but decodes would run, and each
        of them can (`Sequence.can_run_ahead`)."""
        if not (self._speculating and self.levers_now.pipeline_enabled
                and self.inflight is not None and self.inflight[0].speculative):
            return False
        decoding = [s for s in self.active
                    if s.status is Status.RUNNING and s.may_sample_more()]
        return (bool(decoding) and not self.prefilling
                and all(s.can_run_ahead(self.spec_depth) for s in decoding))

    def _pack(self) -> list[PackedRow]:
        """Pack one batch; when a decode finds no block, settle, make room and pack again."""
        t = self.clock.now()
        no_room: set[int] = set()
        depth = self.spec_depth if self._speculating else 0
        while True:
            packing = pack_lanes(self.active, self.prefilling, self.memory, self.levers_now,
                                 no_room, depth,
                                 ahead=self._ahead and self.inflight is not None)
            if packing.needs_room is None:
                break
            self._settle_if(needs_room=True)
            if packing.needs_room not in self.active:
                continue  # the settled step failed: it was failed or recomputes now
            if not self._make_room(packing.needs_room, {id(p.seq) for p in packing.rows}):
                no_room.add(id(packing.needs_room))
        if packing.starved is not None:
            self.preempt(packing.starved)
        self.tel.mark(Phase.PACK, t)
        return packing.rows

    def _dispatch(self, packed: list[PackedRow]) -> StepHandle | None:
        """Start the step; None when it failed (its requests were failed)."""
        t = self.clock.now()
        try:
            if self._speculating:
                handle = self.runner.dispatch([p.row for p in packed], speculative=True)
            else:
                handle = self.runner.dispatch([p.row for p in packed])
        except Exception as exc:  # noqa: BLE001 - contained: fails this step's requests
            self._step_failed(exc, packed, "dispatch")
            return None
        handle.dispatched_at = t
        handle.decoding = self.mode.sample_batch if self.mode is not None else 0
        for seq in mark_dispatched(packed, self.memory):
            self.prefilling.remove(seq)
            self.active.append(seq)
        self.tel.mark(Phase.DISPATCH, t)
        return handle

    def _settle_if(self, **reasons: bool) -> None:
        if self.inflight is not None and must_settle(
                **{"pipeline": self.levers_now.pipeline_enabled, **reasons}):
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
        try:
            results = self.runner.collect(handle)
        except Exception as exc:  # noqa: BLE001 - contained: fails this step's requests
            self._step_failed(exc, packed, "collect")
            return
        self.failures.succeeded()
        committed = commit_step(results, packed, self.memory,
                                self.spec_depth if handle.speculative else 0)
        self._measure(handle, committed)
        for seq in committed.touched:
            if seq.finished:
                self.finish(seq)
            else:
                self.emit(seq)
        self.tel.mark(Phase.PROCESS, t)

    def _measure(self, handle: StepHandle, committed: Committed) -> None:
        """Feed the gate delivered tokens/s, and count drafts for /metrics."""
        now = self.clock.now()
        if handle.speculative:
            self.tel.count("spec_decode_num_drafts", sum(1 for p in handle.rows
                                                         if p.num_drafts))
            self.tel.count("spec_decode_num_draft_tokens", sum(committed.drafted))
            self.tel.count("spec_decode_num_accepted_tokens", sum(committed.accepted))
            for d, (n, m) in enumerate(zip(committed.accepted, committed.drafted)):
                self.tel.count(f"spec_decode_num_accepted_tokens_per_pos_{d}", n)
                self.tel.count(f"spec_decode_num_drafts_per_pos_{d}", m)
        if self.mode is not None:
            self.mode.record(handle, committed.tokens, committed.accepted, committed.drafted,
                             now)

    # ---- requests in and out --------------------------------------------------------------

    def absorb(self, received: Received) -> None:
        commands = [i for i in received.items if isinstance(i, CloseSession)]
        if commands:
            received.items = [i for i in received.items if not isinstance(i, CloseSession)]
        self.pending.absorb(received, self._accept, self.abort)
        for command in commands:  # host books only: safe whatever runs on the device
            command.ack(self.sessions.close(command.session_id), None)

    def _poll_inbox(self) -> None:
        self.absorb(self.inbox.recv(wait=False))

    def _accept(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for seq in request.sequences:
            seq.order = next(self._order)
            seq.arrival = self.clock.now() if not seq.arrival else seq.arrival
            if seq.session_id is not None:
                self.sessions.accept(seq)

    def emit(self, seq: Sequence) -> None:
        request = self.requests.get(seq.request_id)
        if request is not None:
            self.sink.on_update(request, seq)

    def finish(self, seq: Sequence) -> None:
        """A sequence is done (stop, length, error or abort): free everything it holds."""
        self._remove(seq)
        if seq.session_id is not None:
            self.sessions.finish(seq)  # before release: the tail keeps what it needs
        self.memory.release(seq)
        self.parking.discard_spill(seq)
        seq.status = Status.FINISHED
        request = self.requests.get(seq.request_id)
        if request is None:
            return
        self.sink.on_update(request, seq)
        # Released, not just flagged: a sibling that stopped in the same step is reported
        # before the request is.
        if all(s.status is Status.FINISHED for s in request.sequences):
            del self.requests[request.request_id]
            # Published before the caller hears of it: a client that saw its request finish
            # reads counts that no longer hold it.
            self.publish_snapshot()
            self.sink.on_finished(request)

    def fail_sequence(self, seq: Sequence, message: str, log: bool = True) -> None:
        """Answer the whole request with an error; everyone else keeps being served."""
        if log:
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
        for group in (self.active, self.prefilling, self.pending.waiting):
            if seq in group:
                group.remove(seq)
        self.parking.remove(seq)

    # ---- making room --------------------------------------------------------------------

    def _swap_out(self, seq: Sequence) -> bool:
        if not self.parking.swap_out(seq):
            return False
        self.active.remove(seq)
        return True

    def _make_room(self, seq: Sequence, in_batch: set[int]) -> bool:
        """A decode found no free block: spill (when on) or preempt another sequence."""
        victims = [s for s in self.active + self.prefilling
                   if s is not seq and id(s) not in in_batch and not s.finished]
        if not victims:
            return False
        if self.levers_now.swap_enabled and self.parking.can_spill():
            spillable = [s for s in victims if s.status is Status.RUNNING
                         and s.grammar_state is None]
            if spillable and self._swap_out(max(spillable, key=lambda s: len(s.block_table))):
                return True
        self.preempt(max(victims, key=lambda s: s.order))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and slot; it recomputes everything when it resumes."""
        self._settle_if(needs_room=True)
        if seq.finished or seq.status is Status.PREEMPTED:
            return  # the settled step failed: the sequence was failed or already recomputes
        self._remove(seq)
        self.parking.preempt(seq)

    # ---- step failures (`faults`) ---------------------------------------------------------

    def _step_failed(self, exc: Exception, packed: list[PackedRow], where: str) -> None:
        """A step raised: fail its requests (logged once, with the traceback), and if the
        device caches went with it, recompute everyone who held state there."""
        self.failures.failed(where, exc)
        self.tel.count("step_failures")
        if self.failures.exhausted:  # published before any caller hears of this failure
            self.halted = self.failures.halt_reason()
        ids = sorted({p.seq.request_id for p in packed})
        logger.error("step failed at %s (%d in a row); failing its requests %s",
                     where, self.failures.in_a_row, ids, exc_info=exc)
        message = self.failures.request_error()
        for p in packed:
            if not p.seq.finished:
                self.fail_sequence(p.seq, message, log=False)
        if self.runner.recover():
            self._recompute_after_cache_loss()

    def _recompute_after_cache_loss(self) -> None:
        """The runner re-allocated empty caches: every running sequence starts again by
        exact recompute (parked ones hold nothing there), and the prefix cache and SSM
        snapshots, whose contents are gone, are forgotten."""
        self.inflight = None  # computed on the lost caches: never read back
        running = sorted(self.active + self.prefilling, key=lambda s: s.order)
        for seq in running:
            self._remove(seq)
            self.parking.preempt(seq)
        self.sessions.drop_tails()
        self.memory.forget_device_state()
        self.tel.count("cache_losses")
        logger.warning("device caches were lost with the failed step and re-allocated; "
                       "%d running sequences recompute", len(running))

    def _halt(self) -> None:
        """Repeated step failures: stop the loop and answer everything held (requests
        that reached the inbox included) with an error, so no caller waits forever."""
        if self._halt_done:
            return
        self._halt_done = True
        self.inbox.close()
        self.absorb(self.inbox.recv(wait=False))
        self.inflight = None
        requests = list(self.requests.values())
        logger.error("engine stopped: %s; failing the %d requests it holds", self.halted,
                     len(requests))
        for request in requests:
            unfinished = [s for s in request.sequences if not s.finished]
            if unfinished:
                self.fail_sequence(unfinished[0], f"the engine stopped: {self.halted}",
                                   log=False)
        for rotation in self.pending.rotations:
            rotation.ack(None, EngineFailed(self.halted))
        self.pending.rotations = []
        self.publish_snapshot()

    # ---- views --------------------------------------------------------------------------

    def publish_snapshot(self, new: list[Sequence] = ()) -> None:
        """Phase 4, a finished request and an idle loop: what other threads read."""
        self.tel.publish(phases.build_snapshot(
            active=self.active, prefilling=self.prefilling, num_parked=self.parking.parked,
            new=new, pending=self.pending, memory=self.memory, num_requests=len(self.requests),
            steps_total=self.steps_total, now=self.clock.now(), gate=self.gate,
            lora=self.cohort.view(self.active + self.prefilling, self.pending.waiting,
                                  len(self.pending.rotations)),
            sessions=self.sessions))

    @property
    def pool(self):
        return self.memory.pool

    @property
    def slots(self):
        return self.memory.slots

    @property
    def snapshots(self):
        return self.memory.snapshots

    @property
    def spill(self) -> SpillBackend | None:
        return self.parking.spill

    @property
    def swapped(self) -> list[Sequence]:
        return self.parking.swapped

    @property
    def preempted(self) -> list[Sequence]:
        return self.parking.preempted

    @property
    def is_idle(self) -> bool:
        return not (self.active or self.prefilling or self.parking or self.pending.waiting
                    or self.inflight)

    @property
    def has_work(self) -> bool:
        return not self.is_idle

    def check_integrity(self) -> None:
        """No block owned twice, pool books balanced, slots and spill files accounted for."""
        self.memory.check_integrity(self.active + self.prefilling)
        self.parking.check_integrity()
        self.sessions.check_integrity()
