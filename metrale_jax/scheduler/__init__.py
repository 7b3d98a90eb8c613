"""The tick loop: a host-side scheduler that reproduces the seed's `plan_tick`.

The idea: every request is a sequence of tokens, some already in the device caches
(`num_computed`), some still owed. A tick decides which owed tokens run next — prompt
chunks and single decode tokens side by side in one ragged batch under a token budget — and
which sequences must give memory back (prefix-cache blocks first, then a spill to disk, or a
preemption by recompute). The device only ever sees one padded batch per tick.

One tick, in the seed's phase order (`SchedulerCore.tick`):
  1. drain      — move new requests from the inbox into `pending`; the admission policy picks
                  up to `max_batch_size` minus what is running; nothing new while sequences
                  are parked (swapped or preempted): they resume first.
  2. gate       — hold back what does not fit the KV pool above the admit watermark (with
                  spilling on, reclaimable and spillable blocks count as room); reject a
                  prompt that can never fit `max_seq_len` or the pool, with an error.
  3. settle     — if a step runs ahead of the host and this tick starts or continues a
                  prefill or resumes a parked sequence, wait for it and apply its results.
  4. snapshot   — publish the SchedulerSnapshot (what /metrics and the admin API read).
  5. rotations  — queued adapter commands run only when nothing is active anywhere.
  6. shutdown   — on an idle tick, poll the inbox; stop once it is closed and every accepted
                  request is finished or answered.
  7. swap-out   — for each admitted prompt, reclaim cached prefix blocks (never its own
                  prefix), then spill the active sequence holding the most blocks until the
                  prompt fits; a failed spill stops spilling for the tick, losing nothing.
  8. lanes      — resume parked sequences, StartPrefills / ContinuePrefills / Decode packed
                  into one batch, dispatch it, then process the previous step's results
                  (pipeline on) or this step's (pipeline off).
"""
