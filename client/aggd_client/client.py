"""The worker side of aggd: ``AggClient`` sends float tensors through the aggregator.

``allreduce_async(x)`` starts one *round* of the job and returns an ``AllreduceHandle``;
``allreduce(x)`` is ``allreduce_async(x).wait()``. The tensor is cut into chunks of ``elements``
values, each chunk is quantised to int32 with its own exponent (``quant``) and sent as one
contribution packet; the aggregator sums the contributions of a chunk and multicasts (or unicasts)
the result.

Strategies (docs/protocol.md, "What clients do"). Every result names the strategy that governed its
round (``strategy``, ``param``, ``strategy_version``); the newest one seen is the strategy in force
(``sync`` before the first result, unless the constructor's ``strategy`` says otherwise). A new
round is sent only when it admits one: ``sync``, ``quorum`` and ``wbsp`` one round outstanding
(sent, result not complete), ``ssp:s`` ``s + 1``, ``async`` 3. Otherwise ``allreduce_async`` makes
progress on the earlier rounds until it may (``block=False``: raises ``WouldBlock``;
``must_wait()`` says beforehand). Under ``wbsp`` a call made while a round is outstanding (same
shape, dtype and op) is sent as that round's next ``step`` instead, at most ``WBSP_MAX_STEPS`` per
round, and its handle resolves with that round's result. A result for a later round than the one a
chunk asked for completes the chunk when it was governed by ``quorum`` or ``async`` (a straggler
gets the newest result) and the next round starts after it. Quantisation leaves headroom for the
contributions a result may hold beyond one per member (``quant.terms_for``).

Transport, as docs/protocol.md asks:

* Contributions leave from one UDP socket bound to ``bind``; that address is the worker's registered
  member address. NACKs and unicast results come back to it. With ``group``, a second socket bound
  to the group's port and joined to the group (on the interface that routes to the server, with
  ``IP_MULTICAST_ALL`` off) receives the multicast results. Both are polled.
* A round keeps its result state (chunks answered, their ``n_contrib``, the output array); each of
  its steps is a *send* with its own ring of ``packet_dtype(elements)`` records indexed by
  ``chunk % slots`` (the only copy of the quantised tensor: about ``slots`` packets per send in
  flight, whatever the tensor size) and per-chunk send state. One receive loop hands every batch of
  results to the rounds in flight by ``(round, chunk)``.
* Order: at most ``min(window, slots)`` chunks in flight over all rounds still waiting for their
  result; within a send chunk ``c + slots`` leaves only after chunk ``c``'s answer; and a send's
  chunk ``c`` leaves only after every earlier send has sent its chunks of ``c``'s slot (for an
  earlier step of the same round: its chunk ``c``), so the aggregator sees each slot's keys
  ``(round, chunk)`` grow.
* Batches leave with UDP GSO (one ``sendmsg`` carries up to 64 packets) unless ``gso=False``; a
  kernel that refuses GSO makes the client fall back to one ``sendto`` per packet, once for good.
* Results are received straight into a preallocated record array (one ``recvmmsg`` a batch), checked by column (or by the
  numba kernel of ``_fast``), dequantised into the output by block. A chunk without an answer after
  the retransmission timeout (estimated from answer times, never below ``retransmit_timeout``:
  ``flow.RtoEstimator``; doubled at each retry of that chunk, at most ``max(1 s,
  retransmit_timeout)``; at most ``max_retransmit_interval`` under ``quorum``, whose data plane uses
  the members' retransmissions as the clock of its deadline) is sent again flagged RETRANSMIT.
  Chunks in flight are further bounded by a congestion window (``flow.CongestionWindow``: halved
  when first timeouts fire for chunks that answers to later chunks have passed by, regrown as
  answers come; without ``window``, at most ``flow.MAX_INFLIGHT_BYTES`` of packets).
  No new result for ``give_up_after`` seconds spent inside the client's calls while a round waits
  raises ``NoAnswerError``.

Progress happens only inside calls (``allreduce_async``, ``wait``, ``done``, ``must_wait``): there is
no thread. An ``AggClient`` is not thread-safe: one per worker (per thread).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import selectors
import socket
import struct
import time
from typing import Callable, NamedTuple

import numpy as np

from . import _fast, msend, quant
from .flow import CongestionWindow, RtoEstimator, default_window
from .mrecv import MultiReceiver
from .errors import (AggdError, AggregationOverflowError, NoAnswerError, NotMemberError,
                     ProtocolError, UnknownJobError)
from .protocol import HEADER_DTYPE, HEADER_SIZE, packet_dtype
from .protocol.definition import (MAGIC, MAX_ELEMENTS, MAX_JOBS, MAX_MEMBERS, SKIP_MAX, VERSION, Flag,
                                  MsgType, NackCode, StrategyKind)

__all__ = ["AggClient", "AllreduceHandle", "StrategyInfo", "WouldBlock", "ASYNC_OUTSTANDING",
           "WBSP_MAX_STEPS"]

log = logging.getLogger("aggd_client")

#: Linux socket options Python does not name on every version.
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)
SOL_UDP = getattr(socket, "SOL_UDP", 17)
#: The kernel takes at most 64 segments in one GSO send (UDP_MAX_SEGMENTS on older kernels) and a
#: UDP datagram carries at most 65507 bytes of payload.
GSO_MAX_SEGMENTS = 64
UDP_MAX_PAYLOAD = 65507
#: errnos that mean "this kernel/path cannot do UDP GSO".
#: EMSGSIZE: GSO segments must fit the MTU; a job with larger packets (served by the daemon in user
#: space) needs plain sends, which IP fragments.
_GSO_REFUSED = {errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EMSGSIZE}
#: errnos that lose the packet but leave the socket usable: loss recovery takes care of them.
_TRANSIENT = {errno.ENOBUFS, errno.EAGAIN, errno.EPERM, errno.ECONNREFUSED, errno.EHOSTUNREACH,
              errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}
#: Largest receive batch handled at once (at most STAGE_BYTES of packets: 256 of 832 values, 31 of
#: 8,192), and largest admission batch (keeps temporaries small).
STAGE = 256
STAGE_BYTES = 1 << 20
ADMIT_MAX = 64
#: A batch of answers smaller than this, while at least ``4 * SMALL_BATCH`` packets await theirs and
#: nothing can be sent, makes the client wait ``BATCH_WAIT`` s before reading again: each pass of
#: the progress loop costs tens of microseconds of Python, so passes of a few answers each (what
#: waking at every arrival gives when workers share cores) cost more CPU than the packets. The
#: answers pile up meanwhile (the window holds far more) and the wait gives the CPU to the others.
SMALL_BATCH = 16
BATCH_WAIT = 0.001
SOCKET_BUFFER = 16 << 20
RTO_CAP = 1.0
#: Rounds a worker may have outstanding under ``async``.
ASYNC_OUTSTANDING = 3
#: Steps a worker sends into one ``wbsp`` round (the quantisation headroom, ``quant.HEADROOM``).
WBSP_MAX_STEPS = quant.HEADROOM[StrategyKind.WBSP]
#: Rings kept for reuse by the next sends.
RING_POOL = 4

_PENDING, _INFLIGHT, _DONE = 0, 1, 2
# plain ints: numpy compares against enum members far more slowly
_RESULT, _NACK, _CONTRIB = int(MsgType.RESULT), int(MsgType.NACK), int(MsgType.CONTRIB)
_RETRANSMIT, _OVERFLOW, _REREAD = int(Flag.RETRANSMIT), int(Flag.OVERFLOW), int(Flag.REREAD)
_QUORUM, _ASYNC = int(StrategyKind.QUORUM), int(StrategyKind.ASYNC)


class WouldBlock(AggdError):
    """``allreduce_async(..., block=False)`` was called while the strategy in force admits no
    further round (``AggClient.must_wait()`` is true): wait on an earlier handle, or call again."""


def _kind(value: int) -> StrategyKind:
    try:
        return StrategyKind(int(value))
    except ValueError:  # a kind this client does not know: assume the strictest
        return StrategyKind.SYNC


class StrategyInfo(NamedTuple):
    """A strategy as results carry it: ``kind``, ``param`` (quorum ``k``, ssp staleness ``s``) and
    the ``version`` of the job's strategy table that governed the round."""
    kind: StrategyKind = StrategyKind.SYNC
    param: int = 0
    version: int = 0

    @property
    def max_outstanding(self) -> int:
        """Rounds a worker may have outstanding (sent, result not complete) under this strategy."""
        if self.kind == StrategyKind.SSP:
            return self.param + 1
        if self.kind == StrategyKind.ASYNC:
            return ASYNC_OUTSTANDING
        return 1

    @classmethod
    def parse(cls, text: str) -> "StrategyInfo":
        """``sync``, ``quorum:K`` (``quorum:K:TIMEOUT`` too: the timeout is the data plane's),
        ``ssp:S``, ``async`` or ``wbsp`` -- the text form ``aggctl`` and ``JobInfo.strategy`` use."""
        parts = str(text).strip().lower().split(":")
        try:
            kind = StrategyKind[parts[0].upper()]
        except KeyError:
            names = ", ".join(k.name.lower() for k in StrategyKind)
            raise ValueError(f"unknown strategy {text!r}: use one of {names}") from None
        if kind not in (StrategyKind.QUORUM, StrategyKind.SSP):
            return cls(kind)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ValueError(f"strategy {text!r}: {parts[0]} needs an integer parameter")
        return cls(kind, int(parts[1]))

    def __str__(self) -> str:
        name = self.kind.name.lower()
        return f"{name}:{self.param}" if self.kind in (StrategyKind.QUORUM, StrategyKind.SSP) else name


def _local_ip_towards(server: tuple[str, int]) -> str:
    """The local address the kernel would send from to reach ``server`` (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(server)
        return probe.getsockname()[0]
    finally:
        probe.close()


def _grow_buffers(sock: socket.socket) -> None:
    for opt, force in ((socket.SO_RCVBUF, getattr(socket, "SO_RCVBUFFORCE", 33)),
                       (socket.SO_SNDBUF, getattr(socket, "SO_SNDBUFFORCE", 32))):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)  # needs CAP_NET_ADMIN
        except OSError:
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)  # capped by [rw]mem_max
            except OSError:
                pass


def _all_finite(x: np.ndarray, fast: bool) -> bool:
    """No NaN or infinity in ``x`` (1-D, contiguous): checked before anything of it is sent."""
    if fast and x.dtype in _fast.BITS:
        return _fast.all_finite(x)
    lo, hi = x.min(), x.max()  # NaN propagates; cheaper than isfinite(x).all()
    return bool(np.isfinite(lo) and np.isfinite(hi))


def _never() -> bool:
    return False


class AggClient:
    """A worker of one aggd job.

    ``server``: the aggregator's ``(host, port)``. ``job``, ``rank``, ``world``: the job id, this
    worker's rank and the number of members (as registered with the aggregator). ``group``: the
    job's result ``(multicast group, port)``, or None when results come back by unicast to the
    worker's address. ``bind``: the worker's member address (port 0 picks one; see ``address``).
    ``elements``: values per packet, as configured on the aggregator. ``slots``: the job's slot
    pool; ``window``: chunks in flight (at most ``slots``; None: ``slots``, at most
    ``flow.MAX_INFLIGHT_BYTES`` of packets). ``retransmit_timeout`` and
    ``give_up_after`` in seconds; ``max_retransmit_interval``: the longest a chunk waits between
    retransmissions under ``quorum`` (the data plane checks a quorum round's deadline when a packet
    reaches its slot, so the members' retransmissions are its clock: keep this at or below the
    job's quorum timeout). ``strategy``: the strategy the job starts with (``"ssp:2"``, a
    ``StrategyInfo``; ``JobInfo.strategy`` from ``join``), assumed until the first result says;
    None: ``sync``. ``gso``: send with UDP GSO; must be False when the aggregator runs XDP in
    generic (skb) mode.
    """

    def __init__(self, server: tuple[str, int], job: int, rank: int, world: int, *,
                 group: tuple[str, int] | None = None, bind: tuple[str, int] = ("0.0.0.0", 0),
                 elements: int = 256, slots: int = 1024, window: int | None = None,
                 retransmit_timeout: float = 0.05, give_up_after: float = 5.0,
                 max_retransmit_interval: float = 0.2,
                 strategy: str | StrategyInfo | StrategyKind | None = None, gso: bool = True):
        if not 0 <= int(job) < MAX_JOBS:
            raise ValueError(f"job must be in 0..{MAX_JOBS - 1}, got {job}")
        if not 1 <= int(world) <= MAX_MEMBERS:
            raise ValueError(f"world must be in 1..{MAX_MEMBERS}, got {world}")
        if not 0 <= int(rank) < int(world):
            raise ValueError(f"rank must be in 0..{int(world) - 1}, got {rank}")
        if not 1 <= int(elements) <= MAX_ELEMENTS:
            raise ValueError(f"elements must be in 1..{MAX_ELEMENTS}, got {elements}")
        if int(slots) < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if window is not None and int(window) < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if not retransmit_timeout > 0 or not give_up_after > 0 or not max_retransmit_interval > 0:
            raise ValueError("retransmit_timeout, give_up_after and max_retransmit_interval must "
                             "be positive")
        if strategy is None:
            info = StrategyInfo()
        elif isinstance(strategy, StrategyInfo):
            info = strategy
        elif isinstance(strategy, str):
            info = StrategyInfo.parse(strategy)
        else:
            info = StrategyInfo(StrategyKind(strategy))
        self._server = (socket.gethostbyname(server[0]), int(server[1]))
        self._job, self._rank, self._world = int(job), int(rank), int(world)
        self._elements = int(elements)
        self._slots = int(slots)
        self._dtype = packet_dtype(self._elements)
        self._rec = self._dtype.itemsize
        # a window the caller does not set is bounded by bytes in flight too (flow.default_window)
        self._window = (min(int(window), self._slots) if window is not None
                        else default_window(self._slots, self._rec))
        self._rto = float(retransmit_timeout)
        self._rto_cap = max(RTO_CAP, self._rto)
        self._quorum_cap = min(float(max_retransmit_interval), self._rto_cap)
        self._scan_every = max(min(self._rto, self._quorum_cap) / 4, 0.001)
        # answer times raise the timeout above retransmit_timeout when the path (or the slowest
        # member) is slower; losses shrink the chunks in flight below the window
        self._rtt = RtoEstimator(self._rto, self._rto, self._rto_cap)
        self._cwnd = CongestionWindow(self._window)
        self._ack_out = np.zeros(2, np.float64)
        self._give_up = float(give_up_after)
        self._gso = bool(gso)
        self._closed = False
        self._last_send_error: OSError | None = None
        self.stats = {"packets_sent": 0, "retransmits": 0, "results": 0, "ignored": 0,
                      "send_errors": 0, "gso_fallbacks": 0, "steps": 0, "abandoned": 0,
                      "batch_waits": 0}

        # Rounds and their sends; the strategy in force and the round whose result said so.
        self._next_round = 0
        self._round_chunks = 0     # chunks of the newest round started (what a whole round is; 0: none yet)
        self._seen_quorum: dict[int, set[int]] = {}   # quorum rounds seen on the group: chunks
        # Per chunk index, the newest round it took part in (-1: none): each packet's ``skip``
        # tells the aggregator which round of its chunk it follows (docs/protocol.md, rule 3).
        self._chunk_last = np.full(0, -1, np.int64)
        # Whether every round so far reduced a tensor of one size: a quorum straggler may then
        # skip to a later round, which (as far as it can tell) holds the same tensor.
        self._first_size: int | None = None
        self._uniform = True
        self._own_next = 0   # the round after our newest own one (no quorum catch-up)
        self._rounds: list[_Round] = []
        self._sends: list[_Send] = []
        self._strategy = info
        self._strategy_round = -1
        self._last_progress = time.monotonic()
        self._away_since: float | None = None  # time outside calls does not count (give-up clock)
        self._next_scan = 0.0

        self._gso_segments = max(1, min(GSO_MAX_SEGMENTS, UDP_MAX_PAYLOAD // self._rec))
        self._run_sender = msend.RunSender(ADMIT_MAX, self._rec, self._server) if msend.AVAILABLE else None
        self._gso_cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("H", self._rec))]
        self._ring_pool: list[_Ring] = []

        self._last_batch = 0  # messages the last receive took
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._group_sock: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        try:
            self._sock.bind((bind[0], int(bind[1])))
            _grow_buffers(self._sock)
            host, port = self._sock.getsockname()[:2]
            if host == "0.0.0.0":
                host = _local_ip_towards(self._server)
            self._address = (host, port)
            self._selector.register(self._sock, selectors.EVENT_READ)
            if group is not None:
                self._group_sock = self._join(group)
                self._selector.register(self._group_sock, selectors.EVENT_READ)
        except BaseException:
            self.close()
            raise
        self._group = None if group is None else (group[0], int(group[1]))

        self._fast = _fast.warm_up()  # numba kernels, compiled before anything is sent
        stage = max(16, min(STAGE, STAGE_BYTES // self._rec))
        self._stage = np.zeros(stage, self._dtype)  # receive staging
        # written once now: the client's fixed buffers are resident from the start, so an
        # allreduce's memory is what it adds (its ring of packets), whatever it is the first of
        self._stage.view(np.uint8).fill(0)
        self._stage_u8 = self._stage.view(np.uint8).reshape(stage, self._rec)
        self._stage_i32 = self._stage_u8.view(np.int32)
        self._words = self._stage_u8.view(np.uint32)
        self._sizes = np.zeros(stage, np.int64)
        self._receiver = MultiReceiver(self._stage, self._rec, self._sizes)
        self._acks = np.zeros(stage, np.int64)
        self._meta = np.zeros(3, np.int64)
        # Messages are classified by the first 8 header bytes (magic, version, type; job) compared
        # as native uint32 words of the staging buffer, whatever the host's byte order.
        proto = np.zeros(1, HEADER_DTYPE)
        proto["magic"], proto["version"], proto["job"] = MAGIC, VERSION, self._job
        proto["type"] = _RESULT
        self._w_result = proto.view(np.uint32)[0]
        proto["type"] = _NACK
        self._w_nack = proto.view(np.uint32)[0]
        self._job_mask = np.frombuffer(b"\xff\xff\x00\x00", np.uint32)[0]  # job, not rank
        self._w_job = proto.view(np.uint32)[1] & self._job_mask

    # -- set-up -------------------------------------------------------------------------------
    def _join(self, group: tuple[str, int]) -> socket.socket:
        ip = ipaddress.IPv4Address(group[0])
        if not ip.is_multicast:
            raise ValueError(f"group {group[0]} is not an IPv4 multicast address")
        local = _local_ip_towards(self._server)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("0.0.0.0", int(group[1])))
            mreq = struct.pack("4s4s", socket.inet_aton(str(ip)), socket.inet_aton(local))
            s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
            s.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
            _grow_buffers(s)
        except BaseException:
            s.close()
            raise
        return s

    # -- public -------------------------------------------------------------------------------
    @property
    def round(self) -> int:
        """The round the next new allreduce gets: 0 at first, +1 per round started (a ``wbsp``
        step starts none), and at least the newest ``quorum`` result seen (catching up)."""
        return self._next_round

    @property
    def strategy(self) -> StrategyInfo:
        """The strategy in force: the newest result's (or the constructor's, before any)."""
        return self._strategy

    @property
    def outstanding(self) -> int:
        """Rounds sent whose result is not complete yet."""
        return sum(1 for r in self._rounds if not r.complete)

    @property
    def address(self) -> tuple[str, int]:
        """This worker's member address (what the aggregator must have registered for its rank)."""
        return self._address

    @property
    def server(self) -> tuple[str, int]:
        return self._server

    @property
    def retransmit_timeout(self) -> float:
        """The retransmission timeout now (before per-chunk backoff): estimated from answer times,
        never below the constructor's ``retransmit_timeout`` (``flow.RtoEstimator``)."""
        return self._rtt.rto

    @property
    def window(self) -> int:
        """Chunks allowed in flight now: at most ``window`` (or ``slots``), halved on losses
        (``flow.CongestionWindow``)."""
        return self._cwnd.size

    @property
    def gso(self) -> bool:
        """Whether sends use UDP GSO (False when disabled or after the kernel refused it)."""
        return self._gso

    def close(self) -> None:
        if self._closed:
            return
        # Deliver what was handed to us: contributions still unanswered (a straggler's carried
        # chunk, a late wbsp step) are retransmitted until answered or give_up_after passes.
        try:
            self._progress(lambda: all(s.finished for s in self._sends), self._give_up)
        except Exception:  # noqa: BLE001 - closing must not raise for a round that already failed
            pass
        self._closed = True
        self._fail_all(AggdError("the client was closed"))
        try:
            self._selector.close()
        finally:
            self._sock.close()
            if self._group_sock is not None:
                self._group_sock.close()

    def __enter__(self) -> "AggClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AggClient(server={self._server}, job={self._job}, rank={self._rank}, "
                f"world={self._world}, round={self._next_round}, strategy={self._strategy})")

    def allreduce(self, array, op: str = "sum", *, out: np.ndarray | None = None) -> np.ndarray:
        """Sum (``op="sum"``) or average (``op="mean"``) ``array`` over the job's members:
        ``allreduce_async(array, op, out=out).wait()``.

        Returns a new array of the same shape and dtype (float16, float32 or float64), or ``out``
        filled with the result (reusing a buffer spares the page faults of a new array). Every member
        must call ``allreduce`` with the same shape, in the same order. A mean divides each chunk by
        the number of contributions its result holds. Each element is within
        ``quant.error_bound(world, exponent, n_contrib)`` of the exact sum of those contributions
        (divided by the count for a mean), plus the rounding to the output dtype.
        """
        return self.allreduce_async(array, op, out=out).wait()

    def allreduce_async(self, array, op: str = "sum", *, block: bool = True,
                        out: np.ndarray | None = None) -> "AllreduceHandle":
        """Start reducing ``array`` and return its handle (``wait()`` gives the result).

        The array is read until the handle is done: do not change it before. When the strategy in
        force admits no new round (``must_wait()``), this call makes progress on the earlier rounds
        until it does; with ``block=False`` it raises ``WouldBlock`` instead. Under ``wbsp`` a call
        made while a round of the same shape, dtype and ``op`` is outstanding is sent as that
        round's next step and its handle resolves with that round's result (``out`` is then
        ignored). ``out``: a C-contiguous, writable array of the same shape and dtype, not sharing
        memory with ``array``, that receives the result instead of a new one.
        """
        self._check_open()
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        a = np.asarray(array)
        if a.dtype not in quant.FLOAT_DTYPES:
            raise TypeError(f"aggd reduces float16, float32 and float64 arrays, got {a.dtype}")
        if out is not None:
            _check_out(out, a)
        mean = op == "mean"
        if a.size == 0:  # nothing to send: the round is used up and answered at once
            rnd = _Round(self._next_round, a.shape, a.dtype, 0, self._elements, mean, out)
            self._next_round += 1
            self._own_next = self._next_round
            return AllreduceHandle(self, rnd, None)
        x = np.ascontiguousarray(a).reshape(-1)
        if not _all_finite(x, self._fast):
            raise ValueError("cannot allreduce an array holding NaN or infinity")
        if -(-x.size // self._elements) > 0xFFFFFFFF:
            raise ValueError(f"tensor too large: more than 2**32 chunks of {self._elements}")
        spec = (a.shape, a.dtype, mean)

        self._poll()
        into = self._admission(spec)
        if into is None:
            if not block:
                raise WouldBlock(f"strategy {self._strategy} admits no round beyond the "
                                 f"{self.outstanding} outstanding (rank {self._rank}, next round "
                                 f"{self._next_round})")
            self._progress(lambda: self._admission(spec) is not None)
            into = self._admission(spec)
        if into is True:
            if not any(not r.complete for r in self._rounds):
                self._last_progress = time.monotonic()  # nothing was outstanding: the clock starts
            self._round_chunks = -(-x.size // self._elements) or 1
            if self._first_size is None:
                self._first_size = x.size
            self._uniform = self._uniform and x.size == self._first_size
            if not self._uniform:
                # a round we moved to on seeing a quorum's results may hold another tensor
                # than this one: keep our own order (docs/protocol.md, "Tensors of different sizes")
                self._next_round = self._own_next
                self._seen_quorum.clear()
            self._catch_up()  # a quorum round seen whole, now that we know what whole is
            rnd = _Round(self._next_round, a.shape, a.dtype, x.size, self._elements, mean, out)
            rnd.skips = self._skips_for(rnd)
            self._next_round += 1
            self._own_next = self._next_round
            self._rounds.append(rnd)
        else:
            rnd = into
            self.stats["steps"] += 1
        send = _Send(self, rnd, x, rnd.steps, self._strategy.kind)
        rnd.steps += 1
        rnd.sends.append(send)
        self._sends.append(send)
        self._poll()  # the first window leaves now
        return AllreduceHandle(self, rnd, send)

    def must_wait(self) -> bool:
        """Whether an ``allreduce_async`` now would have to wait for an earlier round first (a
        ``wbsp`` step of the outstanding round does not wait). Makes progress without blocking."""
        self._check_open()
        self._poll()
        return self._admission(None) is None

    # -- admission ----------------------------------------------------------------------------
    def _admission(self, spec) -> "bool | _Round | None":
        """True: a new round may start; a round: a wbsp call becomes its next step; None: wait."""
        waiting = [r for r in self._rounds if not r.complete]
        info = self._strategy
        if len(waiting) < info.max_outstanding:
            return True
        if info.kind == StrategyKind.WBSP and len(waiting) == 1:
            r = waiting[0]
            if r.steps < WBSP_MAX_STEPS and (spec is None or spec == (r.shape, r.dtype, r.mean)):
                return r
        return None

    # -- the progress loop --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise AggdError("the client is closed")

    def _poll(self) -> None:
        self._progress(_never, 0.0)

    def _progress(self, until: Callable[[], bool], timeout: float | None = None) -> bool:
        """Send, retransmit and receive until ``until()`` holds (True) or ``timeout`` seconds pass
        (False; None: no limit; 0: one pass that does not wait). A fatal error (NACK, no answer)
        fails every round in flight and is raised."""
        self._check_open()
        now = time.monotonic()
        if self._away_since is not None:
            self._last_progress += now - self._away_since
            self._away_since = None
        deadline = None if timeout is None else now + timeout
        try:
            self._receive(0.0)
            while True:
                if until():
                    return True
                more = self._admit()
                now = time.monotonic()
                if now >= self._next_scan:
                    # Answers already in our sockets come first: a worker that was off the CPU
                    # finds a backlog larger than one batch, and a scan before reading it would
                    # resend chunks whose answers are here (duplicates the aggregator drops).
                    while self._receive(0.0) >= len(self._stage):
                        pass
                    if until():
                        return True
                    now = time.monotonic()
                    self._retransmit(now)
                    self._next_scan = now + self._scan_every
                if until():
                    return True
                self._check_give_up(now)
                if deadline is not None and now >= deadline:
                    return False
                wait = 0.0
                if not more:
                    wait = min(self._next_scan, self._last_progress + self._give_up) - now
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    if self._last_batch < SMALL_BATCH and wait > BATCH_WAIT and \
                            sum(s.inflight for s in self._sends) >= 4 * SMALL_BATCH:
                        time.sleep(BATCH_WAIT)
                        wait -= BATCH_WAIT
                        self.stats["batch_waits"] += 1
                self._last_batch = self._receive(max(0.0, wait))
        except (AggdError, OSError) as e:
            self._fail_all(e)
            raise
        finally:
            self._away_since = time.monotonic()

    def _check_give_up(self, now: float) -> None:
        waited = now - self._last_progress
        if waited < self._give_up:
            return
        waiting = [r for r in self._rounds if not r.complete]
        if not waiting:
            return
        answered = sum(r.n_have for r in waiting)
        total = sum(r.n_chunks for r in waiting)
        nums = ", ".join(str(r.number) for r in waiting)
        detail = (f"rank {self._rank}, round{'s' if len(waiting) > 1 else ''} {nums}: {answered} "
                  f"of {total} chunks answered, {self.stats['retransmits']} retransmissions, "
                  f"strategy {self._strategy}")
        if self._last_send_error is not None:
            detail += f"; last send error: {self._last_send_error}"
        raise NoAnswerError(self._server, self._job, waited, detail)

    def _fail_all(self, exc: BaseException) -> None:
        for rnd in self._rounds:
            if not rnd.complete and rnd.error is None:
                rnd.error = exc
        for s in self._sends:
            s.drop()
        self._sends.clear()
        for rnd in self._rounds:
            rnd.sends.clear()
        self._rounds.clear()

    def _fail_round(self, rnd: "_Round", exc: AggdError) -> None:
        log.warning("round %d failed: %s", rnd.number, exc)
        rnd.error = exc
        for s in rnd.sends:
            s.drop()
            self._sends.remove(s)
        rnd.sends.clear()
        if rnd in self._rounds:
            self._rounds.remove(rnd)

    # -- sending ------------------------------------------------------------------------------
    def _admit(self) -> bool:
        """Let every send admit what the window and the order rules allow; whether more could be
        admitted right away."""
        self._tidy()
        budget = self._cwnd.size - sum(s.inflight for s in self._sends if not s.rnd.complete)
        more = False
        for i, s in enumerate(self._sends):
            if budget <= 0:
                break
            if s.next >= s.n:
                continue
            limit = self._limit(i, s)
            if limit <= s.next:
                continue
            k, again = s.admit(limit, budget)
            budget -= k
            more = more or again
        return more and budget > 0

    def _limit(self, i: int, s: "_Send") -> int:
        """First chunk of send ``i`` that must wait for an earlier send: one whose slot still has an
        unsent chunk of an earlier round (keys grow per slot), or, for an earlier step of the same
        round, a chunk that step has not sent yet."""
        limit, S = s.n, self._slots
        for p in self._sends[:i]:
            left = p.n - p.next
            if left <= 0:
                continue
            if p.rnd is s.rnd:
                limit = min(limit, p.next)
                continue
            if left >= S:  # every slot still has a chunk of p to send
                return s.next
            d = (s.next - p.next) % S  # p's unsent chunks cover slots p.next % S .. + left - 1
            if d < left:
                return s.next
            limit = min(limit, s.next + S - d)
        return limit

    def _tidy(self) -> None:
        if any(s.finished for s in self._sends):
            for s in [s for s in self._sends if s.finished]:
                s.drop()
                self._sends.remove(s)
                s.rnd.sends.remove(s)
        if any(r.complete and not r.sends for r in self._rounds):
            self._rounds = [r for r in self._rounds if not (r.complete and not r.sends)]

    def _retransmit(self, now: float) -> None:
        cap = self._quorum_cap if self._strategy.kind == StrategyKind.QUORUM else self._rto_cap
        for s in list(self._sends):
            if s.rnd.complete and now - s.last_ack >= self._give_up:
                # answers to contributions sent after the round's result came (a wbsp step, a
                # straggler's carried chunk) that never arrived: stop asking
                self.stats["abandoned"] += s.inflight + s.n - s.next
                s.drop()
                self._sends.remove(s)
                s.rnd.sends.remove(s)
            else:
                s.retransmit_due(now, cap)

    def _take_ring(self, size: int) -> "_Ring":
        fits = [r for r in self._ring_pool if r.size >= size]
        if fits:
            ring = min(fits, key=lambda r: r.size)
            self._ring_pool.remove(ring)
            return ring
        return _Ring(self._dtype, size)

    def _give_ring(self, ring: "_Ring") -> None:
        self._ring_pool.append(ring)
        if len(self._ring_pool) > RING_POOL:
            self._ring_pool.remove(min(self._ring_pool, key=lambda r: r.size))

    def _send(self, buf: memoryview, npk: int) -> None:
        """Send ``npk`` back-to-back packets held in ``buf``."""
        rec, i = self._rec, 0
        while i < npk:
            if self._gso and npk - i > 1:
                j = min(npk, i + self._gso_segments)
                try:
                    self._sock.sendmsg([buf[i * rec:j * rec]], self._gso_cmsg, 0, self._server)
                except OSError as e:
                    if e.errno in _GSO_REFUSED:
                        self._gso = False
                        self.stats["gso_fallbacks"] += 1
                        log.warning("UDP GSO refused by the kernel (%s); sending packets one by one",
                                    e)
                        continue  # the same packets again, plainly
                    self._send_failed(e)
                self.stats["packets_sent"] += j - i
                i = j
            elif self._run_sender is not None and npk - i > 1:
                # no GSO (XDP in generic mode): one sendmmsg for the rest of the run
                self._run_sender.send(self._sock, buf[i * rec:npk * rec], npk - i, self._send_failed)
                self.stats["packets_sent"] += npk - i
                i = npk
            else:
                try:
                    self._sock.sendto(buf[i * rec:(i + 1) * rec], self._server)
                except OSError as e:
                    self._send_failed(e)
                self.stats["packets_sent"] += 1
                i += 1

    def _send_failed(self, e: OSError) -> None:
        if e.errno not in _TRANSIENT:
            raise e
        self._last_send_error = e  # the packets are lost; loss recovery sends them again
        self.stats["send_errors"] += 1

    # -- receiving ----------------------------------------------------------------------------
    def _receive(self, timeout: float) -> int:
        """Receive and hand on one batch (at most the staging array); how many messages."""
        m = 0
        if self._selector.select(timeout):
            m = self._drain(self._sock, m)
            if self._group_sock is not None:
                m = self._drain(self._group_sock, m)
        if m:
            self._process(m)
        return m

    def _drain(self, sock: socket.socket, m: int) -> int:
        """Receive into the staging array from position ``m`` until empty or full (one
        recvmmsg a batch: ``mrecv``); new ``m``."""
        return self._receiver.drain(sock, m)

    def _process(self, m: int) -> None:
        """Hand ``m`` received messages to the rounds in flight. The numba kernel takes one round
        at a time; anything else in the batch (NACKs, malformed results, results of other rounds:
        stragglers' answers, re-sends of finished rounds) goes through the numpy path, which
        repeats harmlessly what the kernel did."""
        new = acked = 0
        handled = False
        # Under quorum and wbsp a release seen on the group need not hold our packet (released
        # without us, or a later wbsp step): those rounds take the numpy path, which checks.
        checked = self._strategy.kind in (StrategyKind.QUORUM, StrategyKind.WBSP)
        if self._fast and self._rounds and not checked and all(r.fast for r in self._rounds):
            handled, matched, jobs = True, 0, 0
            for rnd in list(self._rounds):
                status, nd, na, jobs = _fast.scatter(
                    self._stage_u8, self._stage_i32, self._sizes, m, self._job, rnd.r32,
                    rnd.n_chunks, self._elements, rnd.last_count, rnd.have, rnd.n_contrib, rnd.out,
                    rnd.mean, self._acks, self._meta)
                if status != _fast.OK:
                    handled = False
                    break
                matched += na
                if na:
                    acked += self._ack(rnd, self._acks[:na])
                if nd:
                    new += nd
                    rnd.n_have += nd
                    meta = self._meta
                    self._learn(rnd, rnd.number, int(meta[0]), int(meta[1]), int(meta[2]))
            handled = handled and matched == jobs
        if not handled:
            n2, a2 = self._process_numpy(m)
            new += n2
            acked += a2
        self.stats["results"] += new
        self.stats["ignored"] += m - new
        if new or acked:
            self._last_progress = time.monotonic()

    def _process_numpy(self, m: int) -> tuple[int, int]:
        w = self._words[:m]
        ours = (self._sizes[:m] >= HEADER_SIZE) & ((w[:, 1] & self._job_mask) == self._w_job)
        nack = ours & (w[:, 0] == self._w_nack)
        if nack.any():
            self._nacks(self._stage["hdr"][:m][nack])
        idx = np.flatnonzero(ours & (w[:, 0] == self._w_result))
        if idx.size == 0:
            return 0, 0
        h = self._stage["hdr"][idx]
        rounds = h["round"].astype(np.int64)
        chunks = h["chunk"].astype(np.int64)
        kind = h["strategy"]
        # Only a quorum round may answer an earlier round's chunk: it was released without some
        # members, who catch up. An async round is released only once every member has
        # contributed, so a member that skipped one would hold that round open for good.
        later_ok = kind == _QUORUM
        new = acked = 0
        # A later round answers one of our chunks only when it was sent to us alone (flag REREAD):
        # the aggregator's reply to our late contribution, which it has carried. A later round
        # merely seen on the group proves nothing about our packet, which may still be on its way.
        later_ok = later_ok & ((h["flags"] & _REREAD) != 0)
        for rnd in list(self._rounds):
            sel = (rounds == rnd.r32) | (later_ok & (rounds > rnd.r32))
            sel &= chunks < rnd.n_chunks
            if sel.any():
                n, a = self._apply(rnd, idx[sel], h[sel], rounds[sel], chunks[sel])
                new += n
                acked += a
        caught_up = kind == _QUORUM
        if caught_up.any():
            # A straggler catches up. A result sent to us (REREAD) may have answered a call of
            # ours: the next round follows it. One merely seen on the group makes us join that
            # round, not a round beyond it: a member ahead of the quorum would open a round in a
            # slot that still expects the quorum's chunks of the current round (keys grow per
            # slot) and stall them.
            self._note_rounds(rounds[caught_up], chunks[caught_up])
            to_us = caught_up & ((h["flags"] & _REREAD) != 0)
            seen = caught_up & ~to_us
            if not self._uniform:
                # Rounds are a sequence of tensors: one of the quorum's later rounds holds another
                # tensor than our next call. We keep our order; our late rounds are carried and
                # answered at once, so we catch up by running through them.
                to_us[:] = seen[:] = False
            if to_us.any():
                self._next_round = max(self._next_round, int(rounds[to_us].max()) + 1)
            if seen.any():
                self._catch_up(rounds[seen], chunks[seen])
        return new, acked

    def _skips_for(self, rnd: "_Round") -> np.ndarray | None:
        """The ``skip`` of each chunk of a new round (None: all 0), and the chunks' newest round."""
        n, last = rnd.n_chunks, self._chunk_last
        if n > last.size:
            last = self._chunk_last = np.concatenate([last, np.full(n - last.size, -1, np.int64)])
        skips = np.minimum(rnd.number - last[:n] - 1, SKIP_MAX)
        last[:n] = rnd.number
        return skips.astype(np.uint16) if skips.any() else None

    def _note_rounds(self, rounds: np.ndarray, chunks: np.ndarray) -> None:
        """Results of rounds we did not send (a quorum's, seen by a straggler) move their chunks'
        newest round on, so our next round of each says the right ``skip``."""
        last = self._chunk_last
        ok = chunks < last.size
        if ok.any():
            np.maximum.at(last, chunks[ok], rounds[ok])

    def _catch_up(self, rounds: np.ndarray | None = None, chunks: np.ndarray | None = None) -> None:
        """Quorum results seen on the group (``rounds``, ``chunks``; none: re-evaluate): join the
        newest round seen, or the round after it once every chunk of it (as many as our newest
        round has) has been released."""
        if not self._uniform:
            return
        seen = self._seen_quorum
        if rounds is not None and self._first_size is not None:
            # (before our first call we know nothing of the job's tensors: we start at round 0)
            for r, c in zip(rounds.tolist(), chunks.tolist()):
                if r >= self._next_round - 1:
                    seen.setdefault(r, set()).add(c)
        if not seen:
            return
        target = max(seen)
        whole = [r for r, cs in seen.items() if self._round_chunks and len(cs) >= self._round_chunks]
        if whole:
            target = max(target, max(whole) + 1)
        self._next_round = max(self._next_round, target)
        for r in [r for r in seen if r < self._next_round - 1]:
            del seen[r]

    def _apply(self, rnd: "_Round", idx, h, rounds, chunks) -> tuple[int, int]:
        """Results (staging positions ``idx``, headers ``h``) for chunks of ``rnd``: its own round's
        or a later round's. Returns (new results, sends' chunks answered)."""
        own = rounds == rnd.r32
        # What stops a packet's retransmission is proof that the aggregator holds it: an answer
        # sent to us alone (flag REREAD: a re-send, or the reply to a late contribution it
        # carried), or our own round's result listing our rank, which proves our first step
        # only (a later wbsp step may have arrived after the release; its re-send will say).
        to_us = (h["flags"] & _REREAD) != 0
        # (under the other strategies a round is released only once every member is in it)
        partial_release = (h["strategy"] == _QUORUM) | (h["strategy"] == int(StrategyKind.WBSP))
        lists_us = own & (~partial_release | ((h["contributors"] >> np.uint64(self._rank)) & np.uint64(1) != 0))
        acked = 0
        if to_us.any() or lists_us.any():
            acked = self._ack(rnd, chunks[to_us | lists_us], first_only=chunks[lists_us & ~to_us])
        new = rnd.have[chunks] == 0
        if not new.any():
            return 0, acked
        idx, h, rounds, chunks, own = idx[new], h[new], rounds[new], chunks[new], own[new]
        if idx.size > 1:  # one result per chunk: the round's own, else the newest; chunks sorted
            order = np.lexsort((-np.where(own, 1 << 40, rounds), chunks))
            chunks = chunks[order]
            first = np.empty(chunks.size, bool)
            first[0] = True
            np.not_equal(chunks[1:], chunks[:-1], out=first[1:])
            sel = order[first]
            idx, h, rounds, chunks = idx[sel], h[sel], rounds[sel], chunks[first]
        flags = h["flags"]
        if (flags & _OVERFLOW).any():
            j = int(np.argmax((flags & _OVERFLOW) != 0))
            self._fail_round(rnd, AggregationOverflowError(self._server, self._job,
                                                           int(rounds[j]), int(chunks[j])))
            return 0, acked
        cnt = h["count"].astype(np.int64)
        expect = np.where(chunks == rnd.n_chunks - 1, rnd.last_count, self._elements)
        bad = (cnt != expect) | (self._sizes[idx] < HEADER_SIZE + 4 * cnt)
        if bad.any():
            j = int(np.argmax(bad))
            if self._sizes[idx][j] >= HEADER_SIZE + 4 * cnt[j]:  # a whole packet: the members differ
                why = ("the members reduced tensors of different sizes in that round (every member "
                       "must make the same sequence of calls; under quorum a straggler that caught "
                       "up to a later round reduces a different tensor than the quorum did there)")
            else:
                why = f"is the job's packet size {self._elements} elements?"
            self._fail_round(rnd, ProtocolError(
                f"aggregator {self._server[0]}:{self._server[1]} sent a result for job {self._job}, "
                f"round {rounds[j]}, chunk {chunks[j]} with count {cnt[j]} in {self._sizes[idx][j]} "
                f"bytes; expected {expect[j]} values ({why})"))
            return 0, acked
        ncon = h["n_contrib"]
        divisor = None
        if rnd.mean:
            if (ncon == 0).any():
                self._fail_round(rnd, ProtocolError(
                    f"aggregator {self._server[0]}:{self._server[1]} sent a result without "
                    f"contributions (n_contrib 0) for job {self._job}, round {rnd.number}"))
                return 0, acked
            divisor = ncon.astype(np.float64)
        vals = quant.dequantise(self._stage["payload"][idx], h["exponent"], divisor=divisor)
        E = self._elements
        with np.errstate(over="ignore", invalid="ignore"):  # float16 may overflow to inf
            if chunks[-1] < rnd.n_full:
                rnd.out_full[chunks] = vals
            else:
                rnd.out_full[chunks[:-1]] = vals[:-1]
                rnd.out[rnd.n_full * E:] = vals[-1, :rnd.last_count]
        rnd.have[chunks] = 1
        rnd.n_contrib[chunks] = ncon
        rnd.n_have += int(chunks.size)
        j = int(np.argmax(rounds))
        self._learn(rnd, int(rounds[j]), int(h["strategy"][j]), int(h["param"][j]),
                    int(h["strategy_version"][j]))
        return int(chunks.size), acked

    def _ack(self, rnd: "_Round", chunks: np.ndarray, first_only: np.ndarray | None = None) -> int:
        """``chunks`` are answered for every send of the round; those also in ``first_only`` only
        for its first step."""
        now = time.monotonic()
        n = 0
        for s in rnd.sends:
            if first_only is not None and first_only.size and s.step > 0:
                n += s.ack(np.setdiff1d(chunks, first_only), now)
            else:
                n += s.ack(chunks, now)
        return n

    def _learn(self, rnd: "_Round", number: int, kind: int, param: int, version: int) -> None:
        """A result of round ``number`` (governed by kind/param/version) answered chunks of
        ``rnd``; the newest result seen sets the strategy in force."""
        info = StrategyInfo(_kind(kind), param, version)
        if rnd.info is None or number >= rnd.answered:
            rnd.answered = max(rnd.answered, number)
            rnd.info = info
        if number >= self._strategy_round:
            if info != self._strategy:
                log.debug("strategy in force: %s (table version %d, round %d)", info, version,
                          number)
            self._strategy, self._strategy_round = info, number
        if rnd.complete:
            now = time.monotonic()
            for s in rnd.sends:  # their remaining answers are waited for give_up_after from now
                s.last_ack = now
                if s.step > 0:
                    # A later wbsp step is acknowledged only by an answer sent to us; ask at once,
                    # while the round's bank still exists (it re-sends, or carries a step that
                    # came too late), rather than after a timeout, when the bank may be reused
                    # and the retransmission can only be dropped as stale.
                    s.hurry()

    def _nacks(self, h: np.ndarray) -> None:
        for rec in h:
            code = int(rec["code"])
            if code == NackCode.UNKNOWN_JOB:
                raise UnknownJobError(self._server, self._job, self._rank, self._address)
            if code == NackCode.NOT_MEMBER:
                raise NotMemberError(self._server, self._job, self._rank, self._address)
            r32, chunk = int(rec["round"]), int(rec["chunk"])
            rnd = next((r for r in self._rounds if r.r32 == r32), None)
            where = f"job {self._job}, round {r32}, chunk {chunk}"
            srv = f"aggregator {self._server[0]}:{self._server[1]}"
            if code == NackCode.BAD_CHUNK:
                if rnd is not None:
                    self._fail_round(rnd, ProtocolError(
                        f"{srv} refused {where}: chunk beyond the job's max_chunks (this tensor "
                        f"has {rnd.n_chunks} chunks of {self._elements} values)"))
                continue
            if code == NackCode.STALE:
                lockstep = self._strategy.kind in (StrategyKind.SYNC, StrategyKind.SSP,
                                                   StrategyKind.WBSP)
                if rnd is not None and lockstep and chunk < rnd.n_chunks and not rnd.have[chunk]:
                    self._fail_round(rnd, ProtocolError(
                        f"{srv} refused {where} as stale: the job is past this round (do all "
                        f"members call allreduce in lockstep?)"))
                continue  # a late answer to an old retransmission, or a straggler's
            raise ProtocolError(f"{srv} refused {where} with unknown NACK code {code}")


class AllreduceHandle:
    """The result of one ``allreduce_async`` call, to come.

    ``wait(timeout=None)`` returns it (the same array for every handle of a round: the steps of a
    ``wbsp`` round share it); ``done()`` says whether it is there, making progress without
    blocking. Once done: ``round`` is the newest round whose result answered it (later than the
    round asked for when a ``quorum``/``async`` straggler got a newer result), ``n_contrib`` the
    contributions each chunk's result holds, ``strategy`` the strategy that governed that round.
    ``step`` is the wbsp step this call was sent as (0 otherwise).
    """

    __slots__ = ("_client", "_round", "_send", "step")

    def __init__(self, client: AggClient, rnd: "_Round", send: "_Send | None"):
        self._client, self._round, self._send = client, rnd, send
        self.step = 0 if send is None else send.step

    @property
    def round(self) -> int:
        return self._round.answered

    @property
    def n_contrib(self) -> np.ndarray:
        return self._round.n_contrib

    @property
    def strategy(self) -> StrategyInfo | None:
        return self._round.info

    def _ready(self) -> bool:
        r = self._round
        if r.error is not None:
            return True
        if not r.complete:
            return False
        s = self._send  # its tensor must have left too (a straggler's answers may come first)
        return s is None or s.dropped or s.next >= s.n

    def done(self) -> bool:
        if not self._ready():
            self._client._poll()
        return self._ready()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """The result; raises the round's error, or TimeoutError after ``timeout`` seconds."""
        if not self._ready() and not self._client._progress(self._ready, timeout):
            raise TimeoutError(f"round {self._round.number} of job {self._client._job} not "
                               f"answered within {timeout} s")
        if self._round.error is not None:
            raise self._round.error
        return self._round.result

    def __repr__(self) -> str:
        state = "failed" if self._round.error is not None else "done" if self._ready() else "pending"
        return f"<AllreduceHandle round {self._round.number} step {self.step} {state}>"


def _check_out(out, a: np.ndarray) -> None:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, not {type(out).__name__}")
    if out.shape != a.shape or out.dtype != a.dtype:
        raise ValueError(f"out must have the input's shape {a.shape} and dtype {a.dtype}, not "
                         f"{out.shape} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writable")
    if np.may_share_memory(out, a):
        # a result may arrive (a straggler's quorum answer) before the input's chunk was read
        raise ValueError("out must not share memory with the input")


class _Round:
    """One round's result: which chunks are answered, what each holds, the output array; ``sends``
    are its steps still in progress."""

    def __init__(self, number: int, shape, dtype, size: int, E: int, mean: bool,
                 out: np.ndarray | None = None):
        self.number = number
        self.r32 = number & 0xFFFFFFFF
        self.shape, self.dtype, self.mean = shape, np.dtype(dtype), mean
        self.result = np.empty(shape, dtype) if out is None else out
        self.out = self.result.reshape(-1)
        n = -(-size // E)
        self.n_chunks = n
        self.n_full = size // E
        self.last_count = size - (n - 1) * E if n else 0
        self.out_full = self.out[:self.n_full * E].reshape(self.n_full, E)
        self.have = np.zeros(n, np.uint8)
        self.n_contrib = np.zeros(n, np.uint16)
        self.n_have = 0
        self.answered = number
        self.skips: np.ndarray | None = None  # per chunk: the packets' ``skip`` (None: all 0)
        self.info: StrategyInfo | None = None
        self.sends: list[_Send] = []
        self.steps = 0
        self.error: BaseException | None = None
        self.fast = self.dtype != np.float16  # numba has no float16

    @property
    def complete(self) -> bool:
        return self.n_have == self.n_chunks


class _Ring:
    """``size`` contribution packets, built in place and sent from."""

    __slots__ = ("size", "pk", "u8", "i32", "buf")

    def __init__(self, dtype: np.dtype, size: int):
        self.size = size
        self.pk = np.zeros(size, dtype)
        self.u8 = self.pk.view(np.uint8).reshape(size, dtype.itemsize)
        self.i32 = self.u8.view(np.int32)
        self.buf = memoryview(self.pk.view(np.uint8))


class _Send:
    """One step of a round on its way: the input, a ring of packets, per-chunk send state."""

    def __init__(self, c: AggClient, rnd: _Round, x: np.ndarray, step: int, kind: StrategyKind):
        self.c, self.rnd, self.x, self.step = c, rnd, x, step
        self.n, self.S, self.E = rnd.n_chunks, c._slots, c._elements
        self.terms = quant.terms_for(c._world, kind)  # headroom for what the result may hold
        self.fq, self.jq = quant._q_frexp(c._world, self.terms)
        self.R = min(self.S, self.n)  # ring entries; chunk c lives at c % slots
        self.ring: _Ring | None = c._take_ring(self.R)
        h = self.ring.pk[:self.R]["hdr"]
        h[...] = 0
        h["magic"], h["version"], h["type"] = MAGIC, VERSION, _CONTRIB
        h["job"], h["rank"], h["round"], h["step"] = c._job, c._rank, rnd.r32, step
        h["count"] = self.E  # the last chunk's entry is corrected when it is admitted
        self.state = np.zeros(self.n, np.uint8)
        self.sent_at = np.zeros(self.n, np.float64)
        self.retries = np.zeros(self.n, np.uint8)
        self.next = 0        # next chunk to admit
        self.lo = 0          # lowest chunk without an answer
        self.inflight = 0
        self.hi_answered = -1  # highest chunk answered: chunks below it still in flight were lost
        self.answered_at = -np.inf  # when an answer last stopped a chunk in flight
        self.flags_dirty = False  # some ring entry carries the RETRANSMIT flag
        self.dropped = False
        self.last_ack = time.monotonic()
        self.fast_fill = c._fast
        self.fill_args = None  # the numba fill's masks and scratch, for the input's dtype

    @property
    def finished(self) -> bool:
        return self.next >= self.n and self.inflight == 0

    def drop(self) -> None:
        if self.ring is not None:
            self.c._give_ring(self.ring)
        self.ring = None
        self.x = None
        self.dropped = True

    # -- admission ----------------------------------------------------------------------------
    def admit(self, limit: int, budget: int) -> tuple[int, bool]:
        """Quantise and send chunks from ``next`` up to ``limit`` (exclusive) that the window and
        the slot rule allow; (chunks sent, whether more could be sent right away)."""
        S, c0 = self.S, self.next
        k = min(budget, limit - c0, ADMIT_MAX)
        if k <= 0:
            return 0, False
        if c0 + k > S:  # chunk c >= slots waits for the answer to chunk c - slots
            start = max(c0, S)
            blocked = self.state[start - S:c0 + k - S] != _DONE
            if blocked.any():
                k = start - c0 + int(np.argmax(blocked))
                if k == 0:
                    return 0, False
        r0 = c0 % S
        first = min(k, self.R - r0)  # the ring may wrap once
        self._fill(c0, first, r0)
        if first < k:
            self._fill(c0 + first, k - first, 0)
        skips = self.rnd.skips
        if skips is not None:
            h = self.ring.pk["hdr"]
            h["skip"][r0:r0 + first] = skips[c0:c0 + first]
            if first < k:
                h["skip"][0:k - first] = skips[c0 + first:c0 + k]
        self.state[c0:c0 + k] = _INFLIGHT
        self.inflight += k
        self.sent_at[c0:c0 + k] = time.monotonic()
        self.next = c0 + k
        if self.next >= self.n:
            self.x = None  # everything is in packets now: the caller's array is free
        rec, buf = self.c._rec, self.ring.buf
        self.c._send(buf[r0 * rec:(r0 + first) * rec], first)
        if first < k:
            self.c._send(buf[0:(k - first) * rec], k - first)
        return k, k == ADMIT_MAX and self.next < limit

    def _fill(self, c0: int, k: int, r0: int) -> None:
        """Quantise chunks ``c0 .. c0+k-1`` into ring entries ``r0 .. r0+k-1``."""
        E, x, ring = self.E, self.x, self.ring
        if self.fast_fill:
            if x.dtype == np.float16:
                xs, xc0 = x[c0 * E:(c0 + k) * E].astype(np.float32), 0
            else:
                xs, xc0 = x, c0
            if self.fill_args is None:
                self.fill_args = _fast.fill_args(xs.dtype)
            absmask, pick_b, pick_f = self.fill_args
            _fast.fill(xs, xs.view(pick_b.dtype), absmask, pick_b, pick_f, xc0, c0, k, E, self.fq,
                       self.jq, ring.u8, ring.i32, r0, self.flags_dirty)
            return
        src = x[c0 * E:(c0 + k) * E]
        if src.size == k * E:
            block = src.reshape(k, E)
        else:  # the last, partial chunk: pad with zeros
            block = np.zeros((k, E), x.dtype)
            block.reshape(-1)[:src.size] = src
        pk = ring.pk[r0:r0 + k]
        h = pk["hdr"]
        h["exponent"] = quant._quantise_rows(block, self.c._world, pk["payload"], self.terms)
        h["chunk"] = np.arange(c0, c0 + k, dtype=np.uint32)
        if self.flags_dirty:
            h["flags"] = 0
        if c0 + k == self.n:
            h["count"][k - 1] = self.rnd.last_count

    # -- answers and loss recovery ------------------------------------------------------------
    def ack(self, chunks: np.ndarray, now: float) -> int:
        """Chunks answered (repeats allowed): those in flight stop being retransmitted. Returns
        how many. The longest answer time among those sent once feeds the timeout estimate."""
        c = self.c
        if c._fast:
            out = c._ack_out
            n = _fast.ack(self.state, chunks, chunks.size, self.sent_at, self.retries, now, out)
            longest, once = out[0], out[1]
        else:
            hit = chunks[self.state[chunks] == _INFLIGHT]
            if hit.size > 1:
                hit = np.unique(hit)
            self.state[hit] = _DONE
            n = int(hit.size)
            first = hit[self.retries[hit] == 0]
            once = first.size
            longest = now - float(self.sent_at[first].min()) if once else 0.0
        if chunks.size:
            self.hi_answered = max(self.hi_answered, int(chunks.max()))
        if n:
            self.inflight -= n
            self.last_ack = self.answered_at = now
            if once:
                c._rtt.sample(longest)
            c._cwnd.acked(n)
        return n

    def hurry(self) -> None:
        """Make every packet still in flight due for retransmission now."""
        inflight = self.state[:self.next] == _INFLIGHT
        self.sent_at[:self.next][inflight] = -np.inf
        self.answered_at = -np.inf

    def retransmit_due(self, now: float, cap: float) -> None:
        open_ = np.flatnonzero(self.state[self.lo:self.next] != _DONE)
        if open_.size == 0:
            self.lo = self.next
            return
        self.lo += int(open_[0])
        cand = self.lo + np.flatnonzero(self.state[self.lo:self.next] == _INFLIGHT)
        if cand.size == 0:
            return
        c = self.c
        retries = self.retries[cand]
        rto = np.minimum(c._rtt.rto * np.exp2(retries.astype(np.float64)), cap)
        late = now - self.sent_at[cand] >= rto
        if c._strategy.kind != StrategyKind.QUORUM and late.any():
            # As TCP restarts its timer on every new acknowledgement (RFC 6298, 5.3): while
            # answers come, a chunk times out only once answers to later chunks have passed it
            # (lost); one they have not reached is waiting for a slow member. (Quorum rounds
            # keep per-chunk timers: their retransmissions are the clock of the deadline.)
            late &= (cand < self.hi_answered) | (now - self.answered_at >= rto)
        due = cand[late]
        if due.size == 0:
            return
        first = due[retries[late] == 0]
        if first.size and int(first[0]) < self.hi_answered:
            # a first timeout of a chunk the answers have passed by: the path dropped it (a
            # timeout with nothing later answered is the round waiting for a slow member)
            c._cwnd.lost(now, c._rtt.srtt or c._rtt.rto)
        pk = self.ring.pk
        idx = due % self.S
        pk["hdr"]["flags"][idx] = _RETRANSMIT
        self.flags_dirty = True
        packets = pk[idx]  # contiguous copy of the (few) packets to send again
        c._send(memoryview(packets.view(np.uint8)), due.size)
        c.stats["retransmits"] += int(due.size)
        self.sent_at[due] = now
        self.retries[due] = np.minimum(self.retries[due], 29) + 1
