"""aggctl <-> aggd: JSON lines over a Unix stream socket.

A request is one line ``{"cmd": "jobs.show", "args": {"job": "resnet"}}``; the answer is one line,
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": {"kind": "unknown_job", "message": ...}}``.
``kind`` is a stable word scripts can test (``unknown_job``, ``bad_strategy``, ``bad_request``,
``exists``, ``unsupported``, ``internal``...); ``message`` is for people. A connection may carry
several requests, answered in order.

Access: the socket file is mode 0660, owned by root and the configured group, so only root and
members of that group can connect (the kernel checks write permission on connect).
"""
from __future__ import annotations

import errno
import grp
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20
SOCKET_MODE = 0o660
ENV_SOCKET = "AGGD_SOCKET"
DEFAULT_SOCKET = "/run/aggd/control.sock"


class ControlError(Exception):
    """A refused request: ``kind`` for scripts, the message for people."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class DaemonUnreachable(ControlError):
    """No daemon answers on the socket (not running, wrong path, or no permission)."""


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def decode_request(line: bytes) -> tuple[str, dict]:
    """(cmd, args) of a request line; ControlError("bad_request") if it is not one."""
    try:
        req = json.loads(line)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ControlError("bad_request", f"not a JSON request: {exc}") from None
    if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
        raise ControlError("bad_request", 'a request is a JSON object with a string "cmd"')
    args = req.get("args", {})
    if not isinstance(args, dict):
        raise ControlError("bad_request", '"args" must be a JSON object')
    return req["cmd"], args


def ok(result: Any) -> dict:
    return {"ok": True, "result": result}


def refused(kind: str, message: str) -> dict:
    return {"ok": False, "error": {"kind": kind, "message": message}}


Dispatch = Callable[[str, dict], Any]


def answer(dispatch: Dispatch, line: bytes) -> dict:
    """Run one request line through ``dispatch(cmd, args)``; never raises."""
    try:
        cmd, args = decode_request(line)
        return ok(dispatch(cmd, args))
    except ControlError as exc:
        return refused(exc.kind, exc.message)
    except Exception as exc:  # a bug must not kill the daemon; the operator sees what happened
        log.exception("control request failed")
        return refused("internal", f"internal error: {type(exc).__name__}: {exc}")


class ControlServer:
    """The daemon's end. ``fileno()`` goes into the daemon's selector; ``handle()`` serves the
    connections waiting when it is readable, each to the end (requests are small and quick)."""

    def __init__(self, path: str, dispatch: Dispatch, group: str = "", *, timeout: float = 2.0):
        self.path = Path(path)
        self.dispatch = dispatch
        self.timeout = timeout
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if _answers(self.path):
                raise ControlError("exists", f"another daemon answers on {self.path}")
            self.path.unlink()  # left by a daemon that was killed
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o117)  # never world-accessible, not even between bind and chmod
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.set_group(group)

    def set_group(self, group: str) -> None:
        """Let ``group`` (besides root) use the socket; empty: root only."""
        gid = grp.getgrnam(group).gr_gid if group else 0
        os.chown(self.path, 0 if os.geteuid() == 0 else -1, gid)
        os.chmod(self.path, SOCKET_MODE)

    def fileno(self) -> int:
        return self.sock.fileno()

    def handle(self) -> int:
        """Serve every pending connection; return how many."""
        served = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return served
            served += 1
            with conn:
                conn.settimeout(self.timeout)
                try:
                    self._serve(conn)
                except OSError as exc:  # client went away or stalled
                    log.debug("control connection: %s", exc)

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    conn.sendall(encode(answer(self.dispatch, line)))
            if len(buf) > MAX_LINE:
                conn.sendall(encode(refused("bad_request", f"request longer than {MAX_LINE} bytes")))
                return
            data = conn.recv(65536)
            if not data:
                if buf.strip():
                    conn.sendall(encode(answer(self.dispatch, buf)))
                return
            buf += data

    def close(self) -> None:
        self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def default_socket() -> str:
    return os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET


class ControlClient:
    """aggctl's end: ``call(cmd, **args)`` returns the result or raises ControlError."""

    def __init__(self, path: str | None = None, timeout: float = 30.0):
        self.path = path or default_socket()
        self.timeout = timeout

    def call(self, cmd: str, **args) -> Any:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            try:
                s.connect(self.path)
            except FileNotFoundError:
                raise DaemonUnreachable("not_running", f"aggd is not running (no socket {self.path}; "
                                        f"start it with `systemctl start aggd`, or pass --socket)") from None
            except ConnectionRefusedError:
                raise DaemonUnreachable("not_running", f"aggd is not running (nothing listens on "
                                        f"{self.path})") from None
            except PermissionError:
                raise DaemonUnreachable("permission", f"no permission to use {self.path} (root or the "
                                        f"group set in [control] group may)") from None
            s.sendall(encode({"cmd": cmd, "args": args}))
            s.shutdown(socket.SHUT_WR)
            buf = b""
            while b"\n" not in buf:
                data = s.recv(65536)
                if not data:
                    break
                buf += data
        except socket.timeout:
            raise DaemonUnreachable("timeout", f"aggd did not answer on {self.path} "
                                    f"within {self.timeout:.0f} s") from None
        except OSError as exc:
            if exc.errno in (errno.ECONNRESET, errno.EPIPE):
                raise DaemonUnreachable("not_running", f"aggd closed the connection on {self.path}") from None
            raise
        finally:
            s.close()
        if not buf.strip():
            raise DaemonUnreachable("not_running", f"aggd closed the connection on {self.path} without answering")
        reply = json.loads(buf.split(b"\n", 1)[0])
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise ControlError(err.get("kind", "refused"), err.get("message", "refused"))
        return reply.get("result")
