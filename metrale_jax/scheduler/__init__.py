"""The tick loop: a host-side scheduler that reproduces the seed's `plan_tick` (no jax).

The idea: every request is a sequence of tokens, some already in the device caches
(`num_computed`), some still owed. A tick decides which owed tokens run next — prompt
chunks and single decode tokens side by side in one ragged batch under a token budget — and
which sequences must give memory back (prefix-cache blocks first, then a spill to disk, or a
preemption by recompute). The device only ever sees one padded batch per tick.

The parts (mini-sglang's shape: small collaborators, the core orchestrates):
  core.py     SchedulerCore: running lists, requests, the tick, the loop, reporting
  phases.py   the seed's pre-step phases, each a function of the parts it needs
  memory.py   Memory: block pool, SSM state slots, SSM snapshots; commit and release
  sessions.py Sessions: a multi-turn chat's latest turn pinned for its next turn (TTL,
              budgets, DELETE, eviction under pressure through `Memory.pins`)
  parking.py  Parking: swapped and preempted sequences, the spill backend, resuming
  lanes.py    packing one batch; says "needs room for X" instead of making room
  commit.py   applying a step's results; returns the sequences it touched
  settle.py   must_settle: every reason to wait for the step running ahead
  faults.py   a step that raises fails its own requests; several in a row stop the loop
  adapters.py the adapter cohort (which sequences may start) and the rotation hold
  inbox.py, state.py (Pending, TickPlan, rotations), levers.py, policy.py, snapshot.py
The contract with the runner is `metrale_jax.types`.

One tick, in the seed's phase order (`SchedulerCore.tick` = `plan_tick` + `run_lanes`):
  1. drain      — move new requests from the inbox into `pending`; the admission policy picks
                  up to `max_batch_size` minus what is running; nothing new while sequences
                  are parked (swapped or preempted): they resume first.
  2. gate       — hold back what does not fit the KV pool above the admit watermark (with
                  spilling on, reclaimable and spillable blocks count as room); reject a
                  prompt that can never fit `max_seq_len` or the pool, with an error. The
                  adapter cohort: a sequence whose LoRA adapter holds no device slot waits
                  (others pass it), and queued rotations hold all new work after
                  `rotation_hold_ticks` (`adapters`).
  3. settle     — if a step runs ahead of the host and this tick starts or continues a
                  prefill or resumes a parked sequence, wait for it and apply its results.
  4. snapshot   — publish the SchedulerSnapshot (what /metrics and the admin API read).
  5. rotations  — queued adapter commands run only when nothing is active anywhere (parked
                  included), each acknowledged once; then the adapters the head of the
                  waiting queue needs are loaded, evicting least recently used ones.
  6. shutdown   — on an idle tick, poll the inbox; stop once it is closed and every accepted
                  request is finished or answered. (Sessions past their TTL end at the
                  start of every tick, before phase 1.)
  7. swap-out   — for each admitted prompt, reclaim cached prefix blocks (never its own
                  prefix), then spill the active sequence holding the most blocks until the
                  prompt fits; a failed spill stops spilling for the tick, losing nothing.
  8. lanes      — resume parked sequences, StartPrefills / ContinuePrefills / Decode packed
                  into one batch (a session's next turn starts from its tail), dispatch
                  it, and queue one batch of SSM snapshot copies for every row that ended
                  on a block boundary; then the plain variant reads this step back, the
                  overlapped one reads back the previous step while the device works.
`run()` loops ticks on the engine thread; when idle it publishes a fresh snapshot and blocks
on the inbox.

One name per concept:
  waiting     accepted, not yet admitted (`Pending.waiting`, `Status.WAITING`, snapshot
              `waiting_len`, metric `num_requests_waiting`). The seed's snapshot field
              `pending_len` counts what phase 1 admitted this tick.
  running     prefilling + active (decoding); metric `num_requests_running`.
  parked      swapped (state on disk) + preempted (recomputes); `Parking`. The seed's
              `swapped_seqs` and vLLM's metric `num_requests_swapped` count all parked.
  tick        one pass of the loop, idle or not. The seed's `steps_total` and the metric
              `scheduler_steps` count ticks; a "step" is one dispatch to the device.
  slot        `Sequence.slot`: the sequence's SSM state slot, which also holds its
              future-token cell; snapshot slots belong to `SnapshotPool`; adapter slots to
              LoRA (`Sequence.adapter_slot`).
  inflight    `SchedulerCore.inflight`: the step dispatched and not read back;
              `Sequence.inflight`: that sequence's tokens sampled on the device and not yet
              read back. The server counts its open requests as `open_requests`.
"""
