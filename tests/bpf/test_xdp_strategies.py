"""Each strategy and the hot swap, on the real XDP program through BPF_PROG_TEST_RUN (4 members)."""
from __future__ import annotations

import numpy as np
import pytest

from aggd.core import strategy as strat
from aggd.dataplane.xdp.bpf_syscall import prog_test_run
from aggd.testing.frames import frame, parse, worker_addr
from aggd_client.protocol import Flag, Header, MsgType, StrategyKind

from .conftest import ELEMENTS, job_config

pytestmark = pytest.mark.root
GROUP = "239.77.0.1"
T0 = 1_000_000_000


@pytest.fixture
def dp4(xdp_program):
    xdp_program.remove_job(1)
    xdp_program.install_job(job_config(job=1, world=4, slots=8))
    xdp_program.set_clock(T0)
    yield xdp_program
    xdp_program.set_clock(0)


def use(dp, text, version=1, from_round=0):
    dp.set_strategy(1, [strat.to_entry(strat.SYNC, 0, 0),
                        strat.to_entry(strat.parse(text).validate(4), version, from_round)])


def send(dp, rank, round_=0, value=None, step=0, flags=0, type_=MsgType.CONTRIB):
    value = rank + 1 if value is None else value
    pkt = frame(Header(type=type_, job=1, rank=rank, round=round_, count=ELEMENTS, step=step, flags=flags),
                np.full(ELEMENTS, value, np.int32), elements=ELEMENTS)
    res = prog_test_run(dp.prog_fd, pkt)
    return res.verdict_name, (parse(res.packet) if res.verdict_name == "tx" else None)


def test_quorum_releases_without_the_straggler_and_carries_its_gradient(dp4):
    use(dp4, "quorum:3:50ms")
    assert send(dp4, 0)[0] == "drop" and send(dp4, 1)[0] == "drop"
    verdict, out = send(dp4, 2)
    assert verdict == "tx" and out.ip_dst == GROUP
    assert out.hdr.n_contrib == 3 and out.hdr.contributors == 0b0111
    assert out.hdr.strategy == StrategyKind.QUORUM and out.hdr.param == 3 and out.hdr.strategy_version == 1
    assert out.payload[0] == 1 + 2 + 3
    # the straggler (rank 3) is late: its gradient goes into round 1; it gets round 0's result
    verdict, late = send(dp4, 3, value=100)
    assert verdict == "tx" and late.ip_dst == worker_addr(3)[1] and late.hdr.round == 0
    assert late.hdr.flags & Flag.REREAD and late.payload[0] == 6
    # a retransmission of the late packet is not carried twice
    assert send(dp4, 3, value=100, flags=Flag.RETRANSMIT)[1].hdr.round == 0
    for r in range(3):
        verdict, out = send(dp4, r, round_=1)
    assert verdict == "tx" and out.hdr.round == 1
    assert out.payload[0] == 100 + 1 + 2 + 3 and out.hdr.n_contrib == 4 and out.hdr.flags & Flag.CARRIED
    assert out.hdr.contributors == 0b0111  # the carried one is counted, not listed as a round-1 member
    assert dp4.job_stats(1).counters["carried"] == 1


def test_quorum_deadline_releases_with_fewer_than_k(dp4):
    use(dp4, "quorum:3:20ms")
    send(dp4, 0)
    send(dp4, 1)
    assert send(dp4, 1, flags=Flag.RETRANSMIT)[0] == "drop"             # before the deadline: duplicate
    dp4.set_clock(T0 + 21_000_000)
    verdict, out = send(dp4, 1, flags=Flag.RETRANSMIT)                   # a waiting member's retransmission
    assert verdict == "tx" and out.hdr.n_contrib == 2 and out.payload[0] == 3
    assert out.ip_dst == GROUP                                           # the release is announced once
    verdict, again = send(dp4, 0, flags=Flag.RETRANSMIT)
    assert again.ip_dst == worker_addr(0)[1] and again.hdr.flags & Flag.REREAD
    assert dp4.job_stats(1).counters["timeouts"] == 1


def test_ssp_lets_a_member_run_two_rounds_ahead_and_no_further(dp4):
    use(dp4, "ssp:2")
    for round_ in range(3):
        assert send(dp4, 0, round_=round_)[0] == "drop"                 # rounds 0, 1, 2 open
    assert send(dp4, 0, round_=3)[0] == "drop"
    assert dp4.job_stats(1).drops["busy"] == 1                          # round 3: too far ahead
    for r in (1, 2, 3):
        verdict, out = send(dp4, r, round_=0)
    assert verdict == "tx" and out.hdr.round == 0 and out.hdr.n_contrib == 4
    assert send(dp4, 0, round_=3)[0] == "drop" and dp4.job_stats(1).drops["busy"] == 1  # admitted now


def test_async_answers_at_once_with_the_running_sum(dp4):
    use(dp4, "async")
    verdict, out = send(dp4, 0, value=10)
    assert verdict == "tx" and out.ip_dst == worker_addr(0)[1] and out.payload[0] == 10 and out.hdr.n_contrib == 1
    verdict, out = send(dp4, 1, value=20)
    assert out.payload[0] == 30 and out.hdr.n_contrib == 2 and out.ip_dst == worker_addr(1)[1]
    send(dp4, 2, value=30)
    verdict, out = send(dp4, 3, value=40)
    assert out.ip_dst == GROUP and out.payload[0] == 100 and out.hdr.n_contrib == 4
    assert dp4.job_stats(1).counters["partials"] == 3


def test_wbsp_counts_the_fast_members_extra_steps(dp4):
    use(dp4, "wbsp")
    for step in range(3):                                                # a fast member pushes 3 local steps
        assert send(dp4, 0, value=1, step=step)[0] == "drop"
    assert send(dp4, 0, value=1, step=1, flags=Flag.RETRANSMIT)[0] == "drop"
    assert dp4.job_stats(1).drops["duplicate"] == 1
    send(dp4, 1, value=1)
    send(dp4, 2, value=1)
    verdict, out = send(dp4, 3, value=1)                                 # the slowest member arrives
    assert verdict == "tx" and out.hdr.n_contrib == 6 and out.payload[0] == 6 and out.hdr.contributors == 0b1111


def test_hot_swap_takes_effect_from_the_stated_round(dp4):
    use(dp4, "quorum:2:50ms", version=1, from_round=2)
    assert dp4.max_round(1) is None
    for round_ in range(4):
        for r in range(4):
            verdict, out = send(dp4, r, round_=round_)
            if verdict == "tx" and out.ip_dst == GROUP:
                break
        expected = (0, StrategyKind.SYNC, 4) if round_ < 2 else (1, StrategyKind.QUORUM, 2)
        assert (out.hdr.strategy_version, out.hdr.strategy, out.hdr.n_contrib) == expected
        assert out.hdr.round == round_
    assert dp4.max_round(1) == 3  # where the daemon starts the next swap from


def test_member_stats_measure_each_members_lag(dp4):
    for r in range(3):
        dp4.set_clock(T0 + r * 1_000_000)           # ranks 0, 1, 2 arrive 0, 1 and 2 ms after the first
        send(dp4, r)
    dp4.set_clock(T0 + 7_000_000)
    send(dp4, 3)                                     # the straggler, 7 ms after the first
    rows = dp4.member_stats(1, 4)
    assert [row["lag_ns_sum"] for row in rows] == [0, 1_000_000, 2_000_000, 7_000_000]
    assert [row["last_round"] for row in rows] == [0, 0, 0, 0]
    assert all(row["contributions"] == 1 and row["late"] == 0 for row in rows)


def test_wbsp_step_lost_then_retransmitted_still_counts(dp4):
    use(dp4, "wbsp")
    send(dp4, 0, value=1, step=1)                                   # step 0 was lost in transit
    assert send(dp4, 0, value=1, step=0, flags=Flag.RETRANSMIT)[0] == "drop"
    assert dp4.job_stats(1).drops["duplicate"] == 0
    for r in (1, 2):
        send(dp4, r, value=1)
    verdict, out = send(dp4, 3, value=1)
    assert verdict == "tx" and out.hdr.n_contrib == 5 and out.payload[0] == 5


def test_wbsp_step_that_meets_a_sync_round_is_carried_not_lost(dp4):
    use(dp4, "sync")                                                # a swap made the round sync
    for r in range(4):
        send(dp4, r, value=1)                                       # round 0 released
    verdict, out = send(dp4, 0, value=10, step=1)                   # a wbsp step sent before the swap
    assert verdict == "tx" and out.hdr.round == 0 and out.hdr.flags & Flag.REREAD
    for r in range(4):
        verdict, out = send(dp4, r, round_=1, value=1)
    assert out.hdr.round == 1 and out.payload[0] == 14 and out.hdr.flags & Flag.CARRIED
