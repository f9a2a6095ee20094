"""The numba kernels against the numpy reference, and the user-space server over real UDP."""
from __future__ import annotations

import random
import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.dataplane.userspace import kernels
from aggd.core.model import (NO_JOB, NUMPY_ARITHMETIC, AggregatorModel, JobConfig, np_accumulate, np_load,
                        np_narrow)
from aggd.dataplane import DataPlaneError
from aggd.dataplane.userspace.server import UserspaceAggregator
from aggd_client.protocol import (HEADER_SIZE, ZERO_EXPONENT, Counter, DropReason, Flag, Header,
                                  MsgType, NackCode, decode)

# ---------------------------------------------------------------------------------------------
# Kernels == numpy reference.

int32_arrays = st.integers(0, 40).flatmap(
    lambda n: st.lists(st.integers(-2**31, 2**31 - 1), min_size=n, max_size=n))
exps = st.one_of(st.integers(-50, 50), st.sampled_from([ZERO_EXPONENT, -32768, 32767]))


sums = st.integers(0, 40).flatmap(
    lambda n: st.lists(st.integers(-2**40, 2**40), min_size=n, max_size=n))


@settings(max_examples=300, deadline=None)
@given(sums, exps, int32_arrays, exps)
def test_accumulate_kernel_matches_numpy(acc, acc_exp, src, src_exp):
    a_np = np.array(acc, np.int64)
    a_nb = a_np.copy()
    src_arr = np.array(src, np.int32)
    ref = np_accumulate(a_np, acc_exp, src_arr, src_exp)
    got = kernels.KERNEL_ARITHMETIC.accumulate(a_nb, acc_exp, src_arr, src_exp)
    assert got == ref and type(got) is int
    assert a_nb.tolist() == a_np.tolist()


@settings(max_examples=300, deadline=None)
@given(sums)
def test_narrow_kernel_matches_numpy(values):
    arr = np.array(values, np.int64)
    ref, ref_ovf = np_narrow(arr)
    got, got_ovf = kernels.KERNEL_ARITHMETIC.narrow(arr)
    assert got.tolist() == ref.tolist() and got_ovf is ref_ovf
    assert ref_ovf == any(not -2**31 <= v < 2**31 for v in values)
    assert got.tolist() == [(v + 2**31) % 2**32 - 2**31 for v in values]


def test_accumulate_kernel_exact_sums_and_shift_cases():
    rng = np.random.default_rng(1)
    for acc_exp, src_exp in [(0, 0), (3, 0), (0, 3), (0, 40), (40, 0), (70, 0), (-5, ZERO_EXPONENT)]:
        acc = rng.integers(-2**40, 2**40, 512, dtype=np.int64)
        src = rng.integers(-2**31, 2**31, 512, dtype=np.int64).astype(np.int32)
        ref_acc, nb_acc = acc.copy(), acc.copy()
        ref = np_accumulate(ref_acc, acc_exp, src, src_exp)
        assert kernels.KERNEL_ARITHMETIC.accumulate(nb_acc, acc_exp, src, src_exp) == ref
        assert np.array_equal(ref_acc, nb_acc)
    # sums leave int32 without wrapping; only what is sent is narrowed (and flagged)
    a = np.array([2**31 - 1, -2**31, 0], np.int64)
    assert kernels.KERNEL_ARITHMETIC.accumulate(a, 0, np.array([1, -1, 1], np.int32), 0) == 0
    assert a.tolist() == [2**31, -2**31 - 1, 1]
    out, overflow = kernels.KERNEL_ARITHMETIC.narrow(a)
    assert overflow and out.tolist() == [-2**31, 2**31 - 1, 1]
    # read-only payloads straight from a received datagram, shorter than the slot
    a = np.full(4, 8, np.int64)
    src = np.frombuffer(np.array([16, -16], "<i4").tobytes(), "<i4")
    assert kernels.KERNEL_ARITHMETIC.accumulate(a, 1, src, 2) == 1
    assert a.tolist() == [16, 0, 8, 8]


@given(int32_arrays, st.integers(0, 40))
def test_load_kernel_matches_numpy(src, n):
    src_arr = np.array(src, np.int32)
    a, b = np.full(n, 7, np.int64), np.full(n, 7, np.int64)
    np_load(a, src_arr)
    kernels.load(b, src_arr)
    assert a.tolist() == b.tolist()


def test_model_with_kernels_gives_identical_verdicts():
    rng = random.Random(5)
    members = {r: ("10.0.0.1", 1000 + r) for r in range(4)}

    def new(arith):
        m = AggregatorModel(16, arithmetic=arith)
        m.add_job(JobConfig(job=3, world=4, slots=2, max_chunks=6, members=members))
        return m

    a, b = new(NUMPY_ARITHMETIC), new(kernels.KERNEL_ARITHMETIC)
    for i in range(3000):
        rank = rng.randrange(4)
        values = np.array([rng.randrange(-2**31, 2**31) for _ in range(16)], "<i4")
        hdr = Header(type=rng.choice([1, 1, 1, 3]), job=3, rank=rank, round=i // 150 + rng.randrange(2),
                     chunk=rng.randrange(6), count=16, exponent=rng.choice([0, 1, 5, 31, 40, ZERO_EXPONENT]))
        data = hdr.pack() + values.tobytes()
        assert a.process(data, members[rank]) == b.process(data, members[rank])
    assert a.counters(3).tolist() == b.counters(3).tolist()
    assert a.counters(3)[Counter.RELEASED] >= 5 and a.counters(3)[Counter.OVERFLOWS] > 0


@pytest.mark.parametrize("text", ["sync", "quorum:3:10ms", "ssp:2", "async", "wbsp"])
def test_model_with_kernels_gives_identical_verdicts_for_every_strategy(text):
    """The user-space path is the model with the numba arithmetic: same bytes, same counters."""
    from tests.fixtures.scenarios import JOB
    from tests.harness.arithmetic import play_both

    rng = random.Random(text)
    released = overflows = 0
    for _ in range(40):          # short runs: members of a long one can stall behind a stale key
        a, _ = play_both(text, rng, 4)
        released += a.counter(JOB, "released")
        overflows += a.counter(JOB, "overflows")
    assert released >= 40 and overflows > 0


# ---------------------------------------------------------------------------------------------
# The server over UDP on 127.0.0.1.

E = 16


def udp(timeout: float = 2.0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(timeout)
    return s


def contribution(job, rank, values, count=None, payload_elems=E, **hdr) -> bytes:
    payload = np.zeros(payload_elems, "<i4")
    payload[:len(values)] = values
    return Header(type=MsgType.CONTRIB, job=job, rank=rank, count=count or len(values), **hdr).pack() \
        + payload.tobytes()


@pytest.fixture
def workers():
    socks = [udp() for _ in range(3)]
    yield socks
    for s in socks:
        s.close()


@pytest.fixture
def server():
    with UserspaceAggregator(("127.0.0.1", 0), elements=E) as srv:
        yield srv


def test_fan_out_round_and_reread(server, workers):
    members = {r: s.getsockname() for r, s in enumerate(workers)}
    server.add_job(JobConfig(job=4, world=3, slots=4, max_chunks=16, members=members, group=None))
    for r, s in enumerate(workers):
        s.sendto(contribution(4, r, [r + 1, 10 * (r + 1)], round=2, chunk=5), server.address)
    for s in workers:
        data, src = s.recvfrom(65536)
        assert src == server.address
        hdr, payload = decode(data)
        assert (hdr.type, hdr.job, hdr.rank, hdr.round, hdr.chunk, hdr.count) == (MsgType.RESULT, 4, 0xFFFF, 2, 5, 2)
        assert hdr.flags == Flag.USERSPACE and hdr.contributors == 0b111 and hdr.n_contrib == 3
        assert payload.tolist() == [6, 60] + [0] * (E - 2)
    # a lost result: the retransmission is answered to its sender alone
    workers[1].sendto(contribution(4, 1, [2, 20], round=2, chunk=5, flags=Flag.RETRANSMIT), server.address)
    hdr, payload = decode(workers[1].recvfrom(65536)[0])
    assert hdr.flags == Flag.USERSPACE | Flag.REREAD and payload[0] == 6
    c = server.counters(4)
    assert c[Counter.RELEASED] == 1 and c[Counter.REREADS] == 1 and c[Counter.CONTRIBUTIONS] == 3
    assert c[Counter.RETRANSMITS] == 1 and c[Counter.RX_PACKETS] == 4


def test_short_packets_are_served(server, workers):
    members = {r: s.getsockname() for r, s in enumerate(workers[:2])}
    server.add_job(JobConfig(job=1, world=2, slots=1, max_chunks=1, members=members))
    workers[0].sendto(contribution(1, 0, [5, 6, 7], payload_elems=3, exponent=1), server.address)
    workers[1].sendto(contribution(1, 1, [1], payload_elems=1, exponent=0), server.address)
    for s in workers[:2]:
        hdr, payload = decode(s.recvfrom(65536)[0])
        assert hdr.exponent == 0 and payload[:4].tolist() == [2 + 1, 3, 3, 0]
    assert server.counters(1)[Counter.TO_USERSPACE] == 0


def test_drops_and_nacks(server, workers):
    w0, w1, stranger = workers
    server.add_job(JobConfig(job=2, world=2, slots=2, max_chunks=4,
                             members={0: w0.getsockname(), 1: w1.getsockname()}))
    good = contribution(2, 0, [1])
    w0.sendto(b"\0" * 10, server.address)                                   # too short
    w0.sendto(b"\xa6\x6e" + good[2:], server.address)                      # bad magic
    w0.sendto(contribution(2, 0, [1], count=E + 1), server.address)        # count beyond elements
    w0.sendto(contribution(2, 0, [1], chunk=4), server.address)            # bad chunk
    w0.sendto(good, server.address)
    w0.sendto(good, server.address)                                         # duplicate
    w0.sendto(contribution(9, 0, [1]), server.address)                      # unknown job -> NACK
    nack = Header.unpack(w0.recvfrom(65536)[0])
    assert (nack.type, nack.code, nack.job) == (MsgType.NACK, NackCode.UNKNOWN_JOB, 9)
    stranger.sendto(contribution(2, 1, [1]), server.address)               # not the member
    data = stranger.recvfrom(65536)[0]
    assert len(data) == HEADER_SIZE
    nack = Header.unpack(data)
    assert (nack.type, nack.code, nack.rank, nack.flags) == (MsgType.NACK, NackCode.NOT_MEMBER, 1, Flag.USERSPACE)
    w1.sendto(contribution(2, 5, [1]), server.address)                      # rank beyond world
    assert Header.unpack(w1.recvfrom(65536)[0]).code == NackCode.NOT_MEMBER
    no_job, job = server.drops(NO_JOB), server.drops(2)
    assert no_job[DropReason.TOO_SHORT] == no_job[DropReason.BAD_MAGIC] == no_job[DropReason.BAD_COUNT] == 1
    assert no_job[DropReason.UNKNOWN_JOB] == 1 and no_job.sum() == 4
    assert job[DropReason.BAD_CHUNK] == job[DropReason.DUPLICATE] == job[DropReason.NOT_MEMBER] == 1
    assert job[DropReason.BAD_RANK] == 1 and job.sum() == 4
    assert server.stats()["jobs"][2]["counters"]["contributions"] == 1


def test_multicast_group(server, workers):
    group = ("239.255.42.7", 0)
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.settimeout(2.0)
    try:
        listener.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton(group[0]) + socket.inet_aton("127.0.0.1"))
    except OSError as e:
        listener.close()
        pytest.skip(f"no multicast on loopback here: {e}")
    with listener:
        members = {r: s.getsockname() for r, s in enumerate(workers[:2])}
        server.add_job(JobConfig(job=7, world=2, slots=1, max_chunks=1, members=members,
                                 group=(group[0], listener.getsockname()[1])))
        for r, s in enumerate(workers[:2]):
            s.sendto(contribution(7, r, [r + 40]), server.address)
        hdr, payload = decode(listener.recvfrom(65536)[0])
        assert hdr.type == MsgType.RESULT and payload[0] == 81
        workers[0].settimeout(0.2)
        with pytest.raises(socket.timeout):       # the group got it, not the members directly
            workers[0].recvfrom(65536)


def test_serve_once_without_thread(workers):
    srv = UserspaceAggregator(elements=E)
    try:
        srv.add_job(JobConfig(job=1, world=1, slots=1, max_chunks=1,
                              members={0: workers[0].getsockname()}))
        assert srv.serve_once(0.01) == 0
        for rnd in range(3):
            workers[0].sendto(contribution(1, 0, [rnd], round=rnd), srv.address)
        handled = 0
        while handled < 3:
            handled += srv.serve_once(1.0)
        results = [decode(workers[0].recvfrom(65536)[0]) for _ in range(3)]
        assert [(h.round, p[0]) for h, p in results] == [(0, 0), (1, 1), (2, 2)]
        srv.remove_job(1)
        workers[0].sendto(contribution(1, 0, [1], round=3), srv.address)
        srv.serve_once(1.0)
        assert Header.unpack(workers[0].recvfrom(65536)[0]).code == NackCode.UNKNOWN_JOB
    finally:
        srv.close()


def test_strategies_over_udp(server, workers):
    """set_strategy reaches the model; async answers each contribution at once, the clock runs."""
    from aggd.core.strategy import StrategyTable, parse

    members = {r: s.getsockname() for r, s in enumerate(workers)}
    server.add_job(JobConfig(job=5, world=3, slots=2, max_chunks=8, members=members, group=None))
    table = StrategyTable(parse("sync"))
    table.install(1, 2, parse("async"))
    server.set_strategy(5, table.table_entries())
    for r, s in enumerate(workers):
        s.sendto(contribution(5, r, [r + 1], round=1), server.address)
    for s in workers:
        hdr, payload = decode(s.recvfrom(65536)[0])
        assert (hdr.round, hdr.strategy_version, hdr.strategy, payload[0]) == (1, 0, 0, 6)
    workers[0].sendto(contribution(5, 0, [10], round=2), server.address)
    hdr, payload = decode(workers[0].recvfrom(65536)[0])
    assert (hdr.round, hdr.strategy_version, hdr.n_contrib, payload[0]) == (2, 1, 1, 10)
    assert hdr.flags == Flag.USERSPACE                      # a running sum, not a re-send
    workers[1].sendto(contribution(5, 1, [20], round=2), server.address)
    assert decode(workers[1].recvfrom(65536)[0])[1][0] == 30
    with pytest.raises(DataPlaneError, match="1..4 entries"):
        server.set_strategy(5, [])
    # quorum with a 1 ms deadline: released by the next packet to the slot once it passed
    table.install(2, 3, parse("quorum:3:1ms"))
    server.set_strategy(5, table.table_entries())
    workers[0].sendto(contribution(5, 0, [1], round=3, chunk=1), server.address)  # round 2 holds slot 0
    import time
    time.sleep(0.005)
    workers[0].sendto(Header(type=MsgType.REREAD, job=5, rank=0, round=3, chunk=1, count=1).pack()
                      + bytes(4 * E), server.address)
    hdr, payload = decode(workers[0].recvfrom(65536)[0])
    assert (hdr.round, hdr.n_contrib, hdr.strategy, hdr.param) == (3, 1, 1, 3)
    assert hdr.flags == Flag.USERSPACE        # the deadline release is announced to the group
    assert server.stats()["jobs"][5]["counters"]["timeouts"] == 1


def test_slots_are_made_as_used_and_kept_slots_come_back(tmp_path, workers):
    """A job's slots cost nothing until packets reach them (sparse files, no slot objects); the
    slots in use survive a new server (a daemon restart) and only they are made again."""
    members = {r: s.getsockname() for r, s in enumerate(workers[:2])}
    cfg = JobConfig(job=1, world=2, slots=4096, max_chunks=1 << 20, members=members)

    def serve(srv, n):
        handled = 0
        while handled < n:
            handled += srv.serve_once(1.0)

    srv = UserspaceAggregator(elements=E, keep_dir=tmp_path)
    try:
        assert srv.add_job(cfg, identity="a@1") is False
        state = srv._route[1].jobs[1]
        assert state.slots.made() == {}
        folder = tmp_path / "job-1"
        assert sum(p.stat().st_size for p in folder.iterdir()) > 4096 * 4 * E * 8       # room for every slot
        assert sum(p.stat().st_blocks * 512 for p in folder.iterdir()) < 256 << 10      # none of it written
        for chunk in (5, 3000):     # rank 0 only: two slots hold an open round
            workers[0].sendto(contribution(1, 0, [chunk], chunk=chunk), srv.address)
        serve(srv, 2)
        assert srv.open_slots(1) == 2 and srv.job_rounds(1) == (0, {0: 0})
        assert sorted(state.slots.made()) == [5, 3000 % 4096]
    finally:
        srv.close()

    srv = UserspaceAggregator(elements=E, keep_dir=tmp_path)   # the next daemon
    try:
        assert srv.add_job(cfg, identity="a@1") is True
        state = srv._route[1].jobs[1]
        assert sorted(state.slots.made()) == [5, 3000]           # the slots in use, and only they
        assert srv.open_slots(1) == 2
        workers[1].sendto(contribution(1, 1, [1], chunk=3000), srv.address)
        serve(srv, 1)
        for s in workers[:2]:
            hdr, payload = decode(s.recvfrom(65536)[0])
            assert (hdr.chunk, hdr.contributors, payload[0]) == (3000, 0b11, 3001)
        srv.remove_job(1)
        assert not folder.exists() and state.slots.made() == {}
    finally:
        srv.close()
