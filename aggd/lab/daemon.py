"""A real ``aggd`` process for a lab: its XDP data plane on the lab's aggregator interface, in the
aggregator namespace (``dataplane.netns``), its maps pinned in a bpffs folder of its own, its
control socket, state, config file and log in a temporary folder. The training launcher's daemon
and the service tests' are this one.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aggd.daemon.config import to_toml
from aggd.daemon.control import ControlClient, ControlError
from aggd.lab.namespaces import Lab


class LabDaemon:
    """One aggd configuration for ``lab``: ``with LabDaemon(lab, jobs={"default_slots": 64}) as d:
    d.call("status")``. Keyword arguments are config sections, merged into the defaults (and
    ``configure`` merges more and rewrites the file, for a SIGHUP or the next start). ``start()``
    may be called again after a stop or a kill; ``close()`` ends the process and removes its pinned
    maps and folder. ``prefix`` names the folder and the pin folder (short: Unix socket paths must
    stay under 108 bytes)."""

    def __init__(self, lab: Lab, *, prefix: str = "aggdl-", call_timeout: float = 30.0, **sections) -> None:
        self.lab = lab
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.tag = secrets.token_hex(4)
        self.pin_dir = f"/sys/fs/bpf/{prefix}{self.tag}"
        self.socket = str(self.workdir / "control.sock")
        self.state_dir = self.workdir / "state"
        self.config_path = self.workdir / "aggd.toml"
        self.log_path = self.workdir / "aggd.log"
        self.call_timeout = call_timeout
        self.proc: subprocess.Popen | None = None
        self.settings = {
            "dataplane": {"interface": lab.agg_ifname, "netns": lab.agg_ns, "pin_dir": self.pin_dir,
                          "kernel_memory": "8MiB"},
            "jobs": {"default_slots": 16},
            "control": {"socket": self.socket},
            "state": {"dir": str(self.state_dir)},
            "log": {"level": "info"},
        }
        self.configure(**sections)

    def configure(self, **sections) -> None:
        for section, values in sections.items():
            self.settings.setdefault(section, {}).update(values)
        self.config_path.write_text(to_toml(self.settings))

    def command(self, *extra: str) -> list[str]:
        """The daemon's argv (``extra``: more options)."""
        return [sys.executable, "-m", "aggd.daemon.main", "--config", str(self.config_path), *extra]

    def start(self, *extra: str, wait: bool = True, env: dict[str, str] | None = None,
              timeout: float = 120.0) -> "LabDaemon":
        """Start the daemon (``env``: more environment), its output appended to the log; with
        ``wait``, return once it is ready (RuntimeError with the log if it exits or is not ready
        within ``timeout`` s)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(*extra), stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})
        if wait:
            self.wait_ready(timeout)
        return self

    def ready(self) -> bool:
        """Whether the daemon answers on its control socket."""
        try:
            self.call("status")
            return True
        except ControlError:
            return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"aggd exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"aggd not ready after {timeout:.0f} s:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def call(self, cmd: str, **args):
        """One control-socket request."""
        return ControlClient(self.socket, timeout=self.call_timeout).call(cmd, **args)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send ``sig`` and wait for the exit (subprocess.TimeoutExpired after ``timeout`` s); its
        return code. The pinned maps stay."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self, grace: float = 20.0) -> None:
        """Stop the daemon (SIGTERM, killed after ``grace`` s; at once with 0), remove its pinned
        maps and its folder."""
        if self.proc is not None and self.proc.poll() is None and grace > 0:
            try:
                self.stop(signal.SIGTERM, grace)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        from aggd.dataplane.xdp.loader import remove_pinned
        remove_pinned(self.pin_dir)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LabDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def daemons_on(lab: Lab, prefix: str = "aggdl-", call_timeout: float = 30.0, **sections):
    """A started LabDaemon on each of the lab's aggregators (one result group base each, so a
    member's results from each come apart), all closed on exit. ``sections``: more config."""
    daemons = []
    try:
        for i in range(lab.aggregators):
            jobs = {"group_base": f"239.77.{i}.0", **sections.get("jobs", {})}
            d = LabDaemon(lab, prefix=prefix, call_timeout=call_timeout,
                          **{**sections, "jobs": jobs, "dataplane": {"netns": lab.agg_ns_of(i),
                                                                     **sections.get("dataplane", {})}})
            daemons.append(d)
            d.start()
        yield daemons
    finally:
        for d in daemons:
            d.close()
