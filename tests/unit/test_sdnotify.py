"""sd_notify on a socket the test binds (PID 1 is not systemd here): paths and abstract names."""
from __future__ import annotations

import os
import secrets
import socket

import pytest

from aggd.daemon.sdnotify import Notifier


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify.sock")
        sock.bind(name)
    else:
        name = "@aggd-test-" + secrets.token_hex(4)
        sock.bind(b"\0" + name[1:].encode())
    sock.settimeout(2)
    yield name, sock
    sock.close()


def test_ready_status_watchdog_stopping(listener):
    name, sock = listener
    n = Notifier({"NOTIFY_SOCKET": name})
    assert n.enabled
    assert n.ready("serving 2 jobs")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving 2 jobs"
    assert n.watchdog() and sock.recv(4096) == b"WATCHDOG=1"
    assert n.reloading() and sock.recv(4096).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
    assert n.stopping() and sock.recv(4096) == b"STOPPING=1"
    n.close()


def test_without_notify_socket_nothing_happens():
    n = Notifier({})
    assert not n.enabled and not n.ready() and n.watchdog_interval is None


def test_watchdog_interval_is_half_the_timeout_and_only_for_us():
    assert Notifier({"WATCHDOG_USEC": "3000000"}).watchdog_interval == 1.5
    assert Notifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 1.5
    assert Notifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}).watchdog_interval is None
    assert Notifier({"WATCHDOG_USEC": "junk"}).watchdog_interval is None


def test_a_gone_socket_is_not_fatal(tmp_path):
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody")}).ready() is False
