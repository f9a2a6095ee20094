"""Batched sends (aggd.dataplane.userspace.msend): one sendmmsg sends chosen records, each with its own length, to
each one's address, in order."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from aggd.dataplane.userspace import msend
from aggd_client.mrecv import sockaddr_in

REC = 64

pytestmark = pytest.mark.skipif(not msend.AVAILABLE, reason="libc has no sendmmsg")


def test_sends_chosen_records_with_their_lengths_to_their_addresses():
    out = np.zeros((8, REC), np.uint8)
    for i in range(8):
        out[i] = i
    rx = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for s in rx:
            s.bind(("127.0.0.1", 0))
            s.settimeout(2)
        tx.bind(("127.0.0.1", 0))
        sender = msend.MultiSender(out, REC, 4)
        records = np.array([5, 1, 6, 2])
        lengths = np.array([REC, 3, 10, 1])
        to = [0, 1, 1, 0]
        dests = np.array([np.frombuffer(sockaddr_in(rx[k].getsockname()), np.uint8) for k in to])
        assert sender.send(tx, records, lengths, dests) == 0
        got = {0: [], 1: []}
        for k in to:
            data, src = rx[k].recvfrom(1000)
            assert src == tx.getsockname()
            got[k].append(data)
        assert got[0] == [bytes([5]) * REC, bytes([2])]
        assert got[1] == [bytes([1]) * 3, bytes([6]) * 10]
        # one address for all: broadcast
        assert sender.send(tx, np.array([3, 4]), np.array([2, 2]), dests[:1]) == 0
        assert [rx[0].recv(100) for _ in range(2)] == [b"\x03\x03", b"\x04\x04"]
        with pytest.raises(ValueError):
            sender.send(tx, np.arange(5), np.ones(5, np.int64), dests[:1])
    finally:
        tx.close()
        for s in rx:
            s.close()
