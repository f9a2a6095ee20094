"""The control protocol between aggctl and aggd: JSON lines over a Unix socket."""
from __future__ import annotations

import json
import os
import socket
import stat
import time

import pytest

from aggd.daemon.control import (ControlClient, ControlError, ControlServer, DaemonUnreachable, answer, check_args,
                                 nesting)


def dispatch(cmd, args):
    if cmd == "echo":
        return args
    if cmd == "refuse":
        raise ControlError("unknown_job", "no job 'x'")
    if cmd == "crash":
        raise RuntimeError("boom")
    raise ControlError("bad_request", f"unknown command {cmd!r}")


@pytest.fixture
def server(tmp_path):
    srv = ControlServer(str(tmp_path / "run" / "ctl.sock"), dispatch, line_timeout=1.0, idle_timeout=2.0,
                        max_connections=8).start()
    yield srv
    srv.close()


def test_answer_never_raises():
    assert answer(dispatch, b'{"cmd": "echo", "args": {"a": 1}}') == {"ok": True, "result": {"a": 1}}
    assert answer(dispatch, b"not json")["error"]["kind"] == "bad_request"
    assert answer(dispatch, b'{"args": {}}')["error"]["kind"] == "bad_request"
    assert answer(dispatch, b'{"cmd": "echo", "args": []}')["error"]["kind"] == "bad_request"
    assert answer(dispatch, b'{"cmd": "refuse"}')["error"] == {"kind": "unknown_job", "message": "no job 'x'"}
    crash = answer(dispatch, b'{"cmd": "crash"}')["error"]
    assert crash["kind"] == "internal" and "boom" in crash["message"]


def test_call_and_refusals(server):
    client = ControlClient(str(server.path))
    assert client.call("echo", job="a", n=3) == {"job": "a", "n": 3}
    with pytest.raises(ControlError) as info:
        client.call("refuse")
    assert info.value.kind == "unknown_job" and "no job" in str(info.value)
    with pytest.raises(ControlError) as info:
        client.call("nope")
    assert info.value.kind == "bad_request"


def test_several_requests_on_one_connection(server):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(server.path))
        s.sendall(b'{"cmd":"echo","args":{"i":1}}\n{"cmd":"refuse"}\n')
        s.shutdown(socket.SHUT_WR)
        lines = b""
        while chunk := s.recv(4096):
            lines += chunk
    first, second = [json.loads(x) for x in lines.splitlines()]
    assert first == {"ok": True, "result": {"i": 1}} and second["ok"] is False


def test_socket_is_root_and_group_only(server):
    mode = stat.S_IMODE(os.stat(server.path).st_mode)
    assert mode == 0o660
    assert os.stat(server.path).st_uid == 0


def test_a_second_server_on_a_live_socket_is_refused(server):
    with pytest.raises(ControlError) as info:
        ControlServer(str(server.path), dispatch)
    assert info.value.kind == "exists"


def test_stale_socket_is_replaced(tmp_path):
    path = tmp_path / "ctl.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # a killed daemon leaves its socket file behind
    with pytest.raises(DaemonUnreachable) as info:
        ControlClient(str(path)).call("echo")
    assert info.value.kind == "not_running" and "not running" in str(info.value)
    srv = ControlServer(str(path), dispatch)
    srv.close()
    assert not path.exists()


def test_daemon_not_running(tmp_path):
    with pytest.raises(DaemonUnreachable) as info:
        ControlClient(str(tmp_path / "none.sock")).call("status")
    assert info.value.kind == "not_running" and "aggd is not running" in str(info.value)


# -- hostile input and resource limits ---------------------------------------------------------------

def test_deep_nesting_is_refused_before_parsing():
    deep = b'{"cmd": "echo", "args": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    err = answer(dispatch, deep)["error"]
    assert err["kind"] == "bad_request" and "deeper than 16" in err["message"] and "\n" not in err["message"]
    # brackets inside strings are text, not nesting
    assert answer(dispatch, b'{"cmd": "echo", "args": {"a": "' + b"[" * 1000 + b'"}}')["ok"]
    assert nesting(b'{"a": "[[\\"[", "b": [[{}]]}') == 4


def test_unparsable_requests_get_one_line():
    for line in (b"\xff\xfe", b'{"cmd": "echo", "args": {"a": ' + b"9" * 5000 + b"}}", b"{" * 10 + b"}"):
        err = answer(dispatch, line)["error"]
        assert err["kind"] == "bad_request" and "\n" not in err["message"], line[:20]


SPEC = {"name": "text", "world": "int", "job": "job", "slots": "int?"}


@pytest.mark.parametrize("args, text", [
    ({"name": "a", "world": True, "job": "a"}, "world must be an integer, not True"),
    ({"name": "a", "world": 2.0, "job": "a"}, "world must be an integer, not 2.0"),
    ({"name": "a", "world": "2", "job": "a"}, "world must be an integer, not '2'"),
    ({"name": 3, "world": 2, "job": "a"}, "name must be a string, not 3"),
    ({"name": "a\n", "world": 2, "job": "a"}, "name must be at most 256 characters without control characters"),
    ({"name": "a" * 300, "world": 2, "job": "a"}, "name must be at most 256 characters"),
    ({"name": "a", "world": 2, "job": ["a"]}, "job must be a job name or id, not ['a']"),
    ({"name": "a", "world": 2, "job": False}, "job must be a job name or id, not False"),
    ({"name": "a", "world": 1 << 70, "job": "a"}, "world 1180591620717411303424 is out of range"),
    ({"name": "a", "job": "a"}, "argument 'world' is required"),
    ({"name": "a", "world": None, "job": "a"}, "argument 'world' is required"),
    ({"name": "a", "world": 2, "job": "a", "wrold": 2}, "unknown argument 'wrold' (known: name, world, job, slots)"),
])
def test_argument_kinds_are_checked(args, text):
    with pytest.raises(ControlError) as info:
        check_args("jobs.create", args, SPEC)
    assert info.value.kind == "bad_request" and text in info.value.message, info.value.message
    assert info.value.message.startswith("jobs.create: ") and "\n" not in info.value.message


def test_good_arguments_pass_and_nulls_are_left_out():
    assert check_args("x", {"name": "a", "world": 2, "job": 7, "slots": None}, SPEC) == \
        {"name": "a", "world": 2, "job": 7}


def _connect(srv) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(srv.path))
    return s


def _read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_idle_and_trickling_clients_do_not_block_others(server):
    idle = [_connect(server) for _ in range(6)]
    trickle = _connect(server)
    trickle.sendall(b'{"cmd"')
    try:
        t0 = time.monotonic()
        assert ControlClient(str(server.path), timeout=2).call("echo", i=1) == {"i": 1}
        assert time.monotonic() - t0 < 0.5
        # the trickling client is cut off once its line is late (line_timeout 1 s), in one line
        assert _read_all(trickle, 5) == b""
        # idle ones after idle_timeout (2 s)
        for s in idle:
            assert _read_all(s, 5) == b""
        assert server.connections == 0
    finally:
        for s in idle + [trickle]:
            s.close()


def test_connections_over_the_cap_are_told_so(server):
    held = [_connect(server) for _ in range(8)]
    try:
        time.sleep(0.2)
        with pytest.raises(ControlError) as info:
            ControlClient(str(server.path), timeout=2).call("echo")
        assert info.value.kind == "busy" and "at most 8" in info.value.message
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 3
    while server.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ControlClient(str(server.path), timeout=2).call("echo", ok=1) == {"ok": 1}


def test_many_requests_on_one_connection_answered_in_order(server):
    with _connect(server) as s:
        s.sendall(b"".join(b'{"cmd":"echo","args":{"i":%d}}\n' % i for i in range(5000)))
        s.shutdown(socket.SHUT_WR)
        lines = _read_all(s, 10).splitlines()
    assert [json.loads(x)["result"]["i"] for x in lines] == list(range(5000))


def test_a_client_that_does_not_read_is_dropped(server):
    with _connect(server) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        big = "x" * 200
        try:  # as much as it takes; the daemon stops reading while its answers wait
            s.send(b"".join(b'{"cmd":"echo","args":{"a":"%s"}}\n' % big.encode() for _ in range(3000)))
        except BlockingIOError:
            pass
        assert ControlClient(str(server.path), timeout=2).call("echo", i=2) == {"i": 2}
        deadline = time.monotonic() + 5
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.connections == 0


def test_too_long_a_line_is_refused(server, monkeypatch):
    monkeypatch.setattr("aggd.daemon.control.MAX_LINE", 1000)
    with _connect(server) as s:
        s.sendall(b'{"cmd":"echo","args":{"a":"' + b"x" * 2000)
        reply = json.loads(_read_all(s).splitlines()[0])
    assert reply["error"]["kind"] == "bad_request" and "longer than 1000" in reply["error"]["message"]
