"""The worker side of aggd: ``AggClient.allreduce`` sends a float tensor through the aggregator.

One call is one *round* of the job: the tensor is cut into chunks of ``elements`` values, each chunk
is quantised to int32 with its own exponent (``quant``) and sent as one contribution packet; the
aggregator sums the ``world`` contributions of a chunk and multicasts (or unicasts) the result.

Transport, as docs/protocol.md asks:

* Contributions leave from one UDP socket bound to ``bind``; that address is the worker's registered
  member address. NACKs and unicast results come back to it. With ``group``, a second socket bound
  to the group's port and joined to the group (on the interface that routes to the server, with
  ``IP_MULTICAST_ALL`` off) receives the multicast results. Both are polled.
* Window: at most ``min(window, slots)`` chunks in flight, and chunk ``c + slots`` leaves only after
  chunk ``c``'s result arrived (chunk ``c`` uses the aggregator's slot ``c % slots``). Packets are
  built by column into a ring of ``packet_dtype(elements)`` records indexed by ``c % slots``: the
  ring is the only copy of the quantised tensor, so the client needs about ``slots`` packets of
  memory beyond the output array, whatever the tensor size.
* Batches leave with UDP GSO (one ``sendmsg`` carries up to 64 packets) unless ``gso=False``; a
  kernel that refuses GSO makes the client fall back to one ``sendto`` per packet, once for good.
* Results are received straight into a preallocated record array, checked by column, dequantised
  into the output by block. A chunk without a result after ``retransmit_timeout`` (doubled at each
  retry of that chunk, at most ``max(1 s, retransmit_timeout)``) is sent again flagged RETRANSMIT.
  No new result for ``give_up_after`` seconds raises ``NoAnswerError``.

An ``AggClient`` is not thread-safe: one per worker (per thread).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import selectors
import socket
import struct
import time

import numpy as np

from . import _fast, quant
from .errors import (AggdError, AggregationOverflowError, NoAnswerError, NotMemberError,
                     ProtocolError, UnknownJobError)
from .protocol import HEADER_DTYPE, HEADER_SIZE, packet_dtype
from .protocol.definition import (MAGIC, MAX_ELEMENTS, MAX_JOBS, MAX_MEMBERS, VERSION, Flag,
                                  MsgType, NackCode)

__all__ = ["AggClient"]

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
#: Largest receive batch handled at once, and largest admission batch (keeps temporaries small).
STAGE = 256
ADMIT_MAX = 64
SOCKET_BUFFER = 8 << 20
RTO_CAP = 1.0

_PENDING, _INFLIGHT, _DONE = 0, 1, 2
# plain ints: numpy compares against enum members far more slowly
_CONTRIB, _RESULT, _NACK = int(MsgType.CONTRIB), int(MsgType.RESULT), int(MsgType.NACK)
_RETRANSMIT, _OVERFLOW = int(Flag.RETRANSMIT), int(Flag.OVERFLOW)


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


class AggClient:
    """A worker of one aggd job.

    ``server``: the aggregator's ``(host, port)``. ``job``, ``rank``, ``world``: the job id, this
    worker's rank and the number of members (as registered with the aggregator). ``group``: the
    job's result ``(multicast group, port)``, or None when results come back by unicast to the
    worker's address. ``bind``: the worker's member address (port 0 picks one; see ``address``).
    ``elements``: values per packet, as configured on the aggregator. ``slots``: the job's slot
    pool; ``window``: chunks in flight (at most ``slots``). ``retransmit_timeout`` and
    ``give_up_after`` in seconds. ``gso``: send with UDP GSO; must be False when the aggregator
    runs XDP in generic (skb) mode.
    """

    def __init__(self, server: tuple[str, int], job: int, rank: int, world: int, *,
                 group: tuple[str, int] | None = None, bind: tuple[str, int] = ("0.0.0.0", 0),
                 elements: int = 256, slots: int = 1024, window: int | None = None,
                 retransmit_timeout: float = 0.05, give_up_after: float = 5.0, gso: bool = True):
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
        if not retransmit_timeout > 0 or not give_up_after > 0:
            raise ValueError("retransmit_timeout and give_up_after must be positive")
        self._server = (socket.gethostbyname(server[0]), int(server[1]))
        self._job, self._rank, self._world = int(job), int(rank), int(world)
        self._elements = int(elements)
        self._slots = int(slots)
        self._window = min(int(window) if window is not None else self._slots, self._slots)
        self._rto = float(retransmit_timeout)
        self._rto_cap = max(RTO_CAP, self._rto)
        self._give_up = float(give_up_after)
        self._gso = bool(gso)
        self._round = 0
        self._closed = False
        self._last_send_error: OSError | None = None
        self.stats = {"packets_sent": 0, "retransmits": 0, "results": 0, "ignored": 0,
                      "send_errors": 0, "gso_fallbacks": 0}

        self._dtype = packet_dtype(self._elements)
        self._rec = self._dtype.itemsize
        self._gso_segments = max(1, min(GSO_MAX_SEGMENTS, UDP_MAX_PAYLOAD // self._rec))
        self._gso_cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("H", self._rec))]

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
        self._ring(0)                 # ring of contribution packets, grown on demand
        self._stage = np.zeros(STAGE, self._dtype)  # receive staging
        raw = memoryview(self._stage.view(np.uint8))
        self._stage_views = [raw[i * self._rec:(i + 1) * self._rec] for i in range(STAGE)]
        self._stage_u8 = self._stage.view(np.uint8).reshape(STAGE, self._rec)
        self._stage_i32 = self._stage_u8.view(np.int32)
        self._words = self._stage_u8.view(np.uint32)
        self._done_buf = np.zeros(STAGE, np.int64)
        self._sizes = np.zeros(STAGE, np.int64)

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
        """The job's allreduce number this worker is at: 0 at first, +1 per ``allreduce`` call."""
        return self._round

    @property
    def address(self) -> tuple[str, int]:
        """This worker's member address (what the aggregator must have registered for its rank)."""
        return self._address

    @property
    def server(self) -> tuple[str, int]:
        return self._server

    @property
    def gso(self) -> bool:
        """Whether sends use UDP GSO (False when disabled or after the kernel refused it)."""
        return self._gso

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
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
                f"world={self._world}, round={self._round})")

    def allreduce(self, array, op: str = "sum") -> np.ndarray:
        """Sum (``op="sum"``) or average (``op="mean"``) ``array`` over the job's members.

        Returns a new array of the same shape and dtype (float16, float32 or float64). Every member
        must call ``allreduce`` with the same shape, in the same order. A mean divides each chunk by
        the number of contributions its result holds. Each element is within
        ``quant.error_bound(world, exponent)`` of the exact sum (divided by the count for a mean),
        plus the rounding to the output dtype.
        """
        if self._closed:
            raise AggdError("the client is closed")
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        a = np.asarray(array)
        if a.dtype not in quant.FLOAT_DTYPES:
            raise TypeError(f"aggd reduces float16, float32 and float64 arrays, got {a.dtype}")
        out = np.empty(a.shape, a.dtype)
        if a.size == 0:
            self._round += 1
            return out
        x = np.ascontiguousarray(a).reshape(-1)
        lo, hi = x.min(), x.max()  # NaN propagates; cheaper than isfinite(x).all()
        if not (np.isfinite(lo) and np.isfinite(hi)):
            raise ValueError("cannot allreduce an array holding NaN or infinity")
        n_chunks = -(-x.size // self._elements)
        if n_chunks > 0xFFFFFFFF:
            raise ValueError(f"tensor too large: {n_chunks} chunks")
        try:
            _Transfer(self, x, out.reshape(-1), n_chunks, op == "mean").run()
        finally:
            self._round += 1  # the round is used up once anything was sent
        return out

    # -- sending ------------------------------------------------------------------------------
    def _ring(self, size: int) -> np.ndarray:
        if not hasattr(self, "_tx") or self._tx.size < size:
            self._tx = np.zeros(size, self._dtype)
            self._tx_u8 = self._tx.view(np.uint8).reshape(size, self._rec)
            self._tx_i32 = self._tx_u8.view(np.int32)
            self._tx_bytes = memoryview(self._tx.view(np.uint8))
        return self._tx

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
    def _drain(self, sock: socket.socket, m: int) -> int:
        """Receive into the staging array from position ``m`` until empty or full; new ``m``."""
        views, sizes, rec = self._stage_views, self._sizes, self._rec
        while m < STAGE:
            try:
                sizes[m] = sock.recv_into(views[m], rec, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError:
                continue
            m += 1
        return m


class _Transfer:
    """State of one ``allreduce`` call."""

    def __init__(self, c: AggClient, x: np.ndarray, out: np.ndarray, n_chunks: int, mean: bool):
        self.c = c
        self.x, self.out, self.n_chunks, self.mean = x, out, n_chunks, mean
        E = c._elements
        self.E = E
        self.n_full = x.size // E
        self.last_count = x.size - (n_chunks - 1) * E
        self.out_full = out[:self.n_full * E].reshape(self.n_full, E)
        self.round32 = c._round & 0xFFFFFFFF
        self.state = np.zeros(n_chunks, np.uint8)
        self.sent_at = np.zeros(n_chunks, np.float64)
        self.retries = np.zeros(n_chunks, np.uint8)
        self.next = 0        # next chunk to admit
        self.lo = 0          # lowest chunk without a result
        self.inflight = 0
        self.done = 0
        self.flags_dirty = False  # some ring entry carries the RETRANSMIT flag
        self.fast_fill = c._fast
        self.fast_scatter = c._fast and out.dtype != np.float16  # numba has no float16
        self.fq, self.jq = quant._q_frexp(c._world)
        self.R = min(c._slots, n_chunks)  # ring entries; chunk c lives at c % slots
        h = c._ring(self.R)[:self.R]["hdr"]
        h[...] = 0
        h["magic"] = MAGIC
        h["version"] = VERSION
        h["type"] = _CONTRIB
        h["job"] = c._job
        h["rank"] = c._rank
        h["round"] = self.round32
        h["count"] = E  # the last chunk's entry is corrected when it is admitted
        # Results are recognised by the first 12 header bytes (magic, version, type, job, round)
        # compared as native uint32 words of the staging buffer, whatever the host's byte order.
        proto = np.zeros(1, HEADER_DTYPE)
        proto["magic"], proto["version"], proto["job"] = MAGIC, VERSION, c._job
        proto["rank"], proto["round"] = 0xFFFF, self.round32
        proto["type"] = _RESULT
        self.w_result = proto.view(np.uint32)[:3].copy()
        proto["type"] = _NACK
        self.w_nack = proto.view(np.uint32)[0]
        self.job_mask = np.frombuffer(b"\xff\xff\x00\x00", np.uint32)[0]  # job, not rank

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> None:
        c = self.c
        scan_every = max(c._rto / 4, 0.001)
        now = time.monotonic()
        last_progress = now
        next_scan = now + scan_every
        while self.done < self.n_chunks:
            more = self.admit()
            now = time.monotonic()
            if now >= next_scan:
                self.retransmit_due(now)
                next_scan = now + scan_every
            if now - last_progress >= c._give_up:
                self.give_up(now - last_progress)
            timeout = 0.0 if more else max(0.0, min(next_scan, last_progress + c._give_up) - now)
            m = 0
            if c._selector.select(timeout):
                m = c._drain(c._sock, m)
                if c._group_sock is not None:
                    m = c._drain(c._group_sock, m)
            if m and self.process(m):
                last_progress = time.monotonic()

    def give_up(self, waited: float) -> None:
        c = self.c
        detail = (f"rank {c._rank}, round {c._round}: {self.done} of {self.n_chunks} chunks "
                  f"answered, {c.stats['retransmits']} retransmissions")
        if c._last_send_error is not None:
            detail += f"; last send error: {c._last_send_error}"
        raise NoAnswerError(c._server, c._job, waited, detail)

    # -- admission ----------------------------------------------------------------------------
    def admit(self) -> bool:
        """Quantise and send the next chunks the window and the slot rule allow. Returns whether
        more could be admitted right away."""
        c, S, c0 = self.c, self.c._slots, self.next
        k = min(c._window - self.inflight, self.n_chunks - c0, ADMIT_MAX)
        if k <= 0:
            return False
        if c0 + k > S:  # chunk c >= slots waits for chunk c - slots
            start = max(c0, S)
            blocked = self.state[start - S:c0 + k - S] != _DONE
            if blocked.any():
                k = start - c0 + int(np.argmax(blocked))
                if k == 0:
                    return False
        r0 = c0 % S
        first = min(k, self.R - r0)  # the ring may wrap once
        self._fill(c0, first, r0)
        if first < k:
            self._fill(c0 + first, k - first, 0)
        seg = self.state[c0:c0 + k]
        if self.done:  # a result may have come before the contribution left (quorum strategies)
            fresh = seg != _DONE
            self.inflight += int(np.count_nonzero(fresh))
            seg[fresh] = _INFLIGHT
        else:
            self.inflight += k
            seg[:] = _INFLIGHT
        self.sent_at[c0:c0 + k] = time.monotonic()
        self.next = c0 + k
        rec = c._rec
        c._send(c._tx_bytes[r0 * rec:(r0 + first) * rec], first)
        if first < k:
            c._send(c._tx_bytes[0:(k - first) * rec], k - first)
        return self.next < self.n_chunks and self.inflight < c._window and k == ADMIT_MAX

    def _fill(self, c0: int, k: int, r0: int) -> None:
        """Quantise chunks ``c0 .. c0+k-1`` into ring entries ``r0 .. r0+k-1``."""
        E, x = self.E, self.x
        if self.fast_fill:
            c = self.c
            if x.dtype == np.float16:
                xs, xc0 = x[c0 * E:(c0 + k) * E].astype(np.float32), 0
            else:
                xs, xc0 = x, c0
            _fast.fill(xs, xc0, c0, k, E, self.fq, self.jq, c._tx_u8, c._tx_i32, r0,
                       self.flags_dirty)
            return
        src = x[c0 * E:(c0 + k) * E]
        if src.size == k * E:
            block = src.reshape(k, E)
        else:  # the last, partial chunk: pad with zeros
            block = np.zeros((k, E), x.dtype)
            block.reshape(-1)[:src.size] = src
        ring = self.c._tx[r0:r0 + k]
        h = ring["hdr"]
        h["exponent"] = quant._quantise_rows(block, self.c._world, ring["payload"])
        h["chunk"] = np.arange(c0, c0 + k, dtype=np.uint32)
        if self.flags_dirty:
            h["flags"] = 0
        if c0 + k == self.n_chunks:
            h["count"][k - 1] = self.last_count

    # -- loss recovery ------------------------------------------------------------------------
    def retransmit_due(self, now: float) -> None:
        c = self.c
        open_ = np.flatnonzero(self.state[self.lo:self.next] != _DONE)
        if open_.size == 0:
            self.lo = self.next
            return
        self.lo += int(open_[0])
        cand = self.lo + np.flatnonzero(self.state[self.lo:self.next] == _INFLIGHT)
        if cand.size == 0:
            return
        rto = np.minimum(c._rto * np.exp2(self.retries[cand].astype(np.float64)), c._rto_cap)
        due = cand[now - self.sent_at[cand] >= rto]
        if due.size == 0:
            return
        ring = c._tx
        idx = due % c._slots
        ring["hdr"]["flags"][idx] = _RETRANSMIT
        self.flags_dirty = True
        packets = ring[idx]  # contiguous copy of the (few) packets to send again
        c._send(memoryview(packets.view(np.uint8)), due.size)
        c.stats["retransmits"] += int(due.size)
        self.sent_at[due] = now
        self.retries[due] = np.minimum(self.retries[due], 29) + 1

    # -- results ------------------------------------------------------------------------------
    def process(self, m: int) -> int:
        """Handle ``m`` received messages; returns how many chunks got their result."""
        c = self.c
        if self.fast_scatter:
            status, nd, ninf = _fast.scatter(
                c._stage_u8, c._stage_i32, c._sizes, m, c._job, self.round32, self.n_chunks,
                self.E, self.last_count, self.state, self.out, self.mean, c._done_buf)
            if status == _fast.OK:
                self.inflight -= ninf
                self.done += nd
                c.stats["results"] += nd
                c.stats["ignored"] += m - nd
                return nd
            # a NACK or a malformed result: the numpy path below sorts it out (and raises)
        w = c._words[:m]
        sz = c._sizes[:m]
        job_ok = (w[:, 1] & self.job_mask) == (self.w_result[1] & self.job_mask)
        nack = (w[:, 0] == self.w_nack) & job_ok
        if nack.any():
            self.nacks(c._stage[:m]["hdr"][nack & (sz >= HEADER_SIZE)])
        res = (w[:, 0] == self.w_result[0]) & job_ok & (w[:, 2] == self.w_result[2]) \
            & (sz >= HEADER_SIZE)
        idx = np.flatnonzero(res)
        if idx.size == 0:
            c.stats["ignored"] += m
            return 0
        h = c._stage["hdr"]
        ch = h["chunk"][idx].astype(np.int64)
        keep = ch < self.n_chunks
        keep[keep] = self.state[ch[keep]] != _DONE
        if not keep.all():
            idx, ch = idx[keep], ch[keep]
            if idx.size == 0:
                c.stats["ignored"] += m
                return 0
        if idx.size > 1:  # a chunk's result may come twice in a batch; sorted chunks help below
            ch, first = np.unique(ch, return_index=True)
            idx = idx[first]
        c.stats["ignored"] += m - idx.size
        hh = h[idx]
        if (hh["flags"] & _OVERFLOW).any():
            j = int(np.argmax((hh["flags"] & _OVERFLOW) != 0))
            raise AggregationOverflowError(c._server, c._job, c._round, int(ch[j]))
        cnt = hh["count"]
        last = ch[-1] == self.n_chunks - 1
        if (cnt[:-1] != self.E).any() or cnt[-1] != (self.last_count if last else self.E) \
                or (sz[idx] < HEADER_SIZE + 4 * cnt.astype(np.int64)).any():
            raise self.bad_count(ch, cnt, sz[idx], last)
        divisor = None
        if self.mean:
            divisor = hh["n_contrib"].astype(np.float64)
            if (divisor == 0).any():
                raise ProtocolError(f"aggregator {c._server[0]}:{c._server[1]} sent a result "
                                    f"without contributions (n_contrib 0) for job {c._job}")
        vals = quant.dequantise(c._stage["payload"][idx], hh["exponent"], divisor=divisor)
        with np.errstate(over="ignore", invalid="ignore"):  # float16 may overflow to inf
            if ch[-1] < self.n_full:  # ch is sorted: all full chunks
                self.out_full[ch] = vals
            else:
                self.out_full[ch[:-1]] = vals[:-1]
                self.out[self.n_full * self.E:] = vals[-1, :self.last_count]
        self.inflight -= int(np.count_nonzero(self.state[ch] == _INFLIGHT))
        self.state[ch] = _DONE
        self.done += int(ch.size)
        c.stats["results"] += int(ch.size)
        return int(ch.size)

    def bad_count(self, ch, cnt, sizes, last) -> ProtocolError:
        c = self.c
        expect = np.full(ch.size, self.E)
        if last:
            expect[-1] = self.last_count
        j = int(np.argmax((cnt != expect) | (sizes < HEADER_SIZE + 4 * cnt.astype(np.int64))))
        return ProtocolError(
            f"aggregator {c._server[0]}:{c._server[1]} sent a result for job {c._job}, round "
            f"{c._round}, chunk {ch[j]} with count {cnt[j]} in {sizes[j]} bytes; expected "
            f"{expect[j]} values (is the job's packet size {self.E} elements?)")

    def nacks(self, h: np.ndarray) -> None:
        c = self.c
        for rec in h:
            code = int(rec["code"])
            if code == NackCode.UNKNOWN_JOB:
                raise UnknownJobError(c._server, c._job, c._rank, c._address)
            if code == NackCode.NOT_MEMBER:
                raise NotMemberError(c._server, c._job, c._rank, c._address)
            rnd, chunk = int(rec["round"]), int(rec["chunk"])
            where = f"job {c._job}, round {rnd}, chunk {chunk}"
            if code == NackCode.BAD_CHUNK:
                raise ProtocolError(
                    f"aggregator {c._server[0]}:{c._server[1]} refused {where}: chunk beyond the "
                    f"job's max_chunks (this tensor has {self.n_chunks} chunks of {self.E} values)")
            if code == NackCode.STALE:
                if rnd == self.round32 and chunk < self.n_chunks and self.state[chunk] != _DONE:
                    raise ProtocolError(
                        f"aggregator {c._server[0]}:{c._server[1]} refused {where} as stale: the "
                        f"job is past this round (do all members call allreduce in lockstep?)")
                continue  # a late answer to an old retransmission
            raise ProtocolError(f"aggregator {c._server[0]}:{c._server[1]} refused {where} "
                                f"with unknown NACK code {code}")
