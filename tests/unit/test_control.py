"""The control protocol between aggctl and aggd: JSON lines over a Unix socket."""
from __future__ import annotations

import json
import os
import socket
import stat
import threading

import pytest

from aggd.daemon.control import ControlClient, ControlError, ControlServer, DaemonUnreachable, answer


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
    srv = ControlServer(str(tmp_path / "run" / "ctl.sock"), dispatch)
    stop = threading.Event()

    def loop():
        import select
        while not stop.is_set():
            if select.select([srv], [], [], 0.05)[0]:
                srv.handle()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv
    stop.set()
    t.join()
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
