"""``aggd``: the aggregator daemon, in the foreground (systemd Type=notify, or a terminal).

Signals:
  SIGTERM, SIGINT  stop cleanly: STOPPING=1, detach the XDP program, keep the maps pinned (unless
                   ``dataplane.unpin_on_stop``), exit 0. A SIGKILL instead leaves the program
                   attached and aggregating from the pinned maps; the next start re-attaches to them.
  SIGHUP           reload the config file: applies the keys in ``aggd.daemon.config.RELOADABLE`` (log level,
                   policy, control socket group, job defaults, the kernel budget for new jobs) and
                   logs the changed keys that need a restart. A bad file is refused whole.

sd_notify: READY=1 once jobs are restored and aggctl is served, STATUS= lines, WATCHDOG=1 every
half WATCHDOG_USEC while the user-space path and the control socket's thread are alive,
RELOADING=1 / READY=1 around a reload, STOPPING=1 on the way out.
"""
from __future__ import annotations

import argparse
import logging
import os
import selectors
import signal
import socket
import sys
import time

from aggd.daemon.config import DEFAULT_PATH, ConfigError, changed_keys, load
from aggd.daemon.control import ControlError, ControlServer
from aggd.daemon.sdnotify import Notifier

log = logging.getLogger("aggd")


def _quiet_libraries(record: logging.LogRecord) -> bool:
    # pyroute2's and asyncio's chatter below WARNING would drown the daemon's own messages; thrift
    # logs a failed connect with a traceback, which aggd.dataplane.p4.thrift reports in one line itself
    if record.name.startswith("thrift"):
        return record.levelno >= logging.CRITICAL
    return record.levelno >= logging.WARNING or not record.name.startswith(("pyroute2", "asyncio"))


def _value(cfg, key: str):
    section, name = key.split(".", 1)
    return cfg.to_dict()[section][name]


#: syslog priorities (sd-daemon(3)'s "<N>" line prefixes) of the logging levels
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class _JournalFormatter(logging.Formatter):
    """Each line prefixed with its syslog priority, which journald takes from a service's stderr
    (``journalctl -u aggd -p err`` then shows the errors); a traceback's lines each get it too."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{_PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def _on_journal(stream) -> bool:
    """Whether ``stream`` is the journal's: systemd sets JOURNAL_STREAM to its device and inode."""
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return os.environ.get("JOURNAL_STREAM", "") == f"{st.st_dev}:{st.st_ino}"


def _setup_logging(level: str, stream=None) -> None:
    stream = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(stream)
    fmt = _JournalFormatter if _on_journal(stream) else logging.Formatter
    handler.setFormatter(fmt("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_quiet_libraries)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="aggd", description="aggd in-network gradient aggregator daemon")
    ap.add_argument("--config", "-c", default=os.environ.get("AGGD_CONFIG", str(DEFAULT_PATH)),
                    help=f"config file (default {DEFAULT_PATH}, or $AGGD_CONFIG)")
    ap.add_argument("--check", action="store_true", help="check the config file and exit")
    ap.add_argument("--reset-kernel-state", action="store_true",
                    help="remove the pinned maps first (after a change of kernel_memory or packet size); "
                         "jobs are kept, their kernel slots start empty")
    args = ap.parse_args(argv)

    try:
        cfg = load(args.config)
    except ConfigError as exc:
        print(f"aggd: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: OK")
        return 0
    _setup_logging(cfg.log.level)
    return Daemon(cfg, args.config, reset_kernel_state=args.reset_kernel_state).run()


class Daemon:
    def __init__(self, cfg, path: str, reset_kernel_state: bool = False):
        from aggd.daemon.service import Service  # bcc and numba load here, after the config is known good

        self.path = path
        self.notifier = Notifier()
        self.service = Service(cfg, reset_kernel_state=reset_kernel_state)
        self.control: ControlServer | None = None
        self.metrics = None  # aggd.metrics.server.MetricsServer: the Prometheus endpoint
        self._stop = False
        self._reload = False

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGHUP:
            self._reload = True
        else:
            self._stop = True

    def run(self) -> int:
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            return self._run(wake_r)
        finally:
            signal.set_wakeup_fd(-1)
            wake_r.close()
            wake_w.close()

    def _run(self, wake_r: socket.socket) -> int:
        try:
            kind = self.service.config.dataplane.kind
            self.notifier.status("starting: " + ("connecting to the P4 switch" if kind == "p4" else
                                                 "loading the XDP program"))
            self.service.start()
            cfg = self.service.config
            from aggd.metrics.server import serve as serve_metrics
            self.metrics = serve_metrics(self.service)  # [metrics] address, in dataplane.netns
            # its own thread: no client holds up this loop (signals, the watchdog ping)
            self.control = ControlServer(cfg.control.socket, self.service.dispatch, cfg.control.group).start()
        except Exception as exc:
            log.error("cannot start: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
            self.notifier.status(f"failed: {exc}")
            if self.metrics is not None:
                self.metrics.close()
            self.service.stop(failed_start=True)
            return 1
        n = len(self.service.registry.jobs)
        self.notifier.ready(f"serving {n} job(s) on {self.service.address}")
        log.info("ready: %d job(s); aggctl on %s", n, self.control.path)
        try:
            self._loop(wake_r)
        finally:
            self.notifier.stopping("stopping: " + ("leaving the P4 switch" if self.service.config.dataplane.kind == "p4"
                                                   else "detaching XDP"))
            log.info("stopping")
            self.control.close()
            self.metrics.close()
            self.service.stop()
        return 0

    def _loop(self, wake_r: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(wake_r, selectors.EVENT_READ, "signal")
        interval = self.notifier.watchdog_interval
        next_ping = time.monotonic()
        try:
            while not self._stop:
                if interval is not None and time.monotonic() >= next_ping:
                    # Ping only while the data path and aggctl's thread work: a dead thread should get
                    # us restarted by systemd rather than look healthy.
                    if not self.service.healthy():
                        log.error("user-space path is not running; withholding the watchdog ping")
                    elif not self.control.alive:
                        log.error("the control socket's thread is not running; withholding the watchdog ping")
                    else:
                        self.notifier.watchdog()
                    next_ping = time.monotonic() + interval
                timeout = 1.0 if interval is None else max(0.0, min(1.0, next_ping - time.monotonic()))
                for _ in sel.select(timeout):
                    try:
                        while wake_r.recv(64):
                            pass
                    except BlockingIOError:
                        pass
                if self._reload:
                    self._reload = False
                    self._do_reload()
        finally:
            sel.close()

    def _do_reload(self) -> None:
        self.notifier.reloading()
        try:
            new = load(self.path)
        except ConfigError as exc:
            log.error("reload refused, keeping the running config: %s", exc)
            self.notifier.ready("reload refused: config has errors (see the log)")
            return
        running = self.service.config
        try:
            self.control.set_group(new.control.group)
        except (OSError, KeyError, ControlError) as exc:
            log.error("reload: %s; control.group stays %r", exc, running.control.group)
            new = new.with_changes("control", group=running.control.group)
        restart = self.service.reload(new)
        now_in_force = sorted(changed_keys(running, self.service.config))
        logging.getLogger().setLevel(new.log.level.upper())
        log.info("reloaded %s; applied: %s", self.path, ", ".join(
            f"{k} = {_value(self.service.config, k)!r}" for k in now_in_force) or "nothing changed")
        if restart:
            log.warning("reloaded; these changes need a restart: %s", ", ".join(restart))
        self.notifier.ready(f"reloaded; serving {len(self.service.registry.jobs)} job(s)")


if __name__ == "__main__":
    sys.exit(main())
