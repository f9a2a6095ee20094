"""sd_notify(3) without libsystemd: datagrams to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the
abstract namespace). Without ``NOTIFY_SOCKET`` every call is a no-op, so the daemon runs the same
under systemd, in a terminal and in tests (which bind their own socket and point NOTIFY_SOCKET at it).
"""
from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


def _address(value: str) -> str | bytes:
    # "@name" is Linux's abstract namespace: a leading NUL byte on the wire.
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


class Notifier:
    def __init__(self, env: dict[str, str] | None = None):
        env = os.environ if env is None else env
        self.socket_path = env.get("NOTIFY_SOCKET") or None
        self._sock: socket.socket | None = None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        # WATCHDOG_PID names the process the watchdog is meant for; a child that inherited the
        # environment must not keep its parent alive.
        mine = pid is None or pid == str(os.getpid())
        self.watchdog_usec = int(usec) if usec and usec.isdigit() and int(usec) > 0 and mine else 0

    @property
    def enabled(self) -> bool:
        return self.socket_path is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the configured timeout), or None if not asked."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` lines in one datagram; False if there is nobody to tell or it failed."""
        if not self.enabled:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(assignments).encode(), _address(self.socket_path))
            return True
        except OSError as exc:  # systemd gone or socket wrong: the daemon keeps working regardless
            log.warning("sd_notify to %s failed: %s", self.socket_path, exc)
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
