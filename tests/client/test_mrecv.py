"""Batched receives (aggd_client.mrecv): recvmmsg and the one-by-one fallback fill the staging
records alike, cut oversized datagrams to a record, and stop when the socket is empty or the stage
is full."""
from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from aggd_client import mrecv

REC = 64


@pytest.fixture
def pair():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("batched", [True, False])
def test_fills_records_in_order_and_cuts_oversized(pair, batched):
    if batched and not mrecv.AVAILABLE:
        pytest.skip("libc has no recvmmsg")  # (not on Linux)
    tx, rx = pair
    stage = np.zeros((8, REC), np.uint8)
    sizes = np.zeros(8, np.int64)
    r = mrecv.MultiReceiver(stage, REC, sizes, batched=batched)
    assert r.batched == batched
    msgs = [bytes([i]) * n for i, n in enumerate([REC, 10, REC + 20, 1, REC])]
    for m in msgs:
        tx.sendto(m, rx.getsockname())
    m = r.drain(rx, 2)  # start part-way through the stage
    assert m == 2 + len(msgs)
    for i, msg in enumerate(msgs):
        n = min(len(msg), REC)
        assert sizes[2 + i] == n
        assert bytes(stage[2 + i, :n]) == msg[:n]
    assert r.drain(rx, m) == m  # empty: nothing more, no error


@pytest.mark.parametrize("batched", [True, False])
def test_stops_when_the_stage_is_full(pair, batched):
    if batched and not mrecv.AVAILABLE:
        pytest.skip("libc has no recvmmsg")
    tx, rx = pair
    stage = np.zeros((4, REC), np.uint8)
    sizes = np.zeros(4, np.int64)
    r = mrecv.MultiReceiver(stage, REC, sizes, batched=batched)
    for i in range(6):
        tx.sendto(bytes([i]) * 5, rx.getsockname())
    assert r.drain(rx, 0) == 4
    assert [stage[i, 0] for i in range(4)] == [0, 1, 2, 3]
    assert r.drain(rx, 0) == 2  # the rest is still queued
    assert [stage[i, 0] for i in range(2)] == [4, 5]


def test_skips_a_queued_icmp_error(pair):
    tx, rx = pair
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    dead = closed.getsockname()
    closed.close()
    rx.connect(dead)  # the port unreachable comes back to rx as ECONNREFUSED
    rx.send(b"x")
    stage = np.zeros((4, REC), np.uint8)
    sizes = np.zeros(4, np.int64)
    for batched in ([True, False] if mrecv.AVAILABLE else [False]):
        r = mrecv.MultiReceiver(stage, REC, sizes, batched=batched)
        assert r.drain(rx, 0) == 0


@pytest.mark.parametrize("batched", [True, False])
def test_keeps_each_senders_address(pair, batched):
    if batched and not mrecv.AVAILABLE:
        pytest.skip("libc has no recvmmsg")
    tx, rx = pair
    tx.bind(("127.0.0.1", 0))
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    other.bind(("127.0.0.2", 0))
    try:
        stage = np.zeros((8, REC), np.uint8)
        sizes = np.zeros(8, np.int64)
        names = np.zeros((8, mrecv.SOCKADDR_IN), np.uint8)
        r = mrecv.MultiReceiver(stage, REC, sizes, batched=batched, names=names)
        senders = [tx, other, tx, other]
        for i, s in enumerate(senders):
            s.sendto(bytes([i]) * 3, rx.getsockname())
        assert r.drain(rx, 0) == 4
        for i, s in enumerate(senders):
            assert mrecv.sockaddr_addr(names[i]) == s.getsockname()
            assert bytes(names[i]) == mrecv.sockaddr_in(s.getsockname())
        for i, s in enumerate(reversed(senders)):   # a second batch writes its own addresses
            s.sendto(b"y", rx.getsockname())
        assert r.drain(rx, 0) == 4
        assert [mrecv.sockaddr_addr(names[i]) for i in range(4)] == [s.getsockname() for s in reversed(senders)]
    finally:
        other.close()
    with pytest.raises(ValueError):
        mrecv.MultiReceiver(stage, REC, sizes, names=np.zeros((8, 8), np.uint8))


GSO = (17, 103)  # SOL_UDP, UDP_SEGMENT: one send, a train of datagrams


def _gro_receiver(rx, n=2048, rec=REC):
    stage = np.zeros((n, rec), np.uint8)
    sizes = np.zeros(n, np.int64)
    r = mrecv.MultiReceiver(stage, rec, sizes)
    if not r.use_gro([rx]):
        pytest.fail("UDP_GRO refused: the kernel of CI has it (Linux 5.0 on)")
    return r, stage, sizes


def test_a_train_of_record_sized_datagrams_lands_one_a_record(pair):
    """A UDP GSO send on loopback reaches a UDP_GRO socket as one train, as results coalesced by
    an interface's GRO do: one read puts each datagram in its record, the last one shorter."""
    tx, rx = pair
    r, stage, sizes = _gro_receiver(rx)
    train = b"".join(bytes([i]) * REC for i in range(9)) + b"\xee" * 10
    tx.sendmsg([train], [(*GSO, struct.pack("H", REC))], 0, rx.getsockname())
    tx.sendto(b"\x77" * 5, rx.getsockname())
    m = r.drain(rx, 3)
    assert m == 3 + 10 + 1 and r.trains == 1 and r.train_datagrams == 10
    assert sizes[3:14].tolist() == [REC] * 9 + [10, 5]
    assert [stage[3 + i, 0] for i in range(9)] == list(range(9)) and stage[12, 0] == 0xEE and stage[13, 0] == 0x77


@pytest.mark.parametrize("seg", [REC // 2, REC + 8])
def test_a_train_of_another_segment_size_is_moved_apart(pair, seg):
    """Datagrams of another size than a record are moved one a record (cut to a record, as the
    batched reads do)."""
    tx, rx = pair
    r, stage, sizes = _gro_receiver(rx)
    train = b"".join(bytes([i + 1]) * seg for i in range(5))
    tx.sendmsg([train], [(*GSO, struct.pack("H", seg))], 0, rx.getsockname())
    assert r.drain(rx, 0) == 5
    assert sizes[:5].tolist() == [min(seg, REC)] * 5
    for i in range(5):
        assert bytes(stage[i, :min(seg, REC)]) == bytes([i + 1]) * min(seg, REC)


def test_reads_stop_while_the_stage_cannot_take_a_whole_train(pair):
    tx, rx = pair
    rec = 1024
    r, stage, sizes = _gro_receiver(rx, n=80, rec=rec)
    assert r.full_at == 80 - 64 + 1
    for _ in range(3):
        tx.sendmsg([bytes(rec * 10)], [(*GSO, struct.pack("H", rec))], 0, rx.getsockname())
    assert r.drain(rx, 0) == 20  # a third train might not fit the 60 records left: kept for the next drain
    assert r.drain(rx, 0) == 10


def test_no_trains_at_all_turns_gro_off_again(pair, monkeypatch):
    """Where nothing is coalesced a read a datagram costs more than recvmmsg: after LONE_LIMIT
    datagrams read alone the receiver turns UDP_GRO off and reads in batches again."""
    if not mrecv.AVAILABLE:
        pytest.skip("libc has no recvmmsg")
    monkeypatch.setattr(mrecv, "LONE_LIMIT", 4)
    tx, rx = pair
    r, stage, sizes = _gro_receiver(rx)
    for i in range(10):
        tx.sendto(bytes([i]) * 8, rx.getsockname())
    assert r.drain(rx, 0) == 10 and not r.gro and r.full_at == 2048
    assert rx.getsockopt(17, mrecv.UDP_GRO) == 0
    assert [stage[i, 0] for i in range(10)] == list(range(10))
