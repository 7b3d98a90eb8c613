"""Phase 8's mode: the seed's MTP gate as the tick loop sees it.

Each tick, `choose` says whether the tick runs the speculative step and whether the tick
is one of the gate's samples (`sample_batch`: its batch size, 0 for none); each read-back
step is `record`ed with the wall clock it covered. The gate itself (spec/gate.py) knows
only batch sizes, modes and figures; what makes a tick no sample, or forces it plain, is
decided here from the sequences the tick holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from metrale_jax.sequence import Sequence, Status
from metrale_jax.spec.gate import MtpGate
from metrale_jax.types import StepHandle


class SpeculationChoice:
    def __init__(self, gate: MtpGate):
        self.gate = gate
        self.sample_batch = 0      # decoding sequences this tick (0: not a gate sample)
        self._since_prefill = 0    # decode ticks since one with prefill chunks
        self._last_read_at = 0.0   # when the last step was read back

    def choose(self, policy: str, ready: bool, active: list[Sequence],
               prefilling: list[Sequence], admitted: Iterable[Sequence]) -> bool:
        """Speculate this tick? `policy`: the lever's; `ready`: the speculative variants
        are compiled."""
        self.sample_batch = 0
        if self.gate.config.policy != policy:
            self.gate.set_policy(policy)
        if not ready:
            return False  # its variants still compile beside serving: never wait for one
        admitted = list(admitted)
        if policy == "auto" and any(s.seeded_sampling for s in
                                    itertools.chain(active, prefilling, admitted)):
            # The gate's choice follows the load, and the speculative step samples from
            # random streams of its own (rejection sampling): a seeded request's text
            # would then depend on what else ran. Its ticks run plain, and are no samples.
            return False
        decoding = sum(s.status is Status.RUNNING for s in active)
        if prefilling or admitted or not decoding:
            self._since_prefill = 0
            # Prefill chunks: the speculative step writes the prompts' MTP K/V, which every
            # later draft attends over (a plain step leaves those pages stale, and the
            # drafts, so a seeded sampled run's rejection path, would depend on what ran
            # in them before); it pays where the batch's decodes are expected to draft.
            return self.gate.choose_unmeasured(len(active) + len(prefilling) + len(admitted))
        self._since_prefill += 1
        if self._since_prefill > self.gate.config.ramp_ticks:
            self.sample_batch = decoding  # a sample: no new request's first ticks in it
        return self.gate.choose(decoding)

    def record(self, handle: StepHandle, tokens: int, accepted, drafted, now: float) -> None:
        """Feed the gate delivered tokens/s: the wall clock since this step was dispatched
        or the last read-back, whichever came later (idle time is not the step's)."""
        since = max(self._last_read_at, handle.dispatched_at)
        self._last_read_at = now
        self.gate.record(handle.decoding, handle.speculative, tokens, now - since,
                         accepted, drafted)
