"""The MTP gate, driven by a fake clock and made-up tick figures: warm-up probing, keeping the
faster mode per batch bucket, hysteresis, periodic re-probes, fixed policies."""

import pytest

from metrale_jax.spec.gate import GateConfig, GateError, MtpGate, MtpMode, batch_bucket
from metrale_jax.telemetry.clock import FakeClock


def drive(gate: MtpGate, clock: FakeClock, batch: int, ticks: int, plain_tps: float,
          spec_tps: float, switch_tps: float | None = None) -> list[bool]:
    """Run `ticks` ticks of 0.1 s each, the mode chosen delivering the given rate (and
    `switch_tps` on the first tick after a change of mode, when given)."""
    chosen = []
    for _ in range(ticks):
        spec = gate.choose(batch)
        tps = spec_tps if spec else plain_tps
        if switch_tps is not None and chosen and chosen[-1] != spec:
            tps = switch_tps
        chosen.append(spec)
        clock.t += 0.1
        gate.record(batch, spec, tokens=round(tps * 0.1), seconds=0.1)
    return chosen


def test_warm_up_probes_both_modes_then_keeps_the_faster():
    clock = FakeClock()
    gate = MtpGate(GateConfig(warmup_ticks=3), clock=clock)
    # A burst of each mode, each until it has its samples: the speculative burst is one
    # tick longer, as its first tick (the switch) is not a sample.
    first = drive(gate, clock, 1, 8, plain_tps=100, spec_tps=170)
    assert first == [False] * 3 + [True] * 5
    assert gate.figures(1)["plain_samples"] == 3 and gate.figures(1)["speculative_samples"] == 4
    assert all(drive(gate, clock, 1, 20, plain_tps=100, spec_tps=170))
    mode, tps = gate.observe()
    assert mode is MtpMode.ON and tps == pytest.approx(170, rel=0.01)


def test_each_batch_bucket_chooses_for_itself():
    clock = FakeClock()
    gate = MtpGate(GateConfig(warmup_ticks=2), clock=clock)
    drive(gate, clock, 1, 10, plain_tps=100, spec_tps=170)   # small batches: drafts pay
    drive(gate, clock, 60, 10, plain_tps=900, spec_tps=700)  # large: the step is compute-bound
    assert gate.choose(1) and not gate.choose(64) and gate.choose(2) is False
    assert gate.figures(1)["speculating"] and not gate.figures(33)["speculating"]


def test_hysteresis_keeps_a_choice_through_small_differences():
    clock = FakeClock()
    gate = MtpGate(GateConfig(warmup_ticks=2, reprobe_every_s=1e9), clock=clock)
    drive(gate, clock, 4, 6, plain_tps=100, spec_tps=103)  # within the 5% margin: stays off
    assert not any(drive(gate, clock, 4, 10, plain_tps=100, spec_tps=103))
    gate = MtpGate(GateConfig(warmup_ticks=2, reprobe_every_s=1e9), clock=clock)
    drive(gate, clock, 4, 6, plain_tps=100, spec_tps=150)
    assert gate.choose(4)
    # Speculation now only 3% behind: inside the turn-off margin, so it stays on.
    gate.record(4, True, tokens=97, seconds=1.0)
    for _ in range(10):
        gate.record(4, True, tokens=97, seconds=1.0)
    assert gate.figures(4)["speculative_tps"] == pytest.approx(97, rel=0.05)
    assert gate.choose(4)


def test_a_reprobe_finds_that_the_losing_mode_now_wins():
    clock = FakeClock()
    cfg = GateConfig(warmup_ticks=2, reprobe_every_s=5.0, probe_ticks=3)
    gate = MtpGate(cfg, clock=clock)
    drive(gate, clock, 1, 10, plain_tps=100, spec_tps=60)  # drafts rejected: off
    assert not gate.choose(1) and gate.observe()[0] is MtpMode.OFF
    # Acceptance recovers; within 5 s the gate keeps the choice without trying.
    assert not any(drive(gate, clock, 1, 20, plain_tps=100, spec_tps=180)[:10])
    clock.t += 60.0  # idle: the re-probe waits for 5 s of the bucket's ticks, not the clock
    chosen = drive(gate, clock, 1, 40, plain_tps=100, spec_tps=180)
    first = chosen.index(True)
    assert 15 <= first <= 25  # ~5 s of ticks after the choice (the warm-up's included)
    # The re-probe runs the other mode (a switch tick and 3 samples), then plain afresh
    # (as many), and speculation stays on.
    assert all(chosen[first:first + 4]) and not any(chosen[first + 4:first + 8])
    assert all(chosen[first + 8:])
    assert gate.choose(1) and gate.observe()[0] is MtpMode.ON


def test_a_reprobe_that_loses_returns_to_the_standing_choice():
    clock = FakeClock()
    gate = MtpGate(GateConfig(warmup_ticks=2, reprobe_every_s=5.0, probe_ticks=2), clock=clock)
    drive(gate, clock, 1, 7, plain_tps=100, spec_tps=60)  # warm-up, then one plain tick
    chosen = drive(gate, clock, 1, 60, plain_tps=100, spec_tps=60)
    first = chosen.index(True)
    assert chosen[first:first + 3] == [True] * 3
    assert not any(chosen[first + 3:])  # back to plain, and the timer restarted
    assert gate.observe()[0] is MtpMode.OFF


def test_confirming_probes_back_off_and_a_flip_resets_the_wait():
    """Each probe that confirms the choice doubles the wait before the next (up to
    max_reprobe_factor x reprobe_every_s); a probe that flips the choice resets it."""
    clock = FakeClock()
    cfg = GateConfig(warmup_ticks=2, reprobe_every_s=5.0, probe_ticks=2, max_reprobe_factor=4)
    gate = MtpGate(cfg, clock=clock)
    drive(gate, clock, 1, 7, plain_tps=100, spec_tps=50)   # warm-up: plain wins
    assert not gate.choose(1)
    starts, last = [], False
    while clock.t < 80:
        spec = drive(gate, clock, 1, 1, plain_tps=100, spec_tps=50)[0]
        if spec and not last:
            starts.append(clock.t)
        last = spec
    # A probe runs 6 ticks (0.6 s): speculation, then plain afresh, 2 samples each after a
    # switch tick; the wait counts from its end.
    gaps = [b - a - 0.6 for a, b in zip(starts, starts[1:])]
    assert gaps[:4] == pytest.approx([10, 20, 20, 20], abs=0.25)  # after 5 s: 10, 20 (cap)
    # Speculation starts winning: the next probe flips the choice and the wait is 5 s again.
    while not drive(gate, clock, 1, 1, plain_tps=100, spec_tps=300)[0]:
        clock.t += 1.0
    drive(gate, clock, 1, 6, plain_tps=100, spec_tps=300)
    assert gate.choose(1) and gate.observe()[0] is MtpMode.ON
    ticks = 0
    while drive(gate, clock, 1, 1, plain_tps=100, spec_tps=300)[0]:
        ticks += 1
    assert ticks * 0.1 == pytest.approx(5.0, abs=1.0)  # 5 s of ticks again


def test_a_mode_rate_is_tokens_over_seconds_not_a_mean_of_tick_rates():
    """Ticks of 1 token in 1 ms and in 3 ms deliver 2 tokens in 4 ms: 500 tok/s. A mean
    of the per-tick rates (667) would favour a mode whose ticks vary in length."""
    gate = MtpGate(GateConfig(ema_alpha=0.5, warmup_ticks=100), clock=FakeClock())
    for _ in range(20):
        gate.record(1, False, tokens=1, seconds=0.001)
        gate.record(1, False, tokens=1, seconds=0.003)
    assert gate.figures(1)["plain_tps"] == pytest.approx(500, rel=0.15)
    assert gate.observe()[1] == pytest.approx(500, rel=0.15)


def test_switch_ticks_do_not_poison_the_choice():
    """The first speculative tick after plain ones has no drafts, and the first plain tick
    after speculative ones settles the switch: both slow. Speculation that is 12% faster in
    a run must still be chosen (it was not, when the switch ticks counted)."""
    clock = FakeClock()
    gate = MtpGate(GateConfig(reprobe_every_s=1e9), clock=clock)
    drive(gate, clock, 1, 40, plain_tps=100, spec_tps=112, switch_tps=40)
    assert gate.choose(1) and gate.observe()[0] is MtpMode.ON
    assert gate.figures(1)["speculative_tps"] == pytest.approx(112, rel=0.02)
    # The same penalty with speculation 12% slower in a run: it stays off.
    gate = MtpGate(GateConfig(reprobe_every_s=1e9), clock=clock)
    drive(gate, clock, 1, 40, plain_tps=112, spec_tps=100, switch_tps=40)
    assert not gate.choose(1) and gate.observe()[0] is MtpMode.OFF


def drive_pipelined(gate: MtpGate, clock: FakeClock, ticks: int, plain_tps: float,
                    spec_tps: float, early_tps: float) -> list[bool]:
    """The pipelined tick loop's order: each tick chooses its mode, then records the tick
    before it. A plain step that ran ahead and is read back early because the next tick
    speculates delivers `early_tps` (its seconds cut short); the first tick after a switch
    delivers half its mode's rate."""
    chosen: list[bool] = []
    for _ in range(ticks):
        spec = gate.choose(1)
        if chosen:
            last = chosen[-1]
            tps = spec_tps if last else plain_tps
            if len(chosen) > 1 and chosen[-2] != last:
                tps /= 2
            if not last and spec:
                tps = early_tps
            gate.record(1, last, tokens=round(tps * 0.1), seconds=0.1)
        chosen.append(spec)
        clock.t += 0.1
    return chosen


def test_the_tick_read_back_early_for_a_switch_is_not_a_sample():
    """Speculation 3% faster than plain in a run: inside the hysteresis, so plain stays, and
    a plain tick cut short by a switch (4x its rate) must not flip the choice back and forth
    (it did: every such tick made plain look faster right after a flip to speculation)."""
    clock = FakeClock()
    no_probes = GateConfig(reprobe_every_s=1e9, first_reprobe_ticks=0)
    gate = MtpGate(no_probes, clock=clock)
    chosen = drive_pipelined(gate, clock, 200, plain_tps=100, spec_tps=103, early_tps=400)
    flips = sum(a != b for a, b in zip(chosen[40:], chosen[41:]))
    assert flips == 0 and not chosen[-1]
    assert gate.figures(1)["plain_tps"] == pytest.approx(100, rel=0.02)
    # Speculation 20% faster: chosen, and it stays chosen.
    gate = MtpGate(no_probes, clock=clock)
    chosen = drive_pipelined(gate, clock, 200, plain_tps=100, spec_tps=120, early_tps=400)
    assert all(chosen[40:])


def test_a_warm_up_on_slow_first_ticks_is_corrected_early():
    """The first ticks after a start are slow: a plain warm-up burst measured on them keeps
    speculation on although plain is 1.4x faster in a run; the first choice's early
    re-probe (first_reprobe_ticks samples later, long before the timed one) finds it."""
    clock = FakeClock()
    cfg = GateConfig(warmup_ticks=3, probe_ticks=3, reprobe_every_s=1e9,
                     first_reprobe_ticks=20)
    gate = MtpGate(cfg, clock=clock)
    drive(gate, clock, 4, 3, plain_tps=10, spec_tps=100)       # cold: plain at a tenth
    assert drive(gate, clock, 4, 10, plain_tps=140, spec_tps=100)[-1]  # speculation kept
    chosen = drive(gate, clock, 4, 30, plain_tps=140, spec_tps=100)
    assert not chosen[-1] and not gate.figures(4)["speculating"]
    # The flip is re-probed early once more (a probe's few ticks may have met a slow
    # spell); it confirms plain, which then stands with the timed re-probe far off.
    chosen = drive(gate, clock, 4, 100, plain_tps=140, spec_tps=100)
    assert 0 < sum(chosen) <= 4 and not any(chosen[-50:])


def test_a_probe_measures_the_standing_mode_afresh_after_its_own_switch():
    """The ticks after any switch run slower (here three at 0.65x). Speculation stands at
    100 tok/s from a long run; plain runs 112 in a run of its own. A probe that set plain's
    few post-switch samples (~83) against speculation's long run kept speculation for good;
    measured afresh after the switch back, speculation reads ~74 and plain wins."""
    clock = FakeClock()
    cfg = GateConfig(warmup_ticks=4, probe_ticks=4, reprobe_every_s=1e9,
                     first_reprobe_ticks=30)
    gate = MtpGate(cfg, clock=clock)
    since_switch, chosen = 0, []
    for tick in range(200):
        spec = gate.choose(4)
        since_switch = 0 if chosen and chosen[-1] != spec else since_switch + 1
        rate = 100 if spec else (20 if tick < 6 else 112)  # plain's warm-up on cold ticks
        if since_switch <= 3:
            rate *= 0.65
        chosen.append(spec)
        clock.t += 0.1
        gate.record(4, spec, tokens=round(rate * 0.1 * 10), seconds=1.0)
    assert any(chosen[10:40])          # the cold warm-up chose speculation...
    assert not any(chosen[-100:])      # ...and the early probe found plain faster
    assert not gate.figures(4)["speculating"]


def test_prefills_write_mtp_kv_only_where_decodes_are_expected_to_draft():
    clock = FakeClock()
    for policy, expect in (("on", True), ("off", False)):
        assert MtpGate(GateConfig(policy=policy), clock=clock).expects_speculation(8) is expect
    gate = MtpGate(GateConfig(warmup_ticks=2, reprobe_every_s=1e9), clock=clock)
    assert gate.expects_speculation(1) and gate.expects_speculation(64)  # cold: warm-up drafts
    drive(gate, clock, 1, 8, plain_tps=100, spec_tps=170)
    drive(gate, clock, 60, 8, plain_tps=900, spec_tps=500)
    assert gate.expects_speculation(1) and not gate.expects_speculation(64)
    before = gate.figures(64)
    gate.expects_speculation(64)
    assert gate.figures(64) == before  # a query: nothing recorded
    # A tick with prefill chunks follows the bucket of the batch it will decode, and is no
    # sample: its seconds are the chunks' (recorded with batch 0, only the delivered rate
    # and the mode of the last tick move).
    small = gate.figures(1)
    assert not gate.choose_unmeasured(60) and gate.choose_unmeasured(1)
    gate.record(0, False, tokens=60, seconds=1.0)
    assert gate.figures(64) == before and gate.figures(1) == small
    assert gate.observe()[1] < 900 * 0.95


def test_a_standing_mode_that_falls_behind_calls_a_probe_which_decides():
    clock = FakeClock()
    gate = MtpGate(GateConfig(warmup_ticks=2, probe_ticks=2, doubt_after=3,
                              reprobe_every_s=1e9, first_reprobe_ticks=0), clock=clock)
    # Warm-up: two plain samples, a switch tick and two speculative ones, then the choice.
    assert drive(gate, clock, 1, 5, plain_tps=100, spec_tps=150) == [False] * 2 + [True] * 3
    assert gate.figures(1)["speculating"]
    # Speculation collapses: it stands its `doubt_after` samples and trails for
    # `probe_ticks` in a row, then a probe runs plain (a switch tick, 2 samples) and
    # speculation afresh (as many), and plain wins.
    chosen = drive(gate, clock, 1, 14, plain_tps=100, spec_tps=10)
    assert chosen[:4] == [True] * 4 and chosen[4:7] == [False] * 3
    assert chosen[7:10] == [True] * 3 and not any(chosen[10:])
    assert not gate.figures(1)["speculating"]


def test_a_stalled_tick_now_and_then_does_not_call_a_probe():
    """A tick that stalls now and then (a shared machine), delivering nothing, moves the
    standing mode's EMA past the margin for a sample: no probe. A lag that lasts does."""
    clock = FakeClock()
    gate = MtpGate(GateConfig(warmup_ticks=3, probe_ticks=4, doubt_after=4,
                              reprobe_every_s=1e9, first_reprobe_ticks=0), clock=clock)
    drive(gate, clock, 4, 20, plain_tps=100, spec_tps=75)
    chosen = []
    for tick in range(200):
        chosen += drive(gate, clock, 4, 1, plain_tps=0 if tick % 25 == 0 else 100,
                        spec_tps=75)
    assert not any(chosen)
    assert any(drive(gate, clock, 4, 20, plain_tps=60, spec_tps=75))


def test_a_drifting_machine_does_not_flip_on_a_stale_figure():
    """Plain stands at 100 tok/s, speculation last measured at 90. The machine slows to
    half for four ticks: set against the stale 90, plain's live figure looked behind,
    speculation was switched on, and with the machine fast again its live 90 beat plain's
    figure from the slow ticks, so it stayed on for good. The probe a fall behind calls
    measures both afresh and keeps plain."""
    clock = FakeClock()
    gate = MtpGate(GateConfig(warmup_ticks=3, probe_ticks=3, doubt_after=4,
                              reprobe_every_s=1e9, first_reprobe_ticks=0), clock=clock)
    drive(gate, clock, 4, 20, plain_tps=100, spec_tps=90)
    assert not gate.figures(4)["speculating"]
    drive(gate, clock, 4, 4, plain_tps=50, spec_tps=45)
    chosen = drive(gate, clock, 4, 60, plain_tps=100, spec_tps=90)
    assert not any(chosen[-40:]) and not gate.figures(4)["speculating"]


@pytest.mark.parametrize("policy, expect, mode", [("on", True, MtpMode.ON),
                                                  ("off", False, MtpMode.OFF)])
def test_fixed_policies_never_probe(policy, expect, mode):
    clock = FakeClock()
    gate = MtpGate(GateConfig(policy=policy), clock=clock)
    assert drive(gate, clock, 1, 12, plain_tps=100, spec_tps=10 if expect else 1000) \
        == [expect] * 12
    assert gate.observe()[0] is mode


def test_the_policy_lever_switches_at_runtime_and_keeps_the_figures():
    clock = FakeClock()
    gate = MtpGate(GateConfig(policy="off", warmup_ticks=2), clock=clock)
    drive(gate, clock, 1, 4, plain_tps=100, spec_tps=200)
    gate.set_policy("auto")
    assert gate.figures(1)["plain_samples"] == 4
    drive(gate, clock, 1, 8, plain_tps=100, spec_tps=200)
    assert gate.choose(1)
    with pytest.raises(GateError, match="policy"):
        gate.set_policy("sometimes")


def test_acceptance_per_depth_is_an_ema_of_accepted_over_drafted():
    gate = MtpGate(GateConfig(ema_alpha=0.5), num_depths=2, clock=FakeClock())
    gate.record(1, True, tokens=3, seconds=0.1, accepted=[8, 2], drafted=[10, 10])
    gate.record(1, True, tokens=3, seconds=0.1, accepted=[6, 0], drafted=[10, 0])
    assert gate.acceptance() == pytest.approx((0.7, 0.2))


@pytest.mark.parametrize("bad, field", [(dict(policy="maybe"), "policy"),
                                        (dict(ema_alpha=0.0), "ema_alpha"),
                                        (dict(warmup_ticks=0), "warmup_ticks"),
                                        (dict(first_reprobe_ticks=-1), "first_reprobe_ticks"),
                                        (dict(doubt_after=0), "doubt_after"),
                                        (dict(ramp_ticks=-1), "ramp_ticks"),
                                        (dict(turn_on_ratio=0.9), "hysteresis"),
                                        (dict(reprobe_every_s=0), "reprobe_every_s"),
                                        (dict(max_reprobe_factor=0), "max_reprobe_factor")])
def test_bad_settings_name_the_field(bad, field):
    with pytest.raises(GateError, match=field):
        GateConfig(**bad)


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]
