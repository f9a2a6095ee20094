"""The control socket against hostile clients, on the real daemon: idle and trickling connections
hold up neither aggctl nor the watchdog ping, and what a client can send (deep JSON, arguments of
the wrong type, a name with a newline, sizes out of bounds, random requests) is refused in one
line, never as an internal error, and the daemon goes on serving."""
from __future__ import annotations

import collections
import json
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggd.daemon.service import Service


pytestmark = pytest.mark.root


def _request(path: str, line: bytes, timeout: float = 10.0) -> list[bytes]:
    """Send one raw request line; the answer's lines."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(line + b"\n")
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.splitlines()


def _timed_status(d) -> float:
    t0 = time.monotonic()
    assert d.call("status")["userspace"]["alive"]
    return time.monotonic() - t0


def test_idle_and_trickling_clients_block_nobody(make_lab, make_daemon):
    lab = make_lab(1)
    d = make_daemon(lab, start=False)
    d.start(env={"WATCHDOG_USEC": "1000000"})  # a ping every 0.5 s
    idle = []
    stop = threading.Event()

    def trickle():  # a byte every 1.5 s, for as long as the daemon lets it
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(d.socket)
            try:
                for byte in b'{"cmd": "status"}':
                    if stop.wait(1.5):
                        return
                    s.send(bytes([byte]))
            except OSError:
                return  # cut off: its line was late

    t = threading.Thread(target=trickle, daemon=True)
    try:
        for _ in range(50):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(d.socket)
            idle.append(s)
        t.start()
        time.sleep(0.5)
        mark = len(d.notify.messages)
        took = []
        for _ in range(8):  # over 6 s: the trickler's line is late before the end
            took.append(_timed_status(d))
            res = d.aggctl("status")
            assert res.exit_code == 0, res.output
            time.sleep(0.75)
        assert max(took) < 1.0, took
        pings = sum("WATCHDOG=1" in m.split("\n") for m in d.notify.messages[mark:])
        assert pings >= 8, d.notify.messages[mark:]
    finally:
        stop.set()
        for s in idle:
            s.close()
        t.join()
    assert "did not complete a request line within 5 s" in d.log()


DEEP = b'{"cmd": "status", "args": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"


HOSTILE = [  # (request line, the refusal's kind, what its message says)
    (DEEP, "bad_request", "deeper than 16 levels"),
    (b"{" * 200_000, "bad_request", "deeper than 16 levels"),
    (b"\xff" * 10, "bad_request", "not a JSON request"),
    (b'{"cmd": "jobs.create", "args": {"name": "n", "world": true}}', "bad_request", "world must be an integer"),
    (b'{"cmd": "jobs.create", "args": {"name": "n", "world": 2, "strategy": 3}}', "bad_request",
     "strategy must be a string"),
    (b'{"cmd": "jobs.create", "args": {"name": "n", "world": 2, "strategy": {"kind": "sync"}}}', "bad_request",
     "strategy must be a string"),
    (b'{"cmd": "jobs.create", "args": {"name": "n\\n", "world": 2}}', "bad_request", "without control characters"),
    (b'{"cmd": "jobs.create", "args": {"name": "n", "world": 2, "slots": 1000000000000}}', "too_large",
     "[jobs] max_slots"),
    (b'{"cmd": "jobs.create", "args": {"name": "n", "world": 2, "slots": 16384, "elements": 8192}}', "too_large",
     "[jobs] max_job_memory"),
    (b'{"cmd": "jobs.create", "args": {"name": "n", "world": 2, "slots": 1e12}}', "bad_request",
     "slots must be an integer"),
    (b'{"cmd": "jobs.create", "args": {"name": "n", "world": 2, "bogus": 1}}', "bad_request", "unknown argument"),
    (b'{"cmd": "jobs.create", "args": {"world": 2}}', "bad_request", "'name' is required"),
    (b'{"cmd": "jobs.show", "args": {"job": ["a"]}}', "bad_request", "job must be a job name or id"),
    (b'{"cmd": "jobs.show", "args": {"job": "\\u00b2"}}', "unknown_job", "no job"),
    (b'{"cmd": "workers.remove", "args": {"job": "a", "rank": "0"}}', "bad_request", "rank must be an integer"),
    (b'{"cmd": "workers.readmit", "args": {"job": "a", "rank": [0]}}', "bad_request", "rank must be an integer"),
    (b'{"cmd": "strategy.set", "args": {"job": "a", "strategy": 3}}', "bad_request", "strategy must be a string"),
    (b'{"cmd": "strategy.set", "args": {"job": "a", "strategy": "sync", "from_round": true}}', "bad_request",
     "from_round must be an integer"),
    (b'{"cmd": "__init__", "args": {}}', "bad_request", "unknown command"),
]


def test_hostile_requests_get_one_line_refusals(make_lab, make_daemon):
    lab = make_lab(1)
    d = make_daemon(lab)
    d.call("jobs.create", name="a", world=2, slots=8)
    for line, kind, text in HOSTILE:
        lines = _request(d.socket, line)
        assert len(lines) == 1, (line[:80], lines)
        reply = json.loads(lines[0])
        err = reply["error"]
        assert reply["ok"] is False and err["kind"] == kind and text in err["message"], (line[:80], err)
        assert "internal" not in err["message"] and "\n" not in err["message"], err
        # still serving, and the refused request made or changed nothing
        assert [j["name"] for j in d.call("jobs.list")] == ["a"]
    assert d.call("workers", job="a")["workers"][0]["gone"] is None
    assert d.call("strategy.show", job="a")["version"] == 0
    # a refused name is not half-made: the trailing newline case cannot be found because it is not there
    res = d.aggctl("jobs", "create", "b\n", "--world", "1")
    assert res.exit_code == 1 and "aggd refused" in res.output and "internal" not in res.output, res.output
    assert "Traceback" not in d.log() and "internal error" not in d.log()


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
ARGUMENT_NAMES = sorted({k for spec in Service.COMMANDS.values() for k in spec}) + ["x"]


@st.composite
def requests(draw) -> bytes:
    """A control request line: a known command (or not) with arguments of its own names (or others)
    and random JSON values; sometimes not an object, or not JSON at all."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=200)).replace(b"\n", b" ")
    if kind == 1:
        return json.dumps(draw(JSON)).encode()
    cmd = draw(st.sampled_from(sorted(Service.COMMANDS) + ["jobs", "", "jobs.create.x"]))
    names = st.sampled_from(sorted(Service.COMMANDS.get(cmd, {})) or ARGUMENT_NAMES) | st.sampled_from(ARGUMENT_NAMES)
    args = draw(st.dictionaries(names, JSON | st.sampled_from(["a", "fuzz", 1, 2, 8, "sync", "quorum:1:5ms"]),
                                max_size=4))
    return json.dumps({"cmd": cmd, "args": args}).encode()


def test_random_requests_are_answered_in_one_line_and_never_crash_the_daemon(make_lab, make_daemon):
    lab = make_lab(1)
    d = make_daemon(lab)
    d.call("jobs.create", name="a", world=2, slots=8)
    kinds = collections.Counter()

    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(line=requests())
    def answered(line):
        lines = _request(d.socket, line)
        if not line.strip():       # a blank line asks nothing: no answer
            assert lines == []
            return
        assert len(lines) == 1, (line[:80], lines)
        reply = json.loads(lines[0])
        if reply["ok"]:
            kinds["ok"] += 1
            return
        err = reply["error"]
        kinds[err["kind"]] += 1
        assert err["kind"] != "internal" and "\n" not in err["message"] and len(err["message"]) < 1000, (line, err)

    answered()
    assert kinds["ok"] > 0 and kinds["bad_request"] > 0, kinds
    assert _timed_status(d) < 1.0
    assert "Traceback" not in d.log() and "internal error" not in d.log()
