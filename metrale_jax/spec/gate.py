"""The MTP gate: per tick, the plain step or the speculative one, whichever delivers more.

Whether drafting pays depends on what the step costs at this batch size on this machine and
on how often drafts are accepted, so the gate measures instead of predicting: delivered
tokens per second of wall clock (tokens committed to requests, not tokens computed), as an
EMA per batch-size bucket and per mode. Until both modes have `warmup_ticks` samples in a
bucket it runs them in turn, in bursts of ticks (probing); then it keeps the faster one,
switching only past an asymmetric margin (turning on needs a clear win, turning off a clear
loss) so noise does not flip it tick to tick. A choice changes only where both figures are
fresh, side by side: at the end of warm-up and of a probe. When the standing mode's live
figure falls behind the other's last one (`doubt_after` samples after a probe or a flip) it
calls a probe instead of flipping, as that figure may come from a faster or slower spell of
a shared machine. Every `reprobe_every_s` it runs the other mode
for `probe_ticks` ticks (its figure measured afresh), because load and acceptance drift, and
then the standing mode as many ticks, measured afresh too: the ticks after a switch run
slower than a long run of either mode (at batch 4 on the built-in model ~1.4 ms against ~1.1
for plain), so a probed mode measured just after its switch, against the standing mode's
long run, could lose a probe it should win. A probe that confirms the standing choice
doubles the wait before the bucket's next one (up to `max_reprobe_factor` times the first),
and a change of choice resets it: where speculation loses by 2x (large batches on a CPU)
each probe tick costs a plain tick extra, and a bucket that keeps losing need not be asked
as often. The first choice after warm-up (and every choice a probe flips) is re-probed
early, after `first_reprobe_ticks` of its samples: warm-up runs on the first ticks of a
start, which are slow (first runs of freshly compiled programs), and at batch 4
on the built-in model a plain burst measured at a tenth of its rate had kept speculation
on, 0.7x plain, until the timed re-probe. The re-probe timer counts the bucket's own ticks,
not the wall clock: idle time changes neither mode's cost, and counted, it made every burst
of work after a pause start with a probe (10% of a 128-token request at batch 1). With the
policy "on" or "off" it never probes.

A mode's rate is an EMA of tokens over an EMA of seconds, not an EMA of each tick's
tokens/seconds: the mean of per-tick rates overweights short ticks (Jensen), and pipelined
ticks vary in length (4% above the delivered rate at batch 1 on the built-in model,
`metrale bench mtp`, when speculative ticks still waited for their step).

The first tick after a switch of mode is not a sample of either: a speculative step right
after plain ones has no drafts to verify yet (drafts come from the step before) and waits
for the plain one ahead, and a plain step right after speculative ones pays for the settle
of the switch (a row's start after a speculative step is the device's to know; only
speculative steps run ahead of speculative ones). Counted, those ticks
made speculation look 10-20% slower than it runs at small batches (measured with
`metrale bench mtp`); so a warm-up burst runs until its mode has its samples, and a
probe one tick longer than the samples it needs.
Nor is the last tick before a switch, where the tick loop records a step after choosing the
next one (the pipelined loop): a plain step that runs ahead is read back early when the next
tick speculates, so its seconds are cut short (0.3-0.5 ms against 1.2 at batch 1 on the
built-in model); counted, it made plain look faster right after every flip to speculation,
and the gate flipped back and forth, paying two slow switch ticks each time. And a choice
that just flipped stands for `probe_ticks` samples of its mode before it is judged again.

When the gate says off the engine runs exactly the plain step: a speculator that is merely
disabled still costs time (vLLM V0 measured it), so "off" must mean no MTP work at all.
The gate is host-only bookkeeping with an injected clock; phase 4 of the tick reads
`observe()` into the snapshot.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from metrale_jax.telemetry.clock import Clock, MonotonicClock

GATE_POLICIES = ("auto", "on", "off")


class MtpMode(str, enum.Enum):
    OFF = "off"
    ON = "on"
    PROBING = "probing"


class GateError(ValueError):
    """A gate setting is invalid; the message names it."""


@dataclasses.dataclass(frozen=True)
class GateConfig:
    policy: str = "auto"           # auto: measure and choose; on / off: fixed
    ema_alpha: float = 0.25        # weight of the newest tick in every EMA
    warmup_ticks: int = 6          # samples of each mode in a bucket before choosing
    turn_on_ratio: float = 1.05    # speculation must beat plain by 5% to be switched on
    turn_off_ratio: float = 0.95   # and lose by 5% to be switched off again
    reprobe_every_s: float = 20.0  # seconds of a bucket's ticks a choice stands before the
                                   # other mode is retried (idle time is not counted)
    max_reprobe_factor: int = 16   # the wait doubles per confirming probe, up to this many x
    probe_ticks: int = 8           # ticks one re-probe runs the other mode (one slow tick
                                   # of a shared machine, 3x the others, moves 4 by a third)
    first_reprobe_ticks: int = 64  # the first choice is re-probed after this many of its
                                   # samples, whatever the clock says (0: not early)
    doubt_after: int = 16          # samples of the standing mode after a probe or a flip
                                   # before its falling behind calls a probe
    ramp_ticks: int = 6            # decode ticks after one with prefill chunks that are no
                                   # samples: new requests' first ticks run 1.5-4x slower
                                   # in either mode (batch 4, built-in model), and a probe
                                   # that met them misjudged its mode

    def __post_init__(self) -> None:
        if self.policy not in GATE_POLICIES:
            raise GateError(f"policy: must be one of {GATE_POLICIES}, got {self.policy!r}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise GateError(f"ema_alpha: must be in (0, 1], got {self.ema_alpha}")
        if self.ramp_ticks < 0:
            raise GateError(f"ramp_ticks: must be at least 0, got {self.ramp_ticks}")
        if self.first_reprobe_ticks < 0:
            raise GateError(f"first_reprobe_ticks: must be at least 0, got "
                            f"{self.first_reprobe_ticks}")
        for name in ("warmup_ticks", "probe_ticks", "doubt_after"):
            if getattr(self, name) < 1:
                raise GateError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not self.turn_off_ratio <= 1.0 <= self.turn_on_ratio:
            raise GateError("turn_off_ratio <= 1 <= turn_on_ratio must hold (hysteresis), got "
                            f"{self.turn_off_ratio} and {self.turn_on_ratio}")
        if self.reprobe_every_s <= 0:
            raise GateError(f"reprobe_every_s: must be positive, got {self.reprobe_every_s}")
        if type(self.max_reprobe_factor) is not int or self.max_reprobe_factor < 1:
            raise GateError("max_reprobe_factor: must be a positive integer, got "
                            f"{self.max_reprobe_factor!r}")


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket of a batch size: step cost changes by buckets, not by rows."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclasses.dataclass
class _Rate:
    """Tokens per second as a ratio of two EMAs (see the module docstring)."""

    tokens: float | None = None
    seconds: float | None = None

    def add(self, tokens: int, seconds: float, alpha: float) -> None:
        self.tokens = _ema(self.tokens, float(tokens), alpha)
        self.seconds = _ema(self.seconds, seconds, alpha)

    @property
    def tps(self) -> float | None:
        return None if self.seconds is None else self.tokens / self.seconds


@dataclasses.dataclass
class _Bucket:
    """What the gate knows about one batch-size bucket."""

    rate: dict[bool, _Rate] = dataclasses.field(
        default_factory=lambda: {False: _Rate(), True: _Rate()})  # speculative? -> rate
    samples: dict[bool, int] = dataclasses.field(default_factory=lambda: {False: 0, True: 0})
    speculating: bool = False      # the standing choice
    busy_s: float = 0.0            # seconds of this bucket's ticks since the choice
                                   # last stood fresh (the re-probe timer)
    reprobe_after: float = 0.0     # busy seconds before the next re-probe
    probe_left: int = 0            # ticks of the current re-probe still to run
    recheck_left: int = 0          # ...then ticks of the standing mode, measured afresh
    standing: int = 1 << 30        # samples of the standing choice's mode since it flipped
    kept: int = 0                  # samples of the standing choice since warm-up
    early_probe: bool = True       # the first choice's early re-probe is still to come
    judged: bool = False           # the choice after warm-up is made
    behind: int = 0                # samples in a row the standing mode has trailed
    doubt: bool = False            # ...enough of them: probe at the next tick

    def warm(self, need: int) -> bool:
        return min(self.samples.values()) >= need


class MtpGate:
    def __init__(self, config: GateConfig | None = None, num_depths: int = 1,
                 clock: Clock | None = None):
        self.config = config or GateConfig()
        self.clock = clock or MonotonicClock()
        self.num_depths = num_depths
        self._buckets: dict[int, _Bucket] = {}
        self._mode = MtpMode.OFF       # what the last `choose` decided
        self._delivered = _Rate()      # over every tick, whichever mode ran
        self._acceptance: list[float | None] = [None] * num_depths
        # Warm-up runs each mode for a burst of ticks in a row, across buckets (the batch
        # size moves while sequences come and go; a sequence's drafts are its own).
        self._burst_mode: bool | None = None
        self._last_mode: bool | None = None  # the mode of the last tick recorded
        self._chosen: bool | None = None     # what the last `choose` returned

    # ---- queries ------------------------------------------------------------------------

    def observe(self) -> tuple[MtpMode, float]:
        """The snapshot's (mtp_mode, delivered_tps)."""
        return self._mode, self._delivered.tps or 0.0

    def acceptance(self) -> tuple[float, ...]:
        """EMA of the acceptance rate at each draft depth (0.0 before any draft)."""
        return tuple(a or 0.0 for a in self._acceptance)

    def figures(self, batch_size: int) -> dict:
        """Per-mode tokens/s and sample counts of a bucket (for benchmarks and tests)."""
        b = self._buckets.get(batch_bucket(batch_size), _Bucket())
        return {"plain_tps": b.rate[False].tps, "speculative_tps": b.rate[True].tps,
                "plain_samples": b.samples[False], "speculative_samples": b.samples[True],
                "speculating": b.speculating}

    def expects_speculation(self, batch_size: int) -> bool:
        """Whether decodes of this batch size would speculate now (nothing recorded): a
        tick of prefills alone asks, as writing the prompts' MTP K/V pays only if their
        decodes will draft (at batch 4 and up on a CPU the gate keeps plain, and the
        speculative prefill costs ~2x the plain one)."""
        if self.config.policy != "auto":
            return self.config.policy == "on"
        b = self._buckets.get(batch_bucket(batch_size))
        if b is None or not b.warm(self.config.warmup_ticks):
            return True
        return b.speculating or bool(b.probe_left)

    # ---- mutations ----------------------------------------------------------------------

    def set_policy(self, policy: str) -> None:
        """The runtime lever: auto / on / off (what was measured so far is kept)."""
        self.config = dataclasses.replace(self.config, policy=policy)

    def choose(self, batch_size: int) -> bool:
        """Speculate this tick? Called once per tick of decodes alone, before packing."""
        self._chosen = self._choose(batch_size)
        return self._chosen

    def choose_unmeasured(self, batch_size: int) -> bool:
        """Speculate this tick, one that carries prefill chunks (`batch_size`: the
        sequences it will decode)? Such a tick costs what its chunks cost, not what either
        mode delivers in a run of decodes: it follows the bucket's choice (or its warm-up)
        and is recorded with batch 0, no sample. Measured, the ramp of a batch of new
        requests (29 decodes beside 14 prompts, at batch 64) warmed up a bucket of its own
        with a speculative tick per run at twice the plain one's cost, 5% of the run."""
        self._chosen = self.expects_speculation(batch_size)
        return self._chosen

    def _choose(self, batch_size: int) -> bool:
        policy = self.config.policy
        if policy != "auto":
            self._mode = MtpMode.ON if policy == "on" else MtpMode.OFF
            return policy == "on"
        b = self._bucket(batch_size)
        need = self.config.warmup_ticks
        if not b.warm(need):
            # Bursts of ticks in a row, each until its mode has the samples (the ticks at a
            # switch are none), the mode with fewer samples first (plain on a tie): drafts
            # come from the tick before, so alternating tick by tick would measure a
            # speculative step that never has drafts to verify.
            self._mode = MtpMode.PROBING
            if self._burst_mode is None or b.samples[self._burst_mode] >= need:
                self._burst_mode = b.samples[True] < b.samples[False]
            return self._burst_mode
        early = (b.early_probe and self.config.first_reprobe_ticks
                 and b.kept >= self.config.first_reprobe_ticks)
        if not (b.probe_left or b.recheck_left) and (early or b.doubt
                                                      or b.busy_s >= b.reprobe_after):
            b.probe_left = self.config.probe_ticks
            b.early_probe = b.doubt = False
            # The other mode's figure is as old as its last run: the probe measures afresh.
            b.rate[not b.speculating] = _Rate()
        if b.probe_left or b.recheck_left:
            self._mode = MtpMode.PROBING
            return b.speculating != bool(b.probe_left)
        self._mode = MtpMode.ON if b.speculating else MtpMode.OFF
        return b.speculating

    def record(self, batch_size: int, speculative: bool, tokens: int, seconds: float,
               accepted: Sequence[int] = (), drafted: Sequence[int] = ()) -> None:
        """A settled tick: `tokens` committed to requests in `seconds` of wall clock, by the
        mode that ran; for a speculative tick, accepted and drafted tokens per depth. Batch
        0: a tick that is no sample of a bucket (`choose_unmeasured`)."""
        if seconds <= 0:
            return  # nothing measurable (a clock that did not move)
        alpha = self.config.ema_alpha
        self._delivered.add(tokens, seconds, alpha)
        for d, (a, n) in enumerate(zip(accepted, drafted)):
            if n:
                self._acceptance[d] = _ema(self._acceptance[d], a / n, alpha)
        switched = self._last_mode is not None and speculative != self._last_mode
        leaving = self._chosen is not None and speculative != self._chosen
        self._last_mode = speculative
        if switched or leaving or not batch_size:
            return  # a tick at a switch: not what either mode delivers in a run (see above)
        b = self._bucket(batch_size)
        b.rate[speculative].add(tokens, seconds, alpha)
        b.busy_s += seconds
        b.samples[speculative] += 1
        if speculative == b.speculating:
            b.standing += 1
            b.kept += b.warm(self.config.warmup_ticks)
        if self.config.policy != "auto" or not b.warm(self.config.warmup_ticks):
            return
        if b.probe_left and speculative != b.speculating:
            b.probe_left -= 1
            if not b.probe_left:  # now the standing mode, afresh and after its own switch
                b.recheck_left = self.config.probe_ticks
                b.rate[b.speculating] = _Rate()
            return
        if b.recheck_left and speculative == b.speculating:
            b.recheck_left -= 1
            if b.recheck_left:
                return
            b.busy_s = 0.0  # the probe is over: the choice stands afresh
            if not self._decide(b):  # confirmed: wait longer before asking again
                b.reprobe_after = min(2 * b.reprobe_after, self.config.reprobe_every_s
                                      * self.config.max_reprobe_factor)
                b.standing = 0
            return
        if not b.judged:  # warm-up is over: its bursts ran side by side, both figures fresh
            b.judged = True
            self._decide(b)
        elif b.standing >= self.config.doubt_after:
            # The standing mode's figure is live, the other's as old as its last run: on a
            # machine whose speed drifts by a third within minutes, flipping on that
            # comparison kept speculation on for minutes at batch 4 (0.84x plain); a probe
            # measures both afresh, side by side, and decides. Only a lag that lasts
            # `probe_ticks` samples calls one: a single tick 3x slow (a shared machine has
            # them) moves the EMA by a third, and at batch 4 such probes ran every ~20 ticks.
            b.behind = b.behind + 1 if self._behind(b) else 0
            if b.behind >= self.config.probe_ticks:
                b.doubt, b.behind = True, 0

    def _behind(self, b: _Bucket) -> bool:
        """Whether the standing mode trails the other past the hysteresis margin."""
        plain, spec = b.rate[False].tps, b.rate[True].tps
        return (spec < plain * self.config.turn_off_ratio if b.speculating
                else spec > plain * self.config.turn_on_ratio)

    def _decide(self, b: _Bucket) -> bool:
        """Flip the bucket's choice past the hysteresis margin; True when it flipped."""
        flip = self._behind(b)
        if flip:
            b.speculating = not b.speculating
            b.busy_s = 0.0
            b.reprobe_after = self.config.reprobe_every_s
            b.standing = 0
            # A flip may rest on a slow spell in a probe's few ticks; the other mode's
            # figure then stays wrong until it runs again: re-probe early, as after warm-up.
            b.early_probe, b.kept = True, 0
        return flip

    def _bucket(self, batch_size: int) -> _Bucket:
        key = batch_bucket(batch_size)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(reprobe_after=self.config.reprobe_every_s)
        return self._buckets[key]
