"""The aggregator in user space: the protocol over a UDP socket (the daemon's overflow path).

The decisions are ``aggd.model.AggregatorModel``'s (in ``userspace`` mode, so short payloads are
served rather than passed on and every message carries Flag.USERSPACE); the arithmetic is the numba
kernels'. This module only moves bytes: receive, ``model.process``, send the verdict's message.
"""
from __future__ import annotations

import errno
import logging
import select
import socket
import threading

import numpy as np

from aggd_client.protocol import HEADER_SIZE, MAX_ELEMENTS
from aggd_client.protocol.definition import DEFAULT_ELEMENTS

from . import kernels
from .model import NO_JOB, Addr, AggregatorModel, JobConfig, Verdict

log = logging.getLogger(__name__)

#: Datagrams read per wake-up before the socket is polled again.
BATCH = 64
_RCVBUF = 4 << 20


class UserspaceAggregator:
    def __init__(self, bind: Addr = ("127.0.0.1", 0), elements: int = DEFAULT_ELEMENTS) -> None:
        kernels.warm_up()
        self.model = AggregatorModel(elements, userspace=True, arithmetic=kernels.KERNEL_ARITHMETIC)
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        except OSError:
            pass
        self._sock.bind(bind)
        self._sock.setblocking(False)
        self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        if bind[0] not in ("", "0.0.0.0"):
            # Results leave by the interface the server is bound to (the routing table may have no
            # multicast route, e.g. on loopback).
            self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(bind[0]))
        # Anything longer than the largest valid message is malformed anyway; one spare element
        # lets the model see it as such instead of the kernel truncating it silently.
        self._buf = bytearray(HEADER_SIZE + 4 * (max(elements, MAX_ELEMENTS) + 1))
        self._view = memoryview(self._buf)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.send_errors = 0

    @property
    def address(self) -> Addr:
        return self._sock.getsockname()

    # -- registry (thread-safe) ------------------------------------------------------------------
    def add_job(self, cfg: JobConfig) -> None:
        with self._lock:
            self.model.add_job(cfg)

    def remove_job(self, job: int) -> None:
        with self._lock:
            self.model.remove_job(job)

    def counters(self, job: int) -> np.ndarray:
        """uint64[len(Counter)] of ``job``."""
        with self._lock:
            return self.model.counters(job)

    def drops(self, job: int = NO_JOB) -> np.ndarray:
        """uint64[len(DropReason)] of ``job`` or of the NO_JOB bucket."""
        with self._lock:
            return self.model.drops(job)

    def stats(self) -> dict:
        with self._lock:
            return self.model.stats()

    # -- serving ---------------------------------------------------------------------------------
    def serve_once(self, timeout: float | None = 0.0) -> int:
        """Wait up to ``timeout`` s for packets, then handle up to BATCH of them; return how many."""
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return 0
        handled = 0
        while handled < BATCH:
            try:
                size, src = self._sock.recvfrom_into(self._buf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # e.g. ICMP errors reported on the socket; keep serving
                log.debug("recv: %s", e)
                break
            with self._lock:
                verdict = self.model.process(self._view[:size], src)
            self._send(verdict)
            handled += 1
        return handled

    def _send(self, verdict: Verdict) -> None:
        if verdict.action != "tx":
            return
        for addr in verdict.addrs:
            try:
                self._sock.sendto(verdict.out, addr)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.ENOBUFS, errno.EPERM, errno.ECONNREFUSED):
                    raise
                self.send_errors += 1

    def start(self) -> "UserspaceAggregator":
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="aggd-userspace", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.serve_once(0.05)

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._sock.close()

    def __enter__(self) -> "UserspaceAggregator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
