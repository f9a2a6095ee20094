"""The worker side of aggd: ``AggClient`` sends float tensors through the aggregator.

``allreduce_async(x)`` starts one *round* of the job and returns an ``AllreduceHandle``;
``allreduce(x)`` is ``allreduce_async(x).wait()``. The tensor is cut into chunks of ``elements``
values, each chunk is quantised to int32 with its own exponent (``quant``) and sent as one
contribution packet; the aggregator sums the contributions of a chunk and multicasts (or unicasts)
the result.

Precision: a job's contributions are int32 (the default), int16 or int8 (``precision=16`` / ``8``,
the JOIN_ACK's ``precision``): narrow values are rounded stochastically (``seed`` seeds the client's
generator) and summed exactly into results twice as wide (int32 / int16); the header ``code`` of
every contribution and result says which. A result of another precision than the job's fails the
round (``ProtocolError``). ``allreduce(..., residual=r)`` writes each value's rounding residual
(what was meant minus what the aggregator summed of it) into ``r``: error feedback
(``aggd_client.feedback``) builds on it.

Strategies (docs/protocol.md, "What clients do"). Every result names the strategy that governed its
round (``strategy``, ``param``, ``strategy_version``); the newest one seen is the strategy in force
(``sync`` before the first result, unless the constructor's ``strategy`` says otherwise). A new
round is sent only when it admits one: ``sync``, ``quorum`` and ``wbsp`` one round outstanding
(sent, result not complete), ``ssp:s`` ``s + 1``, ``async`` 3. Otherwise ``allreduce_async`` makes
progress on the earlier rounds until it may (``block=False``: raises ``WouldBlock``;
``must_wait()`` says beforehand). Under ``wbsp`` a call made while a round is outstanding (same
shape, dtype and op) is sent as that round's next ``step`` instead, at most ``WBSP_MAX_STEPS`` per
round less what of ours the aggregator may carry into it (``_Round.carried_in``: our later steps
of the previous round that may arrive after its release), and its handle resolves with that round's
result. A result for a later round than the one a
chunk asked for completes the chunk when it was governed by ``quorum`` or ``async`` (a straggler
gets the newest result) and the next round starts after it. Quantisation leaves headroom for the
contributions a result may hold beyond one per member (``quant.terms_for``).

Transport, as docs/protocol.md asks:

* Contributions leave from one UDP socket bound to ``bind``; that address is the worker's registered
  member address. NACKs and unicast results come back to it. With ``group``, a second socket bound
  to the group's address and port and joined to the group (on the interface that routes to the server, with
  ``IP_MULTICAST_ALL`` off) receives the multicast results. Both are polled.
* A round keeps its result state (chunks answered, their ``n_contrib``, the output array); each of
  its steps is a *send* with its own ring of ``packet_dtype(elements, precision)`` records indexed by
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
  the members' retransmissions as the clock of its deadline, and not doubled there while at most
  ``flow.QUORUM_STEADY_MAX`` chunks are in flight) is sent again flagged RETRANSMIT, or sooner
  once chunks sent after it are answered (RACK) or as the last few in flight (tail loss probes).
  Chunks in flight are further bounded by a congestion window (``flow.CongestionWindow``: halved
  when first timeouts fire for chunks that answers to later chunks have passed by, regrown as
  answers come; without ``window``, at most ``flow.MAX_INFLIGHT_BYTES`` of packets, and the members'
  windows together at most ``flow.MAX_INFLIGHT_PACKETS``).
  No new result for ``give_up_after`` seconds (``GIVE_UP_AFTER``, 30, by default) spent inside the
  client's calls while a round waits raises ``NoAnswerError``.

Progress happens only inside calls (``allreduce_async``, ``wait``, ``done``, ``must_wait``): there is
no thread. An ``AggClient`` is not thread-safe: one per worker (per thread).

Layout: this module is the public API and admission; ``AggClient`` is composed of mixins, one a
concern, that share its attributes: ``transport`` (sockets, GSO, ``sendmmsg`` runs, batched
receives), ``rounds`` (rounds, sends, the window and order rules, retransmission), ``results``
(matching results to rounds, acknowledgements, the strategy in force, quorum catch-up, NACKs) and
``progress`` (the loop that drives them inside the caller's calls). ``strategy`` holds
``StrategyInfo``.
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np

from . import _fast, quant
from .errors import AggdError
from .flow import CongestionWindow, RtoEstimator, default_window
from .progress import ProgressLoop
from .protocol import packet_dtype
from .protocol.definition import (LANES, MAX_ELEMENTS, MAX_JOBS, MAX_MEMBERS, ZERO_EXPONENT, Precision,
                                  StrategyKind, values_per_packet)
from .results import ResultHandler
from .rounds import NOT_OURS, RTO_CAP, RoundScheduler, _Round, _Send
from .scales import ChunkScales
from .strategy import ASYNC_OUTSTANDING, WBSP_MAX_STEPS, StrategyInfo
from .transport import UdpTransport
# Defined in this module before the client was split by concern; tests import them from here.
from .progress import SMALL_BATCH  # noqa: F401
from .transport import STAGE  # noqa: F401

__all__ = ["AggClient", "AllreduceHandle", "StrategyInfo", "WouldBlock", "ASYNC_OUTSTANDING",
           "WBSP_MAX_STEPS"]

# close(): how long late contributions to rounds already answered are retransmitted (seconds)
LATE_LINGER = 1.0
#: Seconds without a new result before a call gives up (``give_up_after``). Well above the time a
#: daemon takes to declare a dead member gone (``[policy] silent_after``, 5 s, and a scan), so that
#: the survivors of a dead worker go on rather than give up first, and above a daemon's restart.
GIVE_UP_AFTER = 30.0
#: Values reduced through numpy before the numba kernels are loaded (``AggClient(fast=None)``):
#: what numpy's path costs more than theirs over these is about what loading them costs.
FAST_AFTER_VALUES = 1 << 20


def fast_for_run(values: int) -> bool | None:
    """``AggClient``'s ``fast`` for a client that will reduce ``values`` values in all: True (load the
    kernels at creation, so no timed call and no memory baseline pays for the load mid-run) when that
    passes ``FAST_AFTER_VALUES``, else None (a short run never loads them)."""
    return True if values >= FAST_AFTER_VALUES else None


class WouldBlock(AggdError):
    """``allreduce_async(..., block=False)`` was called while the strategy in force admits no
    further round (``AggClient.must_wait()`` is true): wait on an earlier handle, or call again."""


def _all_finite(x: np.ndarray, fast: bool) -> bool:
    """No NaN or infinity in ``x`` (1-D, contiguous): checked before anything of it is sent."""
    if fast and x.dtype in _fast.BITS:
        return _fast.all_finite(x)
    lo, hi = x.min(), x.max()  # NaN propagates; cheaper than isfinite(x).all()
    return bool(np.isfinite(lo) and np.isfinite(hi))


class AggClient(ProgressLoop, RoundScheduler, ResultHandler, UdpTransport):
    """A worker of one aggd job.

    ``server``: the aggregator's ``(host, port)``. ``job``, ``rank``, ``world``: the job id, this
    worker's rank and the number of members (as registered with the aggregator). ``group``: the
    job's result ``(multicast group, port)``, or None when results come back by unicast to the
    worker's address. ``bind``: the worker's member address (port 0 picks one; see ``address``).
    ``elements``: values per packet, as the JOIN_ACK says (the aggregator's ``E``; ``2 E`` for an
    8-bit job). ``slots``: the job's slot
    pool; ``window``: chunks in flight (at most ``slots``; None: ``slots``, at most
    ``flow.MAX_INFLIGHT_BYTES`` of packets and a share of ``flow.MAX_INFLIGHT_PACKETS``).
    ``retransmit_timeout`` and
    ``give_up_after`` in seconds; ``max_retransmit_interval``: the longest a chunk waits between
    retransmissions under ``quorum`` (the data plane checks a quorum round's deadline when a packet
    reaches its slot, so the members' retransmissions are its clock: keep this at or below the
    job's quorum timeout). ``strategy``: the strategy the job starts with (``"ssp:2"``, a
    ``StrategyInfo``; ``JobInfo.strategy`` from ``join``), assumed until the first result says;
    None: ``sync``. ``gso``: send with UDP GSO; must be False when the aggregator runs XDP in
    generic (skb) mode. ``gro``: ask the kernel to hand over trains of results as one read
    (``UDP_GRO``; it coalesces them where the interface has GRO on). ``catch_up``: under ``quorum`` a member that is behind may move to a later
    round it saw released (the default); that assumes every call reduces a tensor of one size, so
    it stops by itself once a call's size differs, and a job whose tensors differ in size from the
    start (DDP's buckets) should pass False (docs/protocol.md, "Tensors of different sizes").
    ``first_round``: the round of the first allreduce (a member rejoining a running job starts at
    the job's round, which the JOIN_ACK gives: ``join`` passes it). ``tag``: the member tag every
    contribution carries (the JOIN_ACK's: ``join`` passes it; 0 for a member configured without a
    JOIN). ``headroom``: contributions per member every round is quantised for, whatever the
    strategy (the JOIN_ACK's: ``join`` passes it); None: as many as the strategy in force puts in a
    round (``quant.terms_for``), for an aggregator whose strategy never changes. ``span``: the
    workers whose contributions one result holds, when that is more than ``world`` (a rack job under
    an upper aggregator: the JOIN_ACK's ``span``, which ``join`` passes); None: ``world``.
    ``precision``: the job's contribution width, a ``Precision`` or its bits (32, 16, 8; the
    JOIN_ACK's ``precision``, which ``join`` passes); 32 is the original int32 format. ``seed``: the
    seed of the generator that rounds narrow precisions stochastically (None: fresh entropy).
    ``room``: a narrow job's contributions carry room for their wider result, so an aggregator whose
    frames cannot grow answers in the kernel (the JOIN_ACK's ``room``, which ``join`` passes).
    ``fast``: when to load the numba kernels (``_fast``), which cost a process 0.5-0.7 s of CPU
    (numba's import and its cached code) and then quantise and read results several times faster
    than numpy: None (the default) in a thread of their own once ``FAST_AFTER_VALUES`` values have
    been reduced, used from the first call after it finished (a worker of small tensors never pays
    it, and no call waits for it), True now, False never.
    """

    def __init__(self, server: tuple[str, int], job: int, rank: int, world: int, *,
                 group: tuple[str, int] | None = None, bind: tuple[str, int] = ("0.0.0.0", 0),
                 elements: int = 256, slots: int = 1024, window: int | None = None,
                 retransmit_timeout: float = 0.05, give_up_after: float = GIVE_UP_AFTER,
                 max_retransmit_interval: float = 0.2,
                 strategy: str | StrategyInfo | StrategyKind | None = None, gso: bool = True,
                 gro: bool = True, catch_up: bool = True, first_round: int = 0, tag: int = 0, headroom: int | None = None,
                 span: int | None = None, precision: "Precision | int | str" = 32, seed=None,
                 room: bool = False, fast: bool | None = None):
        if not 0 <= int(job) < MAX_JOBS:
            raise ValueError(f"job must be in 0..{MAX_JOBS - 1}, got {job}")
        if not 1 <= int(world) <= MAX_MEMBERS:
            raise ValueError(f"world must be in 1..{MAX_MEMBERS}, got {world}")
        if not 0 <= int(rank) < int(world):
            raise ValueError(f"rank must be in 0..{int(world) - 1}, got {rank}")
        if int(slots) < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if window is not None and int(window) < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if not 0 <= int(first_round) <= 0xFFFFFFFF:
            raise ValueError(f"first_round must be a u32 round number, got {first_round}")
        if not 0 <= int(tag) < 1 << 64:
            raise ValueError("tag must be a u64 (the JOIN_ACK's)")
        if headroom is not None and not 1 <= int(headroom) <= quant.MAX_HEADROOM:
            raise ValueError(f"headroom must be in 1..{quant.MAX_HEADROOM}, got {headroom}")
        if span is not None and not int(world) <= int(span) <= quant.MAX_SPAN:
            raise ValueError(f"span must be in {int(world)}..{quant.MAX_SPAN}, got {span}")
        if not retransmit_timeout > 0 or not give_up_after > 0 or not max_retransmit_interval > 0:
            raise ValueError("retransmit_timeout, give_up_after and max_retransmit_interval must "
                             "be positive")
        prec = quant.precision_of(precision)
        if not 1 <= int(elements) <= values_per_packet(MAX_ELEMENTS, prec):
            raise ValueError(f"elements must be in 1..{values_per_packet(MAX_ELEMENTS, prec)}, got {elements}")
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
        self._span = int(world) if span is None else int(span)   # what every round is quantised for
        self._short_sums: int | None = None   # the fewest contributions a sync or ssp result held (ResultHandler)
        self._tag = int(tag)
        self._headroom = None if headroom is None else int(headroom)
        self._elements = int(elements)
        self._slots = int(slots)
        self._precision = prec
        self._lanes = LANES[prec]
        self._rng = np.random.default_rng(seed)  # stochastic rounding of narrow precisions
        # ... and the numba fill's generator (xorshift64*: a nonzero state), from the same seed
        self._rng_state = self._rng.integers(1, 2**63, size=1, dtype=np.uint64)
        self._dtype = packet_dtype(self._elements, prec, room=bool(room))   # a contribution (ring record)
        self._rec = self._dtype.itemsize
        # a window the caller does not set is bounded by bytes in flight too (flow.default_window)
        self._window = (min(int(window), self._slots) if window is not None
                        else default_window(self._slots, self._rec, self._world))
        self._rto = float(retransmit_timeout)
        self._rto_cap = max(RTO_CAP, self._rto)
        self._quorum_cap = min(float(max_retransmit_interval), self._rto_cap)
        self._scan_every = max(min(self._rto, self._quorum_cap) / 4, 0.001)
        # answer times raise the timeout above retransmit_timeout when the path (or the slowest
        # member) is slower; losses shrink the chunks in flight below the window
        self._rtt = RtoEstimator(self._rto, self._rto, self._rto_cap)
        self._cwnd = CongestionWindow(self._window)
        self._ack_out = np.zeros(3, np.float64)
        self._give_up = float(give_up_after)
        self._gso = bool(gso)
        self._gro_wanted = bool(gro)
        self._closed = False
        self._last_send_error: OSError | None = None
        self.stats = {"packets_sent": 0, "retransmits": 0, "results": 0, "ignored": 0,
                      "send_errors": 0, "gso_fallbacks": 0, "trains": 0, "steps": 0, "abandoned": 0,
                      "batch_waits": 0}

        # Admission: the next round's number, what a whole round is, the quorum rounds seen on the
        # group (a straggler catches up), the strategy in force and the round whose result said so.
        self._next_round = int(first_round)
        self._round_chunks = 0     # chunks of the newest round started (what a whole round is; 0: none yet)
        self._seen_quorum: dict[int, set[int]] = {}   # quorum rounds seen on the group: chunks
        # Per chunk index, the newest round it took part in (-1: none): each packet's ``skip``
        # tells the aggregator which round of its chunk it follows (docs/protocol.md, rule 3).
        # A rejoining member's chunks follow the round before its first (the job's, as far as it
        # knows): its first round says skip 0, as the others' next round does.
        self._chunk_floor = int(first_round) - 1
        self._chunk_last = np.full(0, self._chunk_floor, np.int64)
        # Whether every round so far reduced a tensor of one size: a quorum straggler may then
        # skip to a later round, which (as far as it can tell) holds the same tensor.
        self._first_size: int | None = None
        self._uniform = bool(catch_up)
        # Whether our calls have had more than one size: under quorum we then say Flag.ORDERED,
        # and the aggregator keeps each round's result for us (the chunk's newest may be another
        # tensor's; docs/protocol.md, "Tensors of different sizes").
        self._sizes_differ = False
        self._own_next = int(first_round)   # the round after our newest own one (no quorum catch-up)
        # The most chunks a round of ours had (beyond `slots`, slots serve several chunk indices:
        # RoundScheduler._limit), and the newest round that sent a chunk index for the first time
        # (-1: none yet): the next round waits for its results (docs/protocol.md, "What clients
        # do"), so no round of a chunk reaches its slot before the chunk's first one opened there.
        self._chunks_sent = 0
        self._new_chunks_round = -1
        self._strategy = info
        self._strategy_round = -1
        self._init_rounds()
        self._init_progress()
        # after the state above: a bind or join that fails closes the client, which runs the loop
        self._open_sockets(bind, group)
        # numba kernels: loaded now, never, or by a thread of their own once enough values were
        # reduced, and used from the first call after it finished (``_load_fast``)
        if fast is None and FAST_AFTER_VALUES <= 0:
            fast = True
        self._fast = _fast.warm_up() if fast else (fast is None and _fast.warmed())
        self._fast_after = FAST_AFTER_VALUES if fast is None and not self._fast else None
        self._fast_loader: threading.Thread | None = None
        self._init_staging()
        self._init_results()

    def _load_fast(self, values: int) -> None:
        """Count a call's values towards ``FAST_AFTER_VALUES``; once reached, load the kernels in a
        thread (the calls go on through numpy meanwhile: no call waits for the load) and use them
        from the first call after it finished."""
        if self._fast_loader is None:
            self._fast_after -= values
            if self._fast_after <= 0:
                self._fast_loader = threading.Thread(target=_fast.warm_up, name="aggd-numba-load", daemon=True)
                self._fast_loader.start()
        elif not self._fast_loader.is_alive():
            self._fast, self._fast_after = _fast.warmed(), None

    # -- public -------------------------------------------------------------------------------
    @property
    def round(self) -> int:
        """The round the next new allreduce gets: 0 at first, +1 per round started (a ``wbsp``
        step starts none), and at least the newest ``quorum`` result seen (catching up)."""
        return self._next_round

    @property
    def precision(self) -> Precision:
        """The job's contribution precision (``Precision``; ``LANES[precision].bits`` its bits)."""
        return self._precision

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

    @property
    def gro(self) -> bool:
        """Whether receives take trains of results (UDP GRO accepted by the kernel)."""
        return self._receiver.gro

    def close(self, linger: float = LATE_LINGER) -> None:
        """Deliver what was handed over, then release the sockets; rounds still open fail.

        Contributions to rounds whose result has not come (other members may wait for them) are
        retransmitted until answered or ``give_up_after`` passes. Late ones to rounds already
        answered (a quorum straggler's chunk, a late wbsp step: carried into a later round of
        their chunk if a bank takes them) only for ``linger`` seconds more: at a job's end no
        later round comes to take them, and the aggregator refuses them until ``give_up_after``.
        Those still unanswered then are counted in ``stats["abandoned"]``.
        """
        if self._closed:
            return
        try:
            self._progress(lambda: all(s.finished or s.rnd.complete for s in self._sends), self._give_up)
            self._progress(lambda: all(s.finished for s in self._sends), min(linger, self._give_up))
        except Exception:  # noqa: BLE001 - closing must not raise for a round that already failed
            pass
        self.stats["abandoned"] += sum(s.inflight + s.n - s.next for s in self._sends
                                       if s.rnd.complete and not s.finished)
        self._closed = True
        self._fail_all(AggdError("the client was closed"))
        self._close_sockets()

    def __enter__(self) -> "AggClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AggClient(server={self._server}, job={self._job}, rank={self._rank}, "
                f"world={self._world}, round={self._next_round}, strategy={self._strategy})")

    def allreduce(self, array, op: str = "sum", *, out: np.ndarray | None = None,
                  residual: np.ndarray | None = None, scales: ChunkScales | None = None) -> np.ndarray:
        """Sum (``op="sum"``) or average (``op="mean"``) ``array`` over the job's members:
        ``allreduce_async(array, op, out=out, residual=residual, scales=scales).wait()``.

        Returns a new array of the same shape and dtype (float16, float32 or float64), or ``out``
        filled with the result (reusing a buffer spares the page faults of a new array). Every member
        must call ``allreduce`` with the same shape, in the same order. A mean divides each chunk by
        the number of contributions its result holds. Each element is within
        ``quant.error_bound(world, exponent, n_contrib, precision)`` of the exact sum of those
        contributions (divided by the count for a mean), plus the rounding to the output dtype.
        """
        return self.allreduce_async(array, op, out=out, residual=residual, scales=scales).wait()

    def allreduce_async(self, array, op: str = "sum", *, block: bool = True,
                        out: np.ndarray | None = None, residual: np.ndarray | None = None,
                        scales: ChunkScales | None = None) -> "AllreduceHandle":
        """Start reducing ``array`` and return its handle (``wait()`` gives the result).

        The array is read until the handle is done: do not change it before. When the strategy in
        force admits no new round (``must_wait()``), this call makes progress on the earlier rounds
        until it does; with ``block=False`` it raises ``WouldBlock`` instead. Under ``wbsp`` a call
        made while a round of the same shape, dtype and ``op`` is outstanding is sent as that
        round's next step and its handle resolves with that round's result (``out`` is then
        ignored). ``out``: a C-contiguous, writable array of the same shape and dtype, not sharing
        memory with ``array``, that receives the result instead of a new one.

        ``residual``: a C-contiguous, writable float64 array (or of ``array``'s dtype) of
        ``array``'s size that receives, for every value, its rounding residual: the value minus the
        dequantised contribution sent for it, corrected once the round's result is complete for what
        the aggregator's alignment of it to the results' exponents dropped (exact when the
        aggregator floors each contribution on its own: see ``aggd_client.feedback``). Complete once
        the handle is done; each call (each ``wbsp`` step) writes its own.

        ``scales``: the ``scales`` of an earlier call's handle (of a tensor of the same size): each
        chunk is sent at the smaller of its own exponent and the one the members shared there
        (``aggd_client.scales``; ignored if that call's chunks were others).
        """
        self._check_open()
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        a = np.asarray(array)
        if a.dtype not in quant.FLOAT_DTYPES:
            raise TypeError(f"aggd reduces float16, float32 and float64 arrays, got {a.dtype}")
        if out is not None:
            _check_buffer("out", out, a)
        if residual is not None:
            _check_buffer("residual", residual, a, residual=True)
        mean = op == "mean"
        if a.size == 0:  # nothing to send: the round is used up and answered at once
            rnd = _Round(self._next_round, a.shape, a.dtype, 0, self._elements, mean, out)
            if residual is not None:
                residual[...] = 0
            self._next_round += 1
            self._own_next = self._next_round
            return AllreduceHandle(self, rnd, None)
        x = np.ascontiguousarray(a).reshape(-1)
        if self._fast_after is not None:
            self._load_fast(x.size)
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
            self._sizes_differ = self._sizes_differ or x.size != self._first_size
            self._uniform = self._uniform and not self._sizes_differ
            if not self._uniform:
                # a round we moved to on seeing a quorum's results may hold another tensor
                # than this one: keep our own order (docs/protocol.md, "Tensors of different sizes")
                self._next_round = self._own_next
                self._seen_quorum.clear()
            self._catch_up()  # a quorum round seen whole, now that we know what whole is
            rnd = _Round(self._next_round, a.shape, a.dtype, x.size, self._elements, mean, out)
            rnd.skips = self._skips_for(rnd)
            if rnd.n_chunks > self._chunks_sent:
                self._chunks_sent, self._new_chunks_round = rnd.n_chunks, rnd.number
            self._next_round += 1
            self._own_next = self._next_round
            self._start_round(rnd)
        else:
            rnd = into
            self.stats["steps"] += 1
        send = _Send(self, rnd, x, rnd.steps, self._strategy.kind,
                     None if residual is None else residual.reshape(-1),
                     None if scales is None else scales.cap_for(self._elements, rnd.n_chunks))
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
        # a window of consecutive rounds: a round still waiting (e.g. for a lost result) holds the
        # member back as any slower member would (ssp's bound, the aggregator keeps that many banks)
        # ... and a round that sent a chunk index for the first time is answered before the next
        # one starts: until that chunk's first round has opened in its slot, a later round of it
        # arriving first would open there and make the first one late (carried, never released)
        oldest = min((r.number for r in waiting), default=None)
        if len(waiting) < info.max_outstanding and (
                oldest is None or (oldest > self._next_round - info.max_outstanding
                                   and oldest > self._new_chunks_round)):
            return True
        if info.kind == StrategyKind.WBSP and len(waiting) == 1:
            r = waiting[0]
            # Only into our newest round (an older one still waiting lost an answer: its later
            # steps could be carried anywhere); and our later steps of the previous round may be
            # carried into this one: with our steps here they must fit the headroom every round is
            # quantised for.
            if (r is self._last_round and r.steps + r.carried_in() < WBSP_MAX_STEPS
                    and (spec is None or spec == (r.shape, r.dtype, r.mean))):
                return r
        return None


class AllreduceHandle:
    """The result of one ``allreduce_async`` call, to come.

    ``wait(timeout=None)`` returns it (the same array for every handle of a round: the steps of a
    ``wbsp`` round share it); ``done()`` says whether it is there, making progress without
    blocking. Once done: ``round`` is the newest round whose result answered it (later than the
    round asked for when a ``quorum``/``async`` straggler got a newer result), ``n_contrib`` the
    contributions each chunk's result holds, ``strategy`` the strategy that governed that round.
    ``step`` is the wbsp step this call was sent as (0 otherwise). ``scales``: the chunks' shared
    and own exponents, for a later call's ``scales=`` (``aggd_client.scales``).
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

    @property
    def scales(self) -> ChunkScales | None:
        """Once done: each chunk's result exponent (where our own round answered it) as the shared
        one, and the exponents this call found for its own values; None for an empty tensor."""
        s = self._send
        if s is None:
            return None
        r = self._round
        shared = np.where(r.res_exp == NOT_OURS, ZERO_EXPONENT, r.res_exp).astype(np.int32)
        return ChunkScales(self._client._elements, shared, s.own_e.copy())

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


def _check_buffer(name: str, buf, a: np.ndarray, residual: bool = False) -> None:
    """``out`` (the input's shape and dtype) or ``residual`` (its size, float64 or its dtype): a
    C-contiguous writable numpy array that shares no memory with the input (a result may arrive, a
    straggler's quorum answer, before the input's chunk was read)."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, not {type(buf).__name__}")
    if residual and (buf.size != a.size or buf.dtype not in (np.dtype(np.float64), a.dtype)):
        raise ValueError(f"{name} must hold {a.size} float64 (or {a.dtype}) values, not {buf.size} {buf.dtype}")
    if not residual and (buf.shape != a.shape or buf.dtype != a.dtype):
        raise ValueError(f"{name} must have the input's shape {a.shape} and dtype {a.dtype}, not "
                         f"{buf.shape} {buf.dtype}")
    if not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ValueError(f"{name} must be C-contiguous and writable")
    if np.may_share_memory(buf, a):
        raise ValueError(f"{name} must not share memory with the input")
