"""aggctl <-> aggd: JSON lines over a Unix stream socket.

A request is one line ``{"cmd": "jobs.show", "args": {"job": "resnet"}}``; the answer is one line,
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": {"kind": "unknown_job", "message": ...}}``.
``kind`` is a stable word scripts can test (``unknown_job``, ``bad_strategy``, ``bad_request``,
``exists``, ``unsupported``, ``internal``...); ``message`` is for people. A connection may carry
several requests, answered in order. The server's limits (connections, line size, nesting, time)
are those below and in docs/service.md; a command's arguments are checked by :func:`check_args`.

Access: the socket file is mode 0660, owned by root and the configured group, so only root and
members of that group can connect (the kernel checks write permission on connect).
"""
from __future__ import annotations

import errno
import grp
import json
import logging
import math
import os
import re
import selectors
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20          #: bytes of a request line
MAX_DEPTH = 16              #: nesting of arrays and objects in a request
LINE_TIMEOUT = 5.0          #: seconds a request line may take to arrive (and its answer to be read)
IDLE_TIMEOUT = 30.0         #: seconds a connection may stay open with nothing to say
MAX_CONNECTIONS = 64        #: open connections at once; one more is answered "busy"
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


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]+")


def nesting(line: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings do not count),
    found without parsing it: a deep one must be refused before the parser recurses."""
    brackets = _NOT_BRACKETS.sub(b"", _STRINGS.sub(b"", line))
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def decode_request(line: bytes) -> tuple[str, dict]:
    """(cmd, args) of a request line; ControlError("bad_request") if it is not one."""
    if len(line) > MAX_LINE:
        raise ControlError("bad_request", f"request longer than {MAX_LINE} bytes")
    if nesting(line) > MAX_DEPTH:
        raise ControlError("bad_request", f"request nests arrays or objects deeper than {MAX_DEPTH} levels")
    try:
        req = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ControlError("bad_request", f"not a JSON request: {reason}") from None
    if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
        raise ControlError("bad_request", 'a request is a JSON object with a string "cmd"')
    args = req.get("args", {})
    if not isinstance(args, dict):
        raise ControlError("bad_request", '"args" must be a JSON object')
    return req["cmd"], args


MAX_TEXT = 256              #: characters of a text argument
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_args(cmd: str, args: dict, spec: dict[str, str]) -> dict:
    """``args`` of ``cmd`` checked against ``spec`` (argument -> kind, ``?`` after an optional
    one's kind: absent or null). Kinds: ``int`` (a JSON integer, not true/false), ``text`` (a
    string of at most MAX_TEXT characters, no control characters), ``job`` (a job's name or id),
    ``object`` (a JSON object, whose keys its handler checks), ``number`` (a finite JSON number).
    ControlError("bad_request") naming the argument otherwise; ranges are the registry's. Returns
    the arguments given (the null ones left out: their handler's defaults apply)."""
    for name in args:
        if name not in spec:
            known = ", ".join(spec) or "none"
            raise ControlError("bad_request", f"{cmd}: unknown argument {_shown(name)} (known: {known})")
    for name, kind in spec.items():
        optional = kind.endswith("?")
        kind = kind.rstrip("?")
        if args.get(name) is None:
            if optional:
                continue
            raise ControlError("bad_request", f"{cmd}: argument {name!r} is required")
        value = args[name]
        is_int = isinstance(value, int) and not isinstance(value, bool)
        is_text = isinstance(value, str)
        if kind == "int" and not is_int:
            raise ControlError("bad_request", f"{cmd}: {name} must be an integer, not {_shown(value)}")
        if kind == "text" and not is_text:
            raise ControlError("bad_request", f"{cmd}: {name} must be a string, not {_shown(value)}")
        if kind == "number" and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                     and math.isfinite(value)):
            raise ControlError("bad_request", f"{cmd}: {name} must be a number, not {_shown(value)}")
        if kind == "object" and not isinstance(value, dict):
            raise ControlError("bad_request", f"{cmd}: {name} must be an object, not {_shown(value)}")
        if kind == "job" and not (is_int or is_text):
            raise ControlError("bad_request", f"{cmd}: {name} must be a job name or id, not {_shown(value)}")
        if is_int and not -(1 << 63) <= value < 1 << 63:
            raise ControlError("bad_request", f"{cmd}: {name} {_shown(value)} is out of range")
        if is_text and (len(value) > MAX_TEXT or _CONTROL_CHARS.search(value)):
            raise ControlError("bad_request", f"{cmd}: {name} must be at most {MAX_TEXT} characters without "
                                              f"control characters (newlines, tabs...), not {_shown(value)}")
    return {name: value for name, value in args.items() if value is not None}


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


class _Conn:
    """One client connection of the server's event loop."""

    __slots__ = ("sock", "inbuf", "outbuf", "line_since", "idle_since", "eof", "refusing")

    def __init__(self, sock: socket.socket, now: float, refusing: bool = False):
        self.sock = sock
        self.inbuf = b""
        self.outbuf = b""
        self.line_since: float | None = None  #: when the first byte of the unfinished line came
        self.idle_since = now                 #: when the connection last had nothing to do
        self.eof = False                      #: the client shut its end (no more requests)
        self.refusing = refusing              #: over the connection cap: answered "busy", then closed


class ControlServer:
    """The daemon's end: a thread of its own runs a selector over the listening socket and every
    connection, so no client can hold up another, nor the daemon's main loop (signals, the
    watchdog ping). Requests go to ``dispatch`` one at a time, in the order their lines complete;
    a connection's answers come in the order of its requests.

    Limits, each refused or closed with a reason in the log: at most ``max_connections`` open
    connections (one more is answered ``busy`` and closed); a request line must be complete within
    ``line_timeout`` s of its first byte and at most MAX_LINE bytes; a connection with nothing
    to say for ``idle_timeout`` s is closed, and so is one that does not read its answers within
    ``line_timeout`` s.
    """

    def __init__(self, path: str, dispatch: Dispatch, group: str = "", *, line_timeout: float = LINE_TIMEOUT,
                 idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS):
        self.path = Path(path)
        self.dispatch = dispatch
        self.line_timeout = line_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
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
        self.sock.listen(64)
        self.sock.setblocking(False)
        try:
            self.set_group(group)
        except BaseException:
            self.sock.close()
            self.path.unlink(missing_ok=True)
            raise
        self._conns: dict[int, _Conn] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_group(self, group: str) -> None:
        """Let ``group`` (besides root) use the socket; empty: root only."""
        gid = grp.getgrnam(group).gr_gid if group else 0
        try:
            os.chown(self.path, 0 if os.geteuid() == 0 else -1, gid)
        except PermissionError:
            # without CAP_CHOWN (the unit has none) a process may give a file only to its own groups
            raise ControlError("control_group", f"control.group {group!r}: the daemon is not in that group, so "
                                                f"it cannot give it {self.path}: add SupplementaryGroups={group} "
                                                f"to the unit (`systemctl edit aggd`)") from None
        os.chmod(self.path, SOCKET_MODE)

    @property
    def connections(self) -> int:
        """Open client connections (those being refused included)."""
        return len(self._conns)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "ControlServer":
        """Serve in a thread of its own until :meth:`close`."""
        self._thread = threading.Thread(target=self._run, name="aggd-control", daemon=True)
        self._thread.start()
        return self

    # -- the event loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                try:
                    self._step(sel)
                except Exception:  # a bug here must not end aggctl's service
                    log.exception("control socket loop")
                    time.sleep(0.1)
        finally:
            for conn in list(self._conns.values()):
                self._drop(sel, conn, None)
            sel.close()

    def _step(self, sel: selectors.BaseSelector) -> None:
        for key, events in sel.select(self._next_deadline()):
            if key.fileobj is self._wake_r:
                try:
                    while self._wake_r.recv(64):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass
            elif key.fileobj is self.sock:
                self._accept(sel)
            else:
                conn = key.data
                if conn.sock.fileno() in self._conns:
                    self._io(sel, conn, events)
        self._expire(sel)

    def _next_deadline(self) -> float:
        now = time.monotonic()
        due = [self._deadline(c) for c in self._conns.values()]
        return max(0.0, min(due) - now) if due else 1.0

    def _deadline(self, conn: _Conn) -> float:
        if conn.refusing:
            return conn.idle_since + 1.0
        if conn.outbuf or conn.line_since is not None:
            since = conn.line_since if conn.line_since is not None else conn.idle_since
            return since + self.line_timeout
        return conn.idle_since + self.idle_timeout

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: try again at the next readiness
                log.warning("control socket: cannot accept: %s", exc)
                return
            sock.setblocking(False)
            now = time.monotonic()
            refusing = len(self._conns) >= self.max_connections
            conn = _Conn(sock, now, refusing)
            if refusing:
                if sum(c.refusing for c in self._conns.values()) >= self.max_connections:
                    sock.close()  # refusing that many already: no more answers
                    continue
                log.warning("control socket: %d connections open; refusing one more", self.max_connections)
                conn.outbuf = encode(refused("busy", f"aggd serves at most {self.max_connections} control "
                                                     f"connections at once; try again"))
            self._conns[sock.fileno()] = conn
            sel.register(sock, self._events(conn), conn)
            if refusing:
                self._flush(sel, conn)

    @staticmethod
    def _events(conn: _Conn) -> int:
        if conn.refusing:  # send "busy", then read and forget until the client closes
            return selectors.EVENT_WRITE if conn.outbuf else selectors.EVENT_READ
        # no reading while an answer waits to be read: a client cannot pile up requests
        return selectors.EVENT_WRITE if conn.outbuf else selectors.EVENT_READ

    def _io(self, sel: selectors.BaseSelector, conn: _Conn, events: int) -> None:
        if events & selectors.EVENT_WRITE and conn.outbuf:
            if not self._flush(sel, conn):
                return
            if conn.refusing:
                return
        elif events & selectors.EVENT_READ:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._drop(sel, conn, None if conn.refusing else f"receive failed: {exc}")
                return
            if conn.refusing:  # read and forget, so the close does not reset the "busy" answer
                if not data:
                    self._drop(sel, conn, None)
                return
            if not data:
                conn.eof = True
            else:
                if conn.line_since is None:
                    conn.line_since = time.monotonic()
                conn.inbuf += data
        self._work(sel, conn)

    def _work(self, sel: selectors.BaseSelector, conn: _Conn) -> None:
        """Answer the connection's complete lines, one at a time, each once the one before it
        is read; then wait for more (or close, after the client's end of file)."""
        while True:
            if conn.outbuf:
                if not self._flush(sel, conn):
                    return
                if conn.outbuf:  # the client reads slowly: wait until it can take more
                    sel.modify(conn.sock, self._events(conn), conn)
                    return
            line, nl, rest = conn.inbuf.partition(b"\n")
            if len(line) > MAX_LINE:
                conn.outbuf = encode(refused("bad_request", f"request longer than {MAX_LINE} bytes"))
                conn.inbuf, conn.eof = b"", True
                continue
            if nl or (conn.eof and line.strip()):
                conn.inbuf = rest
                conn.line_since = time.monotonic() if rest.strip() else None
                if line.strip():
                    conn.outbuf = encode(answer(self.dispatch, line))
                continue
            break
        if conn.eof:
            self._drop(sel, conn, None)
            return
        if not conn.inbuf.strip():
            conn.inbuf, conn.line_since = b"", None
        sel.modify(conn.sock, self._events(conn), conn)

    def _flush(self, sel: selectors.BaseSelector, conn: _Conn) -> bool:
        """Send what the socket takes of the connection's answer; False if it is closed."""
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:  # client went away
            self._drop(sel, conn, None if conn.refusing else f"send failed: {exc}")
            return False
        conn.outbuf = conn.outbuf[sent:]
        if sent:
            conn.idle_since = time.monotonic()
        if conn.refusing and not conn.outbuf:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if conn.refusing:
            sel.modify(conn.sock, self._events(conn), conn)
        return True

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if now < self._deadline(conn):
                continue
            if conn.refusing:
                why = None
            elif conn.outbuf:
                why = f"did not read its answer within {self.line_timeout:g} s"
            elif conn.line_since is not None:
                why = f"did not complete a request line within {self.line_timeout:g} s"
            else:
                why = None  # idle: a quiet close is no news
            self._drop(sel, conn, why)

    def _drop(self, sel: selectors.BaseSelector, conn: _Conn, why: str | None) -> None:
        if why:
            log.info("control connection closed: %s", why)
        self._conns.pop(conn.sock.fileno(), None)
        try:
            sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            self._thread.join()
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()
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
