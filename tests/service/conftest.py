"""A real aggd daemon for the service tests: started as its own process (so it can be SIGKILLed),
with the XDP data plane in a lab's aggregator namespace (``dataplane.netns``), its control socket,
state and pinned maps in per-test places, and a NOTIFY_SOCKET the test reads.

Every daemon runs under ``setpriv`` with exactly the capability bounding set of
``systemd/aggd.service``, so every service test also checks that the unit's capabilities suffice.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from aggd.cli.main import main as aggctl_main
from aggd.daemon.config import to_toml
from aggd.daemon.control import ControlClient

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


class Daemon:
    """One aggd configuration in a lab; ``start()`` may be called again after a stop or a kill."""

    def __init__(self, lab, workdir: Path, **overrides):
        self.lab = lab
        self.workdir = workdir
        self.tag = secrets.token_hex(4)
        self.pin_dir = f"/sys/fs/bpf/aggdt-{self.tag}"
        self.socket = str(workdir / "control.sock")
        self.state_dir = workdir / "state"
        self.config_path = workdir / "aggd.toml"
        self.log_path = workdir / "aggd.log"
        self.proc: subprocess.Popen | None = None
        self.notify = Notifications(workdir / "notify.sock")
        self.settings = {
            "dataplane": {"interface": lab.agg_ifname, "netns": lab.agg_ns, "pin_dir": self.pin_dir,
                          "kernel_memory": "8MiB"},
            "jobs": {"default_slots": 16},
            "control": {"socket": self.socket},
            "state": {"dir": str(self.state_dir)},
            "log": {"level": "info"},
        }
        self.configure(**overrides)

    def configure(self, **sections) -> None:
        for section, values in sections.items():
            self.settings.setdefault(section, {}).update(values)
        self.config_path.write_text(to_toml(self.settings))

    def start(self, *extra: str, wait: bool = True, env: dict | None = None) -> None:
        caps = ",".join("+" + c.lower().removeprefix("cap_") for c in unit_capabilities())
        argv = ["setpriv", f"--bounding-set=-all,{caps}", "--inh-caps=-all",
                sys.executable, "-m", "aggd.daemon.main", "--config", str(self.config_path), *extra]
        self._mark = len(self.notify.messages)
        full_env = {**os.environ, "NOTIFY_SOCKET": str(self.notify.path), **(env or {})}
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        log.close()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("READY=1" in m.split("\n") for m in self.notify.messages[self._mark:]):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"aggd exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise AssertionError(f"aggd not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def send(self, sig) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def call(self, cmd: str, **args):
        return ControlClient(self.socket).call(cmd, **args)

    def aggctl(self, *argv: str):
        """Run aggctl in-process against this daemon; returns click's Result."""
        return CliRunner().invoke(aggctl_main, ["--socket", self.socket, *argv])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        from aggd.dataplane.xdp.loader import remove_pinned
        remove_pinned(self.pin_dir)
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def make_daemon():
    """Factory ``make_daemon(lab, **config sections)`` -> a started Daemon; always killed and its
    pinned maps removed after the test (before the lab goes: fixtures tear down in reverse)."""
    daemons = []

    def make(lab, *, start: bool = True, **sections) -> Daemon:
        # short paths: Unix socket names must stay under 108 bytes
        workdir = Path(tempfile.mkdtemp(prefix="aggdt-"))
        d = Daemon(lab, workdir, **sections)
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
