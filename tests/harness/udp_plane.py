"""A data plane under test served over UDP on loopback, so real ``AggClient`` members (threads)
drive it: every packet goes through ``plane.send`` (the reference model alone, or the model and the
XDP program side by side through BPF_PROG_TEST_RUN, tests/harness/xdp_model.py, which asserts they
agree on every packet), and what it transmits is sent to the members' sockets (group results to
every member). Also the conservation sums of the reference model's banks."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np

from aggd.core.model import BankState

from tests.harness.equivalence import member


def free_addresses(n: int) -> list[tuple[str, int]]:
    """``n`` distinct free UDP addresses on 127.0.0.1."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname() for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def served(plane, members: list[tuple[str, int]]):
    """Serve ``plane`` (started with ``len(members)`` members) on loopback; yields its address and
    the list of failures (a plane's assertion, as text) met while serving."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)   # SO_RCVBUFFORCE (root)  # the plane is slow: no loss here
    srv.bind(("127.0.0.1", 0))
    srv.settimeout(0.1)
    rank_of = {a: r for r, a in enumerate(members)}
    failures: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, src = srv.recvfrom(65536)
            except socket.timeout:
                continue
            try:   # the fixture address of that rank: the one the plane knows the member by
                v = plane.send(data, member(rank_of[src]), time.monotonic_ns())
            except AssertionError as e:
                failures.append(str(e))
                continue
            if v.action == "tx":
                for a in members if v.dest == "group" else [src]:
                    srv.sendto(v.out, a)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname(), failures
    finally:
        stop.set()
        t.join()
        srv.close()


def released_sum(model, job: int) -> list[float]:
    """A list that grows by the dequantised sum of every bank the model releases from now on."""
    sums: list[float] = []
    model.on_release = lambda _job, bank, _cause: sums.append(
        float(np.ldexp(float(bank.values.astype(np.float64).sum()), -int(bank.exponent))))
    return sums


def pending_sum(model, job: int) -> float:
    """The dequantised sum held in the model's open banks of ``job`` (not released yet)."""
    slots = model.jobs[job].slots
    return sum(float(np.ldexp(float(b.values.astype(np.float64).sum()), -int(b.exponent)))
               for s in slots.made().values() for b in s.banks if b.state == BankState.OPEN)
