"""A tiny fake aggregator on 127.0.0.1 for the client's unit tests (no privileges needed), and the
checks those tests share.

``FakeAggregator`` sums the contributions of ``world`` client threads per (round, chunk) with the
aggregator's arithmetic (``quant.align_and_sum``: align to the smallest exponent by arithmetic right
shift, add), deduplicates by rank, re-sends released results to a sender that retransmits, and
answers every member by unicast to the address its contributions came from (``group=None``) or to a
group. Knobs make it drop packets both ways, NACK, or flag OVERFLOW. ``PrecisionFake`` reads
contributions in the type their ``code`` says and answers with results of the job's result type
(int32 for int16, int16 for int8), as the protocol's Precision asks; ``result_code`` makes it answer
in another precision.
"""
from __future__ import annotations

import random
import select
import socket
import threading

import numpy as np

from aggd_client import AggClient, quant
from aggd_client.protocol import HEADER_SIZE, Header
from aggd_client.protocol.definition import LANES, MAGIC, VERSION, Flag, MsgType, NackCode, Precision

JOB = 7


class FakeAggregator:
    """Sums contributions per (round, chunk); unicasts results to every member."""

    def __init__(self, world: int, *, job: int = JOB, drop: float = 0.0, overflow: bool = False,
                 members: dict[int, tuple[str, int]] | None = None, seed: int = 1,
                 n_contrib: int | None = None, group: tuple[str, int] | None = None,
                 remember: bool = True, lose_once: set[tuple[int, int, int]] = frozenset()):
        self.group = group
        self.lose_once = set(lose_once)  # (round, chunk, rank): that contribution's first copy is lost
        self.remember = remember  # keep released results for re-sends (off: memory tests)
        self.world, self.job, self.drop, self.overflow = world, job, drop, overflow
        self.registered = members  # rank -> address; None: accept any source
        self.n_contrib = n_contrib
        self.rng = random.Random(seed)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE, if privileged
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(("127.0.0.1", 0))
        if group is not None:
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF,
                                 socket.inet_aton("127.0.0.1"))
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        self.address = self.sock.getsockname()
        self.pending: dict[tuple[int, int], dict[int, tuple[bytes, int, int]]] = {}
        self.released: dict[tuple[int, int], tuple[Header, bytes]] = {}
        self.addr: dict[int, tuple[str, int]] = {}
        self.received = self.dropped = self.rereads = self.duplicates = self.retransmits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def _send(self, data: bytes, addr) -> None:
        if self.drop and self.rng.random() < self.drop:
            self.dropped += 1
            return
        self.sock.sendto(data, addr)

    def _nack(self, h: Header, code: int, src) -> None:
        h.type, h.code = MsgType.NACK, code
        self.sock.sendto(h.pack(), src)

    def _run(self) -> None:
        while not self._stop.is_set():
            r, _, _ = select.select([self.sock], [], [], 0.02)
            if not r:
                continue
            while True:
                try:
                    data, src = self.sock.recvfrom(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                self.handle(data, src)

    def handle(self, data: bytes, src) -> None:
        self.received += 1
        h = Header.unpack(data)
        if not self._admit(h, src):
            return
        key = (h.round, h.chunk)
        if key in self.released:  # the sender lost the result: send it again
            self.rereads += 1
            res, payload = self.released[key]
            res.flags |= Flag.REREAD
            return self._send(res.pack() + payload, src)
        contribs = self.pending.setdefault(key, {})
        if h.rank in contribs:
            self.duplicates += 1
            return
        self.addr[h.rank] = src
        contribs[h.rank] = (data, h.exponent, h.count)
        if len(contribs) < self.world:
            return
        del self.pending[key]
        res, payload = self._sum(h, contribs)
        if self.remember:
            self.released[key] = (res, payload)
        msg = res.pack() + payload
        if self.group is not None:
            self._send(msg, self.group)
            return
        for r in range(self.world):
            self._send(msg, self.addr[r])

    def _admit(self, h: Header, src) -> bool:
        """Whether a contribution counts: drops (lost on the way in) and NACKs say no."""
        if self.drop and self.rng.random() < self.drop:
            self.dropped += 1
            return False
        assert h.magic == MAGIC and h.version == VERSION and h.type == MsgType.CONTRIB
        if (h.round, h.chunk, h.rank) in self.lose_once:
            self.lose_once.discard((h.round, h.chunk, h.rank))
            self.dropped += 1
            return False
        if h.job != self.job:
            self._nack(h, NackCode.UNKNOWN_JOB, src)
            return False
        if h.rank >= self.world or (self.registered is not None and
                                    tuple(self.registered.get(h.rank, ())) != tuple(src)):
            self._nack(h, NackCode.NOT_MEMBER, src)
            return False
        if h.flags & Flag.RETRANSMIT:
            self.retransmits += 1
        return True

    def _sum(self, h: Header, contribs) -> tuple[Header, bytes]:
        """The result of a chunk every member sent: its header and payload."""
        q = np.stack([np.frombuffer(contribs[r][0], "<i4", offset=HEADER_SIZE)
                      for r in sorted(contribs)])
        assert len({c[2] for c in contribs.values()}) == 1, "every member sends the same count"
        assert not q[:, h.count:].any(), "padding is zero"
        e = np.array([[contribs[r][1]] for r in sorted(contribs)])
        total, e_min = quant.align_and_sum(q[:, None, :], e)
        assert np.abs(total).max() <= 2**31 - 1, "honest senders never overflow int32"
        res = Header(type=MsgType.RESULT, job=h.job, rank=0xFFFF, round=h.round, chunk=h.chunk,
                     count=h.count, exponent=int(e_min[0]),
                     flags=Flag.OVERFLOW if self.overflow else 0,
                     contributors=(1 << self.world) - 1,
                     n_contrib=self.world if self.n_contrib is None else self.n_contrib)
        return res, total[0].astype("<i4").tobytes()


class PrecisionFake(FakeAggregator):
    """A ``FakeAggregator`` of a job of ``precision`` (``room``: contributions carry room for their
    result, their values first); it records the codes and sizes of the contributions it got."""

    def __init__(self, world: int, precision: Precision, *, result_code: int | None = None, room: bool = False,
                 **kw):
        super().__init__(world, **kw)
        self.precision = Precision(precision)
        self.room = room
        self.result_code = int(self.precision) if result_code is None else int(result_code)
        self.codes: set[int] = set()
        self.sizes: set[int] = set()

    def _admit(self, h: Header, src) -> bool:
        assert h.type == MsgType.CONTRIB
        self.codes.add(h.code)
        if h.code != self.precision:
            return False  # the data plane drops it (bad_precision)
        if h.rank >= self.world:
            self._nack(h, NackCode.NOT_MEMBER, src)
            return False
        return True

    def handle(self, data: bytes, src) -> None:
        self.sizes.add(len(data))
        super().handle(data, src)

    def _sum(self, h: Header, contribs) -> tuple[Header, bytes]:
        lanes = LANES[self.precision]
        width = lanes.result_bytes if self.room else lanes.contrib_bytes
        q = np.stack([np.frombuffer(contribs[r][0], lanes.contrib, offset=HEADER_SIZE,
                                    count=(len(contribs[r][0]) - HEADER_SIZE) // width)
                      for r in sorted(contribs)])
        assert np.abs(q.astype(np.int64)).max(initial=0) <= lanes.contrib_max
        assert not q[:, h.count:].any(), "padding is zero"
        e = np.array([[contribs[r][1]] for r in sorted(contribs)])
        total, e_min = quant.align_and_sum(q[:, None, :], e)
        assert np.abs(total).max() <= lanes.result_max, "honest senders never overflow the result lanes"
        res = Header(type=MsgType.RESULT, job=h.job, rank=0xFFFF, round=h.round, chunk=h.chunk,
                     count=h.count, exponent=int(e_min[0]), code=self.result_code,
                     contributors=(1 << self.world) - 1, n_contrib=self.world)
        rdtype = LANES[Precision(self.result_code)].result if self.result_code in LANES else "<i4"
        return res, total[0].astype(rdtype).tobytes()


def run_workers(fake: FakeAggregator, arrays, op="sum", rounds=1, **kw):
    """``len(arrays)`` clients (ranks) in threads; each reduces its array ``rounds`` times."""
    world = len(arrays)
    kw.setdefault("give_up_after", 10.0)
    clients = [AggClient(fake.address, JOB, r, world, bind=("127.0.0.1", 0), **kw)
               for r in range(world)]
    results: list = [None] * world
    errors: list = [None] * world

    def work(r):
        try:
            results[r] = [clients[r].allreduce(arrays[r], op=op) for _ in range(rounds)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a worker hung"
    finally:
        for c in clients:
            c.close()
    for e in errors:
        if e is not None:
            raise e
    return results, clients


def expected_and_bound(arrays, world, elements, op="sum", precision=Precision.INT32, terms=None):
    """The float64 sum of ``arrays`` and the per-element bound the client's result must meet.

    The bound is ``error_bound`` of each chunk's result exponent (the smallest of the workers',
    which their own quantisation gives: the rounding does not change them), plus slack for the
    float64 reference's own rounding (a few ulps of the sum of magnitudes)."""
    flat = [np.ravel(a) for a in arrays]
    n = flat[0].size
    exact = np.sum([f.astype(np.float64) for f in flat], axis=0)
    exps = np.stack([quant.quantise_flat(f, world, elements, precision=precision, terms=terms)[1]
                     for f in flat]).min(axis=0)
    bound = np.repeat(quant.error_bound(world, exps, precision=precision), elements)[:n]
    # the float64 reference itself rounds: at most world ulps of the largest partial sum
    bound = bound + world * np.spacing(np.sum([np.abs(f.astype(np.float64)) for f in flat], axis=0))
    if op == "mean":
        exact, bound = exact / world, bound / world
    return exact.reshape(np.shape(arrays[0])), bound.reshape(np.shape(arrays[0]))


def check_close(result, exact, bound):
    assert result.shape == exact.shape
    err = np.abs(result.astype(np.float64) - exact)
    allowed = bound + quant.output_rounding(result)
    worst = np.argmax(err - allowed) if err.size else 0
    assert (err <= allowed).all(), (
        f"error {err.flat[worst]} > bound {allowed.flat[worst]} at {worst}")


def make_arrays(world, size, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * scale).astype(dtype) for _ in range(world)]
