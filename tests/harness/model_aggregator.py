"""The reference model (``aggd.core.model``) served on a UDP socket of 127.0.0.1, for the worker
library's tests of strategies (tests/client/test_client_async.py): every slot and strategy rule is
the model's, so what the client is tested against is what every data plane is tested equal to. The
socket and thread around it add what a test needs and a data plane does not have: a log of every
contribution received, and a pause (packets wait in the socket's buffer). No privileges needed.

Members are registered as they are first heard from, and results fan out by unicast to the members
registered so far (so a straggler that has not sent yet hears nothing)."""
from __future__ import annotations

import collections
import dataclasses
import select
import socket
import threading
import time

from aggd.core import strategy as strategies
from aggd.core.model import AggregatorModel, Bank, JobConfig
from aggd_client.protocol import Header
from aggd_client.protocol.definition import DropReason, MsgType, StrategyKind


class ModelAggregator:
    """One job of ``world`` members under a strategy table ``[(from_round, "strategy text"), ...]``
    (or one strategy text), its rows versions 1, 2, ... A quorum without a deadline in its text
    gets ``timeout`` seconds."""

    def __init__(self, world: int, strategy, *, job: int, elements: int, slots: int = 64,
                 timeout: float = 10.0):
        table = [(0, strategy)] if isinstance(strategy, str) else list(strategy)
        self.job, self.world = job, world
        self.model = AggregatorModel(elements)
        self.model.add_job(JobConfig(job=job, world=world, slots=slots, max_chunks=1 << 16, members={},
                                     elements=elements))
        self.model.set_strategy(job, [strategies.to_entry(_with_deadline(text, timeout), v + 1, r)
                                      for v, (r, text) in enumerate(table)])
        self.model.on_release = self._released
        self.heard: set[int] = set()
        self.log: list[tuple] = []       # (time, rank, round, chunk, step, flags, exponent)
        self.released: list[tuple] = []  # (key, n_contrib, bitmap, cause)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self._run_ok = threading.Event()
        self._run_ok.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._run_ok.set()
        self._thread.join(5)
        self.sock.close()
        if self.error is not None and exc[0] is None:
            raise self.error

    def pause(self) -> None:
        self._run_ok.clear()

    def resume(self) -> None:
        self._run_ok.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_ok.wait()
            r, _, _ = select.select([self.sock], [], [], 0.01)
            while r and self._run_ok.is_set():
                try:
                    data, src = self.sock.recvfrom(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                try:
                    self.handle(data, src)
                except BaseException as e:  # noqa: BLE001 - reported by __exit__
                    self.error = e

    def handle(self, data: bytes, src) -> None:
        h = Header.unpack(data)
        assert h.type == MsgType.CONTRIB and h.job == self.job and h.rank < self.world
        now = time.monotonic_ns()
        self.log.append((now / 1e9, h.rank, h.round, h.chunk, h.step, h.flags, h.exponent))
        if h.rank not in self.heard:
            self.heard.add(h.rank)
            self.model.set_member(self.job, h.rank, src)
        verdict = self.model.process(data, src, now)
        if verdict.action == "tx":
            for addr in verdict.addrs:
                self.sock.sendto(verdict.out, addr)

    def _released(self, job: int, bank: Bank, cause: str) -> None:
        self.released.append((tuple(bank.key), bank.n_contrib, bank.bitmap, cause))

    # -- for assertions ----------------------------------------------------------------------------
    @property
    def drops(self) -> collections.Counter:
        """The job's drops by reason ("busy", "stale", "duplicate", ...), those counted only."""
        counts = self.model.drops(self.job)
        return collections.Counter({r.name.lower(): int(counts[r]) for r in DropReason if counts[r]})

    @property
    def carried(self) -> int:
        return self.model.counter(self.job, "carried")

    @property
    def partials(self) -> int:
        return self.model.counter(self.job, "partials")

    def sent_by(self, rank: int) -> set[tuple[int, int, int]]:
        """(round, chunk, step) of every contribution ``rank`` sent so far."""
        return {(r, c, s) for _, k, r, c, s, *_ in list(self.log) if k == rank}

    def received(self, rank: int, expected: set, timeout: float = 2.0) -> bool:
        """Whether ``rank``'s contributions ``expected`` (round, chunk, step) all arrive in time."""
        deadline = time.monotonic() + timeout
        while not expected <= self.sent_by(rank):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


def _with_deadline(text: str, timeout: float) -> strategies.Strategy:
    parsed = strategies.parse(text)
    if parsed.kind == StrategyKind.QUORUM and text.count(":") < 2:
        parsed = dataclasses.replace(parsed, timeout_us=max(1, round(timeout * 1e6)))
    return parsed
