"""The straggler detector (aggd.core.straggler) against synthetic data-plane counters: jobs played
the way the XDP program counts them (tests/harness/straggler_sim.py)."""
from __future__ import annotations

import pytest

from aggd.core.straggler import Detector, DetectorConfig, Snapshot

from tests.harness.straggler_sim import const, run, simulate


def test_an_even_job_is_never_flagged():
    for seed in range(5):
        det, obs = run(simulate(4, const(0.02), rounds=300, jitter=0.15, seed=seed), 4)
        assert len(obs) > 20
        assert not any(o.stragglers for o in obs), [o.stragglers for o in obs if o.stragglers][:3]
        assert max(w.slowdown for o in obs for w in o.workers) < 1.3


@pytest.mark.parametrize("factor", [2.0, 3.0, 4.0])
def test_a_slow_member_under_sync_is_flagged_within_a_few_rounds(factor):
    det, obs = run(simulate(4, const(0.02, factor, start=50), rounds=200, seed=1), 4)
    flagged = [o for o in obs if o.stragglers]
    assert flagged and flagged[0].round <= 50 + 12, flagged[0].round if flagged else None
    assert all(o.stragglers == (3,) for o in flagged)
    # once flagged it stays flagged, and the estimate is close to the truth
    after = [o for o in obs if o.round >= flagged[0].round]
    assert all(o.stragglers == (3,) for o in after)
    assert abs(after[-1].workers[3].slowdown - factor) / factor < 0.25, after[-1].workers[3].slowdown
    assert all(after[-1].workers[i].slowdown < 1.2 for i in range(3))
    # lag: the straggler's contributions arrive (factor - 1) steps after the others'
    assert after[-1].workers[3].lag_ms == pytest.approx((factor - 1) * 20, rel=0.25)


def test_waiting_time_is_what_the_fast_members_spend_at_the_barrier():
    det, obs = run(simulate(4, const(0.02, 3.0), rounds=100, jitter=0.0, seed=2), 4)
    w = det.workers
    # 100 rounds, each fast member waits 40 ms for the straggler: about 4 s (the intervals seen so far)
    counted = sum(o.rounds for o in obs)
    for i in range(3):
        assert w[i].wait_s == pytest.approx(counted * 0.040, rel=0.1)
    assert w[3].wait_s < 0.05 * w[0].wait_s


def test_a_straggler_the_quorum_leaves_behind_is_still_flagged_and_cleared_when_it_recovers():
    # 3x slower for rounds 0..149: its contributions are late (carried), it makes a third as many
    snaps = simulate(4, const(0.02, 3.0, end=150), rounds=300, strategy="quorum", k=3, seed=3)
    det, obs = run(snaps, 4)
    slow_phase = [o for o in obs if 20 <= o.round < 140]
    assert slow_phase and all(o.stragglers == (3,) for o in slow_phase), [o.stragglers for o in slow_phase]
    assert det.workers[3].late > 0
    late_phase = [o for o in obs if o.round >= 150 + 20]
    assert late_phase and not any(o.stragglers for o in late_phase)


def test_wbsp_fast_members_extra_steps_show_the_straggler_by_rate():
    snaps = simulate(4, const(0.02, 3.0), rounds=120, seed=4,
                     steps_per_round=lambda i, r: 3 if i < 3 else 1)
    det, obs = run(snaps, 4)
    assert obs[-1].stragglers == (3,)


def test_snapshots_accumulate_until_an_interval_holds_enough_rounds():
    snaps = simulate(4, const(0.02), rounds=60, poll=0.01, jitter=0.0)
    det = Detector(4, DetectorConfig(min_rounds=4))
    outs = [det.update(s) for s in snaps]
    obs = [o for o in outs if o is not None]
    assert obs and all(o.rounds >= 4 for o in obs)
    assert sum(1 for o in outs if o is None) > len(obs)  # most 10 ms polls closed no interval


def test_counters_that_go_backwards_restart_the_detector():
    snaps = simulate(4, const(0.02, 3.0), rounds=80, seed=5)
    det, obs = run(snaps, 4)
    assert det.last.stragglers == (3,)
    fresh = simulate(4, const(0.02), rounds=80, seed=6)  # the job re-created: counters from zero
    obs2 = [o for o in (det.update(s) for s in fresh) if o is not None]
    assert obs2 and not obs2[-1].stragglers
    assert det.workers[3].wait_s < 1.0  # the old job's waiting time is gone


def test_idle_job_gives_no_observation_and_a_silent_member_is_as_slow_as_it_gets():
    det = Detector(3)
    s0 = Snapshot(0.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (None, None, None))
    assert det.update(s0) is None
    assert det.update(Snapshot(1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (None, None, None))) is None
    o = det.update(Snapshot(2.0, (100, 100, 0), (0, 0, 0), (0, 0, 0), (9, 9, None)))
    assert o is not None and o.stragglers == (2,) and o.workers[2].slowdown >= 5


def test_from_rows_reads_member_stats_rows():
    rows = [{"rank": 0, "contributions": 5, "lag_ns_sum": 7, "late": 1, "last_round": 3, "last_ns": 9},
            {"rank": 1, "contributions": 6, "lag_ns_sum": 8, "late": 0, "last_round": None, "last_ns": 0}]
    s = Snapshot.from_rows(1.5, rows)
    assert s.contributions == (5, 6) and s.lag_ns_sum == (7, 8) and s.late == (1, 0) and s.round == 3


def test_bad_configuration_is_refused():
    for bad in ({"slow_factor": 1.0}, {"alpha": 0}, {"min_rounds": 0}, {"max_slowdown": 1.2}):
        with pytest.raises(ValueError):
            DetectorConfig(**bad)
    with pytest.raises(ValueError):
        Detector(0)


def test_a_member_declared_gone_slows_nobody():
    """A dead worker contributes nothing while the others go on (the daemon declared it gone:
    rounds do not wait for it). It was flagged a straggler by the rate view, and the policy
    switched the job to a quorum for it; given as absent it is never flagged, nor counted in the
    medians."""
    def snaps():
        for k in range(6):
            yield Snapshot(float(k), (40 * k, 40 * k, 40 * k, 40), (0, 0, 0, 0), (0, 0, 0, 0),
                           (10 * k, 10 * k, 10 * k, 1))
    det = Detector(4)
    assert [o for o in map(det.update, snaps()) if o][-1].stragglers == (3,)
    det = Detector(4)
    last = [o for o in (det.update(s, absent=0b1000) for s in snaps()) if o][-1]
    assert last.stragglers == () and last.workers[3].slowdown == 1.0
    assert all(w.slowdown == 1.0 for w in last.workers)
