"""Batched receives (aggd_client.mrecv): recvmmsg and the one-by-one fallback fill the staging
records alike, cut oversized datagrams to a record, and stop when the socket is empty or the stage
is full."""
from __future__ import annotations

import socket

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
