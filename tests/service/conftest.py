"""A real aggd daemon for the service tests: the lab's (``aggd.lab.daemon.LabDaemon``: its own
process, so it can be SIGKILLed, with the XDP data plane in a lab's aggregator namespace, its
control socket, state and pinned maps in per-test places) with a NOTIFY_SOCKET the test reads.

Every daemon runs under ``setpriv`` with exactly the capability bounding set of
``systemd/aggd.service``, so every service test also checks that the unit's capabilities suffice.
"""
from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from aggd.cli.main import main as aggctl_main
from aggd.lab.daemon import LabDaemon

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "aggd.service"


def unit_capabilities() -> list[str]:
    m = re.search(r"^CapabilityBoundingSet=(.*)$", UNIT.read_text(), re.M)
    return m.group(1).split()


class Notifications:
    """Datagrams the daemon sends to its NOTIFY_SOCKET, collected by a thread."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                pass
            except OSError:
                return

    def wait_for(self, line: str, timeout: float, after: int = 0) -> int:
        """Index of the first message at or after ``after`` holding ``line``; waits for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, msg in enumerate(self.messages[after:], after):
                if line in msg.split("\n"):
                    return i
            time.sleep(0.05)
        raise TimeoutError(f"no {line} on NOTIFY_SOCKET within {timeout} s; got {self.messages}")

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()


class Daemon(LabDaemon):
    """The lab's aggd (``aggd.lab.daemon``) run as systemd runs it: under ``setpriv`` with the
    unit's capabilities, ready when it says READY=1 on its NOTIFY_SOCKET (``notify``), and driven
    by ``aggctl`` in-process."""

    def __init__(self, lab, **overrides):
        super().__init__(lab, prefix="aggdt-", **overrides)
        self.notify = Notifications(self.workdir / "notify.sock")
        self._mark = 0

    def command(self, *extra: str) -> list[str]:
        caps = ",".join("+" + c.lower().removeprefix("cap_") for c in unit_capabilities())
        return ["setpriv", f"--bounding-set=-all,{caps}", "--inh-caps=-all", *super().command(*extra)]

    def start(self, *extra: str, wait: bool = True, env: dict | None = None) -> "Daemon":
        self._mark = len(self.notify.messages)
        return super().start(*extra, wait=wait, env={"NOTIFY_SOCKET": str(self.notify.path), **(env or {})})

    def ready(self) -> bool:
        return any("READY=1" in m.split("\n") for m in self.notify.messages[self._mark:])

    def aggctl(self, *argv: str):
        """Run aggctl in-process against this daemon; returns click's Result."""
        return CliRunner().invoke(aggctl_main, ["--socket", self.socket, *argv])

    def close(self) -> None:
        super().close(grace=0)
        self.notify.close()


@pytest.fixture
def make_daemon():
    """Factory ``make_daemon(lab, **config sections)`` -> a started Daemon; always killed and its
    pinned maps removed after the test (before the lab goes: fixtures tear down in reverse)."""
    daemons = []

    def make(lab, *, start: bool = True, **sections) -> Daemon:
        d = Daemon(lab, **sections)
        daemons.append(d)
        if start:
            d.start()
        return d

    try:
        yield make
    finally:
        for d in daemons:
            d.close()


@pytest.fixture(scope="session")
def slot_bytes():
    """Kernel bytes one slot takes (the daemon's own probe), to size budgets in slots."""
    from aggd.dataplane.xdp.ops import probe_value_sizes
    return probe_value_sizes(256)["slots"]
