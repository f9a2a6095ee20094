"""Fixture tables through the real XDP program with BPF_PROG_TEST_RUN: (packet, verdict, output)."""
from __future__ import annotations

import numpy as np
import pytest

from aggd.dataplane.xdp.bpf_syscall import prog_test_run
from aggd.testing.frames import AGG_IP, AGG_MAC, frame, parse, worker_addr
from aggd_client import protocol as proto
from aggd_client.protocol import Flag, Header, MsgType

from tests.fixtures.packets import MALFORMED, contrib, header

from .conftest import ELEMENTS, job_config

pytestmark = pytest.mark.root
GROUP = "239.77.0.1"


def run(dp, pkt):
    return prog_test_run(dp.prog_fd, pkt)


def drops(dp, job=1):
    return dp.job_stats(job).drops


def test_contributions_accumulate_and_last_releases_to_group(dp):
    rng = np.random.default_rng(1)
    vals = [rng.integers(-1000, 1000, ELEMENTS, dtype=np.int32) for _ in range(3)]
    assert run(dp, contrib(0, values=vals[0])).verdict_name == "drop"   # absorbed
    assert run(dp, contrib(1, values=vals[1])).verdict_name == "drop"
    res = run(dp, contrib(2, values=vals[2]))
    assert res.verdict_name == "tx"
    out = parse(res.packet)
    assert out.hdr.type == MsgType.RESULT and out.hdr.rank == 0xFFFF
    assert (out.hdr.job, out.hdr.round, out.hdr.chunk, out.hdr.count) == (1, 0, 0, ELEMENTS)
    assert out.hdr.n_contrib == 3 and out.hdr.contributors == 0b111 and out.hdr.flags == 0
    np.testing.assert_array_equal(out.payload, vals[0] + vals[1] + vals[2])
    # addressed to the job's group, from the aggregator, checksum right
    assert (out.ip_src, out.ip_dst, out.dport, out.sport) == (AGG_IP, GROUP, proto.DEFAULT_RESULT_PORT,
                                                             proto.DEFAULT_PORT)
    assert out.eth_dst == "01:00:5e:4d:00:01" and out.eth_src == AGG_MAC and out.ip_checksum_ok
    # with a UDP checksum, a fixed IP ID and don't-fragment, so a receiver's GRO coalesces results
    assert out.udp_checksum_ok is True and out.ip_id == 0 and out.ip_df
    c = dp.job_stats(1).counters
    assert c["contributions"] == 3 and c["released"] == 1 and c["elements"] == 3 * ELEMENTS


def test_a_frame_for_another_host_is_passed_untouched(dp):
    """Once attached, the program knows its interface's MAC: a unicast frame for another host (a
    switch floods one whose destination it has not learnt, e.g. a dead aggregator's) is passed to
    the stack, which drops it, and is neither counted nor answered (a NACK would reach the sender
    as if that other host had refused it)."""
    dp.set_own_mac(bytes.fromhex(AGG_MAC.replace(":", "")))
    try:
        def to_another_host(frame_bytes):
            return bytes.fromhex("020000000002") + frame_bytes[6:]
        pkt = contrib(2, values=np.ones(ELEMENTS, np.int32))
        other = to_another_host(pkt)
        before = dp.job_stats(1).counters["rx_packets"]
        res = run(dp, other)
        assert res.verdict_name == "pass" and res.packet == other
        assert dp.job_stats(1).counters["rx_packets"] == before
        # not even a NACK for a job this host does not have
        assert run(dp, to_another_host(contrib(2, job=200))).verdict_name == "pass"
        assert run(dp, pkt).verdict_name == "drop"      # its own: absorbed as before
        assert dp.job_stats(1).counters["contributions"] == 1
    finally:
        dp.set_own_mac(None)


def test_duplicate_does_not_count_twice(dp):
    run(dp, contrib(0))
    assert run(dp, contrib(0, flags=Flag.RETRANSMIT)).verdict_name == "drop"
    assert drops(dp)["duplicate"] == 1
    run(dp, contrib(1))
    out = parse(run(dp, contrib(2)).packet)
    np.testing.assert_array_equal(out.payload, np.full(ELEMENTS, 1 + 2 + 3))
    assert dp.job_stats(1).counters["retransmits"] == 1


def test_retransmit_after_release_resends_result_and_shadow_survives_next_round(dp):
    for r in range(3):
        run(dp, contrib(r, round_=0))
    again = run(dp, contrib(1, round_=0, flags=Flag.RETRANSMIT))
    assert again.verdict_name == "tx"
    out = parse(again.packet)
    assert out.hdr.flags & Flag.REREAD and out.hdr.n_contrib == 3
    # only the worker that lost it gets it again, by unicast
    assert (out.ip_dst, out.dport) == worker_addr(1)[1:] and out.eth_dst == worker_addr(1)[0]
    np.testing.assert_array_equal(out.payload, np.full(ELEMENTS, 6))
    # round 1 opens in the other bank: round 0's result is still there for a worker that lost it
    run(dp, contrib(0, round_=1, values=np.full(ELEMENTS, 10, np.int32)))
    reread = run(dp, frame(Header(type=MsgType.REREAD, job=1, rank=2, round=0, chunk=0, count=ELEMENTS),
                           elements=ELEMENTS))
    assert reread.verdict_name == "tx"
    np.testing.assert_array_equal(parse(reread.packet).payload, np.full(ELEMENTS, 6))
    assert dp.job_stats(1).counters["rereads"] == 2


def test_slot_rules_busy_stale_not_ready(dp):
    run(dp, contrib(0, round_=5))
    assert run(dp, contrib(1, round_=6)).verdict_name == "drop"          # round 5 still open
    assert drops(dp)["busy"] == 1
    rr = frame(Header(type=MsgType.REREAD, job=1, rank=1, round=5, chunk=0, count=ELEMENTS), elements=ELEMENTS)
    assert run(dp, rr).verdict_name == "drop"
    assert drops(dp)["not_ready"] == 1
    run(dp, contrib(1, round_=5))
    run(dp, contrib(2, round_=5))
    for round_ in range(6, 10):
        for r in range(3):
            run(dp, contrib(r, round_=round_))
    # four rounds later round 5's bank has been reused: a retransmission of it is stale
    assert run(dp, contrib(0, round_=5, flags=Flag.RETRANSMIT)).verdict_name == "drop"
    assert drops(dp)["stale"] == 1


def test_chunks_map_to_slots_and_rounds_are_independent(dp):
    for chunk in (0, 1, 8, 9):  # 8 slots: chunk 8 reuses slot 0 after chunk 0 released
        for r in range(3):
            res = run(dp, contrib(r, chunk=chunk, values=np.full(ELEMENTS, chunk + r, np.int32)))
        out = parse(res.packet)
        assert out.hdr.chunk == chunk
        np.testing.assert_array_equal(out.payload, np.full(ELEMENTS, 3 * chunk + 3))


def test_exponents_align_to_the_coarsest(dp):
    # value 3.0 at exponent 2 (q=12), 1.5 at exponent 1 (q=3), 1.0 at exponent 3 (q=8)
    run(dp, contrib(0, values=np.full(ELEMENTS, 12, np.int32), exponent=2))
    run(dp, contrib(1, values=np.full(ELEMENTS, 3, np.int32), exponent=1))
    out = parse(run(dp, contrib(2, values=np.full(ELEMENTS, 8, np.int32), exponent=3)).packet)
    assert out.hdr.exponent == 1
    np.testing.assert_array_equal(out.payload, np.full(ELEMENTS, 6 + 3 + 2))  # 5.5 * 2**1 = 11


def test_zero_chunk_never_lowers_the_scale(dp):
    run(dp, contrib(0, values=np.zeros(ELEMENTS, np.int32), exponent=proto.ZERO_EXPONENT))
    run(dp, contrib(1, values=np.full(ELEMENTS, 40, np.int32), exponent=4))
    out = parse(run(dp, contrib(2, values=np.zeros(ELEMENTS, np.int32), exponent=proto.ZERO_EXPONENT)).packet)
    assert out.hdr.exponent == 4
    np.testing.assert_array_equal(out.payload, np.full(ELEMENTS, 40))


def test_int32_overflow_is_flagged(dp):
    big = np.full(ELEMENTS, 2**30, np.int32)
    run(dp, contrib(0, values=big))
    run(dp, contrib(1, values=big))
    out = parse(run(dp, contrib(2, values=np.zeros(ELEMENTS, np.int32))).packet)
    assert out.hdr.flags & Flag.OVERFLOW
    np.testing.assert_array_equal(out.payload, np.full(ELEMENTS, -2**31))  # 2**31, wrapped
    assert dp.job_stats(1).counters["overflows"] == 1


def test_sums_are_exact_so_only_a_result_outside_int32_is_flagged(dp):
    top = np.full(ELEMENTS, 2**31 - 1, np.int32)
    run(dp, contrib(0, values=top))
    run(dp, contrib(1, values=top))                         # 2**32 - 2 held exactly
    assert dp.pending_sum(1) == ELEMENTS * (2**32 - 2)
    out = parse(run(dp, contrib(2, values=np.full(ELEMENTS, -2**31, np.int32))).packet)
    assert not out.hdr.flags & Flag.OVERFLOW
    np.testing.assert_array_equal(out.payload, np.full(ELEMENTS, 2**31 - 2))
    assert dp.job_stats(1).counters["overflows"] == 0


def test_sixty_four_members(dp):
    members = {r: worker_addr(r)[1:] for r in range(64)}
    dp.install_job(job_config(job=2, world=64, members=members))
    for r in range(63):
        assert run(dp, contrib(r, job=2, values=np.full(ELEMENTS, r, np.int32))).verdict_name == "drop"
    out = parse(run(dp, contrib(63, job=2, values=np.full(ELEMENTS, 63, np.int32))).packet)
    assert out.hdr.n_contrib == 64 and out.hdr.contributors == (1 << 64) - 1
    np.testing.assert_array_equal(out.payload, np.full(ELEMENTS, sum(range(64))))


def test_two_jobs_do_not_disturb_each_other(dp):
    dp.install_job(job_config(job=2, world=2, group=("239.77.0.2", 47001)))
    run(dp, contrib(0, job=1))
    run(dp, contrib(0, job=2, values=np.full(ELEMENTS, 100, np.int32)))
    out2 = parse(run(dp, contrib(1, job=2, values=np.full(ELEMENTS, 200, np.int32))).packet)
    assert out2.ip_dst == "239.77.0.2"
    np.testing.assert_array_equal(out2.payload, np.full(ELEMENTS, 300))
    run(dp, contrib(1, job=1))
    out1 = parse(run(dp, contrib(2, job=1)).packet)
    np.testing.assert_array_equal(out1.payload, np.full(ELEMENTS, 6))


@pytest.mark.parametrize("kind", [MsgType.RESULT, MsgType.JOIN_ACK, MsgType.SHARDS])
def test_results_and_join_answers_are_passed_to_the_daemon(dp, kind):
    """A rack job's upper results, the JOIN_ACK of its link and shard maps come to the daemon
    (which refuses a result from anyone but a rack job's upper aggregator, as bad_type)."""
    before = dp.job_stats(None).drops
    res = run(dp, frame(header(type=kind), elements=ELEMENTS))
    assert res.verdict_name == "pass"
    assert dp.job_stats(None).drops == before


@pytest.mark.parametrize("name,make,bucket,reason,nack", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_dropped_and_counted(dp, name, make, bucket, reason, nack):
    before = dp.job_stats(bucket).drops
    res = run(dp, make())
    after = dp.job_stats(bucket).drops
    changed = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert changed == {reason.name.lower(): 1}, name
    if nack is None:
        assert res.verdict_name == "drop"
    else:
        assert res.verdict_name == "tx"
        out = parse(res.packet)
        assert out.hdr.type == MsgType.NACK and out.hdr.code == nack
        assert len(res.packet) == 14 + 20 + 8 + proto.HEADER_SIZE      # never larger than the request
        assert out.ip_dst == parse(make()).ip_src and out.ip_checksum_ok
    # nothing was added anywhere: the job still releases exactly the members' sum
    for r in range(3):
        res = run(dp, contrib(r))
    np.testing.assert_array_equal(parse(res.packet).payload, np.full(ELEMENTS, 6))


def test_other_traffic_passes_untouched(dp):
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import ARP, Ether
    from scapy.packet import Raw
    others = [
        Ether() / ARP(),
        Ether() / IP(dst=AGG_IP) / TCP(dport=proto.DEFAULT_PORT),
        Ether() / IP(dst=AGG_IP) / UDP(dport=53) / Raw(b"x" * 100),
        Ether() / IP(dst=AGG_IP, flags="MF") / UDP(dport=proto.DEFAULT_PORT) / Raw(b"x" * 100),
    ]
    for p in others:
        data = bytes(p)
        res = run(dp, data)
        assert res.verdict_name == "pass" and res.packet == data


def test_packets_the_kernel_cannot_hold_go_to_user_space(dp):
    dp.install_job(job_config(job=3, slots=8, kernel_slots=4))
    short = frame(header(job=3, count=10), np.ones(10, np.int32))
    assert run(dp, short).verdict_name == "pass"
    beyond = contrib(0, job=3, chunk=5)  # slot 5 of 8: only 4 are in the kernel
    assert run(dp, beyond).verdict_name == "pass"
    assert dp.job_stats(3).counters["to_userspace"] == 2


def test_forged_tag_is_dropped_silently_and_the_member_is_unharmed(dp):
    """Members with tags: a packet from a member's address without its tag is dropped ``bad_tag``
    (no NACK: it would go to the real member) and takes nothing; the members' own packets count."""
    tags = {0: 0xA1, 1: 0xB2, 2: 0xC3}
    dp.install_job(job_config(tags=tags))
    for forged in (0, 0xB2, 0xA1 ^ 1 << 63):
        assert run(dp, contrib(0, values=np.full(ELEMENTS, 10**6, np.int32), contributors=forged)).verdict_name == "drop"
    assert drops(dp)["bad_tag"] == 3 and dp.job_stats(1).counters["contributions"] == 0
    for r in range(3):
        res = run(dp, contrib(r, contributors=tags[r]))
    np.testing.assert_array_equal(parse(res.packet).payload, np.full(ELEMENTS, 1 + 2 + 3))
    assert drops(dp)["duplicate"] == 0 and dp.job_stats(1).counters["contributions"] == 3
    dp.set_member(1, 0, worker_addr(0)[1:], 0xD4)          # rejoined: a new tag, the old one is refused
    assert run(dp, contrib(0, round_=1, contributors=0xA1)).verdict_name == "drop"
    assert drops(dp)["bad_tag"] == 4
    run(dp, contrib(0, round_=1, contributors=0xD4))
    assert dp.job_stats(1).counters["contributions"] == 4
