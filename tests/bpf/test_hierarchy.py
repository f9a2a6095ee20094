"""A rack job in the real XDP program (BPF_PROG_TEST_RUN), packet for packet equal to the reference
model (docs/protocol.md, "Two levels"): the program sends complete rounds up to the upper
aggregator, re-sends them when a member retransmits, relays the upper results to the rack's group
(whether they come to its port or to its result group) and keeps them for re-reads."""
from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from aggd.core.model import AggregatorModel, Upstream
from aggd.dataplane.xdp.bpf_syscall import XDP_PASS, XDP_TX, prog_test_run
from aggd_client.protocol import Counter, Flag, Header, MsgType, PAYLOAD_DTYPE

from tests.bpf.conftest import ELEMENTS
from tests.harness.equivalence import ip_checksum, mac_bytes
from tests.harness.tree_sim import (GROUP, RACK_JOB, UPPER, UPPER_GROUP, UPPER_JOB, Tree, contribution, exact, link,
                                    model_tree, rack_config, worker_addr)
from tests.harness.xdp_model import RackPair

pytestmark = pytest.mark.root


def pair(dp, members=2, slots=4, linked=True) -> RackPair:
    p = RackPair(dp, rack_config(0, members, slots=slots), link(0) if linked else Upstream(UPPER))
    return p


@pytest.mark.parametrize("seed,loss", [(0, 0.0), (1, 0.1), (2, 0.25), (3, 0.25)])
def test_a_rack_in_xdp_under_loss_equals_the_model(dp, seed, loss):
    """Three racks, rack 0 the XDP program beside the model, under an upper model; tensors that
    shrink and grow, more chunks than slots."""
    racks, members = 3, 2
    planes, upper = model_tree(racks, members, elements=ELEMENTS, slots=4)
    planes[0] = pair(dp, members)
    calls = [5, 1, 9, 2, 12, 1]
    workers = Tree(planes, upper, members, ELEMENTS, slots=4, loss=loss, seed=seed).run(calls)
    for w in workers:
        for round_, n in enumerate(calls):
            for chunk in range(n):
                values, h = w.got[(round_, chunk)]
                assert values.tolist() == exact(workers, members, racks, round_, chunk, ELEMENTS).tolist()
                assert h.n_contrib == racks * members
    planes[0].check_counters()
    c = dp.job_stats(RACK_JOB).counters
    assert c["released"] == sum(calls) and c["forwarded"] >= sum(calls) and c["relayed"] >= sum(calls)


@pytest.fixture(scope="module")
def frags_program():
    """The program built for multi-buffer frames (MTU 9000), at the largest native packet."""
    from aggd.dataplane.xdp.loader import XdpDataPlane
    from aggd_client.protocol import NATIVE_MAX_ELEMENTS
    dp = XdpDataPlane(None, elements=NATIVE_MAX_ELEMENTS, total_slots=64)
    assert dp.frags
    yield dp
    dp.close()


def test_a_rack_in_the_multi_buffer_program_equals_the_model(frags_program):
    from aggd_client.protocol import NATIVE_MAX_ELEMENTS as E
    racks, members = 2, 3
    planes, upper = model_tree(racks, members, elements=E, slots=4)
    planes[0] = RackPair(frags_program, rack_config(0, members, slots=4), link(0), elements=E)
    calls = [3, 1, 6, 2]
    workers = Tree(planes, upper, members, E, slots=4, loss=0.2, seed=5).run(calls)
    for w in workers:
        for round_, n in enumerate(calls):
            for chunk in range(n):
                assert w.got[(round_, chunk)][0].tolist() == exact(workers, members, racks, round_, chunk, E).tolist()
    planes[0].check_counters()


def contribute(p: RackPair, rank: int, flags=0):
    data = Header(type=MsgType.CONTRIB, job=RACK_JOB, rank=rank, round=0, chunk=0, count=ELEMENTS,
                  flags=flags).pack() + contribution(0, rank, 2, 0, 0, ELEMENTS).tobytes()
    return p.process(data, worker_addr(0, rank))


def test_rounds_complete_before_the_link_go_up_once_it_is(dp):
    p = pair(dp, linked=False)
    contribute(p, 0)
    assert contribute(p, 1).action == "drop"                 # kept
    p.link(link(0))
    v = contribute(p, 0, Flag.RETRANSMIT)
    assert v.dest == "upstream" and v.header.flags & Flag.RETRANSMIT and v.header.n_contrib == 2
    p.check_counters()


def test_an_upper_result_to_the_rack_group_is_relayed_by_the_program(dp):
    """The upper aggregator multicasts its results to its group and port, not the aggd port: the
    program takes a result for a rack job from there too; another packet to that port it passes."""
    p = pair(dp)
    contribute(p, 0)
    contribute(p, 1)
    values = np.arange(ELEMENTS, dtype=PAYLOAD_DTYPE) - 5
    msg = Header(type=MsgType.RESULT, job=UPPER_JOB, rank=0xFFFF, round=0, chunk=0, count=ELEMENTS, exponent=2,
                 n_contrib=4, contributors=3).pack() + values.tobytes()
    udp_len = 8 + len(msg)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0, 64, 17, 0, socket.inet_aton(UPPER[0]),
                     socket.inet_aton(UPPER_GROUP[0]))
    ip = ip[:10] + struct.pack("!H", ip_checksum(ip)) + ip[12:]
    eth = mac_bytes("01:00:5e:4d:09:07") + mac_bytes("02:00:00:00:09:01") + b"\x08\x00"
    frame = eth + ip + struct.pack("!HHHH", UPPER[1], UPPER_GROUP[1], udp_len, 0) + msg
    res = prog_test_run(dp.prog_fd, frame)
    assert res.verdict == XDP_TX
    assert p.model.process(msg, UPPER).out == res.packet[42:]      # as the model relays it
    out = Header.unpack(res.packet[42:82])
    assert (out.type, out.job, out.exponent, out.n_contrib, out.contributors) == (MsgType.RESULT, RACK_JOB, 2, 4, 3)
    assert socket.inet_ntoa(res.packet[30:34]) == GROUP[0] and struct.unpack("!H", res.packet[36:38])[0] == GROUP[1]
    assert res.packet[82:] == values.tobytes()
    assert dp.job_stats(RACK_JOB).counters["relayed"] == 1
    # a result of another job, or from elsewhere, to that port: not ours
    other = frame[:42] + Header(**{**vars(Header.unpack(msg)), "job": 9}).pack() + msg[40:]
    assert prog_test_run(dp.prog_fd, other).verdict == XDP_PASS
    # a member that lost it gets it from the bank
    again = contribute(p, 1, Flag.RETRANSMIT)
    assert again.dest == "sender" and again.out[40:] == values.tobytes()


def test_a_nack_from_the_linked_upper_aggregator_is_passed_to_the_daemon(dp):
    """An upper aggregator that refuses a rack's sum (its job deleted and created again) NACKs it:
    the program passes such a NACK up (the daemon joins the upper job again); a NACK from anyone
    else, or for another job, it drops as bad_type as before."""
    from aggd_client.protocol import DropReason, NackCode
    pair(dp)

    def nack(src, job=UPPER_JOB):
        msg = Header(type=MsgType.NACK, job=job, rank=0, round=0, chunk=0, code=NackCode.NOT_MEMBER).pack()
        udp_len = 8 + len(msg)
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0, 64, 17, 0, socket.inet_aton(src[0]),
                         socket.inet_aton("10.77.0.1"))
        ip = ip[:10] + struct.pack("!H", ip_checksum(ip)) + ip[12:]
        eth = mac_bytes("ff:ff:ff:ff:ff:ff") + mac_bytes("02:00:00:00:09:01") + b"\x08\x00"
        return prog_test_run(dp.prog_fd, eth + ip + struct.pack("!HHHH", src[1], 47000, udp_len, 0) + msg).verdict

    bad_type = DropReason.BAD_TYPE.name.lower()
    before = dp.job_stats(None).drops[bad_type]
    assert nack(UPPER) == XDP_PASS
    assert dp.job_stats(None).drops[bad_type] == before
    assert nack(worker_addr(0, 0)) != XDP_PASS and nack(UPPER, job=UPPER_JOB + 1) != XDP_PASS
    assert dp.job_stats(None).drops[bad_type] == before + 2


def test_a_later_upper_result_of_a_relayed_round_goes_on_labelled_as_it_came(dp):
    """An async upper job's running sum, then the round's release with another exponent and
    n_contrib: the program relays the second with its own labels, as the model does."""
    p = pair(dp)
    contribute(p, 0)
    contribute(p, 1)
    for exponent, n_contrib, scale in ((3, 2, 1), (2, 4, 3)):
        values = np.arange(ELEMENTS, dtype=PAYLOAD_DTYPE) * scale
        v = p.process(Header(type=MsgType.RESULT, job=UPPER_JOB, rank=0xFFFF, round=0, chunk=0, count=ELEMENTS,
                             exponent=exponent, n_contrib=n_contrib).pack() + values.tobytes(), UPPER)
        assert (v.header.exponent, v.header.n_contrib) == (exponent, n_contrib) and v.out[40:] == values.tobytes()
