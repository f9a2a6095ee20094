"""The client's batched sends (aggd_client.msend): runs of records, in order, errors passed on."""
from __future__ import annotations

import errno
import socket

import numpy as np
import pytest

from aggd_client import msend

pytestmark = pytest.mark.skipif(not msend.AVAILABLE, reason="libc has no sendmmsg")


@pytest.fixture
def pair():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(2)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    yield tx, rx
    tx.close()
    rx.close()


@pytest.mark.parametrize("count", [1, 2, 7, 8, 9, 20])
def test_a_run_arrives_in_order_record_by_record(pair, count):
    tx, rx = pair
    rec = 24
    buf = np.arange(count * rec, dtype=np.uint8)
    sender = msend.RunSender(8, rec, rx.getsockname())  # runs longer than 8 take several calls
    assert sender.send(tx, memoryview(buf), count, pytest.fail) == count
    got = [rx.recv(1000) for _ in range(count)]
    assert got == [buf[i * rec:(i + 1) * rec].tobytes() for i in range(count)]


def test_a_refused_message_is_passed_on_and_skipped(pair):
    tx, rx = pair
    rec = 70_000  # larger than any UDP datagram: every message is refused (EMSGSIZE)
    errors = []
    sender = msend.RunSender(4, rec, rx.getsockname())
    assert sender.send(tx, bytearray(2 * rec), 2, errors.append) == 0
    assert [e.errno for e in errors] == [errno.EMSGSIZE] * 2


def test_a_short_buffer_is_refused(pair):
    tx, rx = pair
    with pytest.raises(ValueError, match="buffer"):
        msend.RunSender(4, 100, rx.getsockname()).send(tx, bytearray(150), 2, pytest.fail)
