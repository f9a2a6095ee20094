"""The client's retransmission timeout estimate and congestion window (aggd_client.flow)."""
from __future__ import annotations

import pytest

from aggd_client.flow import (MAX_INFLIGHT_BYTES, MAX_INFLIGHT_PACKETS, MIN_WINDOW, CongestionWindow,
                              RtoEstimator, default_window)


def test_rto_starts_at_initial_and_follows_rfc6298():
    est = RtoEstimator(initial=0.05, floor=0.01, cap=1.0)
    assert est.rto == 0.05 and est.srtt is None
    est.sample(0.1)  # first sample: srtt = r, rttvar = r / 2
    assert est.srtt == pytest.approx(0.1) and est.rttvar == pytest.approx(0.05)
    assert est.rto == pytest.approx(0.1 + 4 * 0.05)
    est.sample(0.2)
    assert est.rttvar == pytest.approx(0.75 * 0.05 + 0.25 * 0.1)
    assert est.srtt == pytest.approx(0.875 * 0.1 + 0.125 * 0.2)
    assert est.rto == pytest.approx(est.srtt + 4 * est.rttvar)


def test_rto_converges_to_a_steady_answer_time_and_stays_within_floor_and_cap():
    est = RtoEstimator(initial=0.05, floor=0.05, cap=1.0)
    for _ in range(200):
        est.sample(0.12)  # a large window on shared cores: answers take 120 ms, steadily
    assert est.srtt == pytest.approx(0.12, rel=1e-6) and est.rto == pytest.approx(0.12, rel=1e-3)
    for _ in range(200):
        est.sample(0.001)  # fast path: the floor holds
    assert est.rto == 0.05
    for _ in range(50):
        est.sample(30.0)
    assert est.rto == 1.0
    assert est.sample(-1.0) == 1.0  # a clock step is ignored


def test_rto_refuses_a_floor_above_the_cap():
    with pytest.raises(ValueError):
        RtoEstimator(initial=0.05, floor=2.0, cap=1.0)


def test_window_slow_start_then_additive_increase():
    w = CongestionWindow(limit=4096, initial=64)
    assert w.size == 64
    w.acked(64)
    assert w.size == 128  # slow start: one more per chunk answered
    w.acked(10_000)
    assert w.size == 4096  # never beyond the limit
    w.lost(now=1.0, rtt=0.01)
    assert w.size == 2048 and w.ssthresh == 2048
    w.acked(2048)  # after a loss: about one more per window of answers
    assert w.size == 2049


def test_window_halves_at_most_once_per_round_trip_and_never_below_the_floor():
    w = CongestionWindow(limit=1024, initial=1024)
    assert w.lost(now=10.0, rtt=0.05)
    assert not w.lost(now=10.01, rtt=0.05)  # the same window's timeouts: one event
    assert w.size == 512
    t = 10.0
    for _ in range(20):
        t += 1.0
        w.lost(now=t, rtt=0.05)
    assert w.size == MIN_WINDOW


def test_a_small_limit_is_its_own_floor():
    w = CongestionWindow(limit=3)
    assert w.size == 3
    w.lost(now=1.0, rtt=0.1)
    assert w.size == 3
    with pytest.raises(ValueError):
        CongestionWindow(limit=0)


def test_default_window_is_bounded_by_bytes_in_flight_and_by_slots():
    assert default_window(8192, 3360) == MAX_INFLIGHT_BYTES // 3360  # 832-value packets: ~5,000
    assert default_window(4096, 3360) == 4096  # ... of which the default 4096 slots hold fewer
    assert default_window(4096, 32800) == MAX_INFLIGHT_BYTES // 32800  # 8,192 values: ~510
    assert default_window(64, 1056) == 64  # small packets: the slots bound it
    assert default_window(4096, MAX_INFLIGHT_BYTES) == MIN_WINDOW  # never below the floor ...
    assert default_window(3, MAX_INFLIGHT_BYTES) == 3  # ... unless the slots are fewer


def test_default_window_shares_packets_in_flight_among_members():
    mtu1500 = 1474  # 358 values
    assert default_window(4096, mtu1500, members=1) == 4096
    assert default_window(4096, mtu1500, members=4) == MAX_INFLIGHT_PACKETS // 4
    assert default_window(4096, mtu1500, members=8) == MAX_INFLIGHT_PACKETS // 8
    assert default_window(4096, 8966, members=4) == MAX_INFLIGHT_BYTES // 8966  # MTU 9000: bytes bound
    assert default_window(4096, mtu1500, members=256) == 32
    assert default_window(4096, mtu1500, members=2048) == MIN_WINDOW  # never below the floor


def test_an_answer_time_that_is_not_finite_or_negative_is_ignored():
    est = RtoEstimator(0.05, 0.05, 1.0)
    est.sample(0.1)
    before = (est.srtt, est.rttvar, est.rto)
    for bad in (float("inf"), float("nan"), -0.01):  # a hurried chunk's time is -inf: now - -inf
        assert est.sample(bad) == before[2]
    assert (est.srtt, est.rttvar, est.rto) == before


def test_queueing_is_answer_times_well_above_the_shortest_recent_one():
    """A loss cuts the window only where answers show a queue: srtt at QUEUE_DELAY_FACTOR times the
    shortest answer time of the last MIN_RTT_WINDOW seconds; before 8 samples every loss counts."""
    from aggd_client.flow import MIN_RTT_WINDOW, QUEUE_DELAY_FACTOR
    est = RtoEstimator(0.05, 0.05, 1.0)
    assert est.queueing                      # nothing known yet: as TCP, a loss is congestion
    for i in range(20):
        est.sample(0.001, now=i * 0.01)
    assert est.min_rtt == pytest.approx(0.001) and not est.queueing   # a lossy link, no queue
    for i in range(40):
        est.sample(0.001 * QUEUE_DELAY_FACTOR * 2, now=0.2 + i * 0.01)
    assert est.queueing                      # answers now wait in a queue
    # a path slower for good: after MIN_RTT_WINDOW its answer time is the new shortest
    later = 0.6 + MIN_RTT_WINDOW
    for i in range(40):
        est.sample(0.004, now=later + i * 0.01)
    assert est.min_rtt == pytest.approx(0.004) and not est.queueing
