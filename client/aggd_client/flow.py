"""How long to wait before a retransmission and how much to keep in flight: the client's two
feedback loops, kept apart from the packet handling so they can be tested alone.

``RtoEstimator`` is RFC 6298's smoothed round-trip time and variance, fed with the answer times
of chunks sent once (Karn's rule: a retransmitted chunk's answer time says nothing). A result
comes back only when every member has contributed the chunk, so the "round trip" includes waiting
for the slowest member: on a host whose cores are shared by the workers, the aggregator and the
bridge it is several times the network's. A fixed timeout below it resends most of a large tensor
(each duplicate costs the aggregator and the other members the same work as a first copy).

``CongestionWindow`` is additive-increase / multiplicative-decrease over chunks in flight (slow
start up to the first loss): every queue between a worker and the aggregator (socket buffers,
the per-CPU backlog a veth feeds, the XDP ring) drops what overflows, and a window larger than
they hold turns into losses and retransmission timeouts. Only a timeout with evidence of loss
cuts it (the caller decides: answers to chunks sent after the timed-out one have come, so the
results stream passed it by); a timeout while nothing later is answered either is the round
waiting for its slowest member, which a smaller window would not hasten. And only while answer
times show a queue (``RtoEstimator.queueing``: well above the shortest recent one): a queue that
overflows fills first, while a lossy link drops at short answer times, where halving the window
for every loss held a 5%-loss lab at the floor (16 chunks in flight) and took 5x the lossless time.

``default_window`` bounds the window by bytes (``MAX_INFLIGHT_BYTES``), and the members' windows
together by packets (``MAX_INFLIGHT_PACKETS``, the aggregator's receive queue). Where the path is the
host's CPU (every hop of a lab, and the aggregator's cores on a real one), chunks beyond what
keeps it busy only queue. They lengthen every answer time (a 4096-chunk window of 832-value
packets, 14 MiB a worker, measured 150-460 ms answer times), let the fastest member run that far
ahead of the slowest (the timeouts of everyone else's chunks fire while the slowest catches up:
duplicates the aggregator drops) and push the packets in flight out of the caches.
"""
from __future__ import annotations

import math

#: RFC 6298's gains.
ALPHA = 1 / 8
BETA = 1 / 4
#: Chunks in flight at the start (one GSO batch) and never fewer than this.
INITIAL_WINDOW = 64
MIN_WINDOW = 16
#: Chunks tail loss probes resend at most: the last chunks in flight (a round's, or a small window's:
#: 19 chunks on 4 slots at 5% loss went from 0.4 s a round to 0.05), unanswered after every other
#: answer came, are probed two smoothed answer times after the last answer instead of a timeout
#: (RACK-TLP, RFC 8985: nothing sent later can reveal their loss). More than this still open
#: is the window waiting for a slow member, not a loss.
TAIL_PROBE_MAX = 16
#: The shortest wait before a tail loss probe (seconds; the progress loop scans every 1 ms at best).
TAIL_PROBE_FLOOR = 0.002
#: Probes a tail chunk gets, each after twice the wait of the one before (then its timeout rules):
#: a probe is lost as its first send was (one probe, as TCP sends, left 5%-loss rounds waiting for
#: 50 ms timeouts: 6.7x the lossless time against 2x with three).
TAIL_PROBES = 3
#: Under ``quorum``, a member with at most this many chunks in flight resends each every timeout,
#: without doubling (at most ``max_retransmit_interval`` apart): few chunks cost little, and a
#: chunk a shared slot refused ``busy`` is taken as soon as its bank frees (19 chunks on 4 slots at
#: 5% loss: 1.8 s a round with doubling, 0.6 s without). More are a round waiting for its slowest
#: members (a DDP bucket of 1377 chunks): those double, as elsewhere.
QUORUM_STEADY_MAX = 64
#: A loss cuts the window only where answers take this much longer than the shortest recent one
#: (a queue has formed: the window is too large for a queue somewhere); a loss at short answer
#: times is the path's (a lossy link), which a smaller window would not cure.
QUEUE_DELAY_FACTOR = 2.0
#: How long the shortest answer time is remembered (a path that got slower for good is learnt).
MIN_RTT_WINDOW = 10.0
#: Packet bytes a worker keeps in flight by default: half its socket buffers (the client asks
#: for 16 MiB, the kernel doubles it), about 5,000 packets of 832 values (more than the default
#: 4096 slots), 510 of 8,192. 4 MiB left a lab's two cores idle 40% of a 4-worker 64 MiB round
#: (everyone waiting for the member that was off the CPU); 16 MiB keeps them busy.
MAX_INFLIGHT_BYTES = 16 << 20
#: Packets all of a job's members keep in flight by default, together: every member's window lands
#: on the aggregator's one receive queue at once (incast), and every chunk's result on each member.
#: At MTU 1500 16 MiB is 11,300 packets a member; 8 members' windows of the default 4096 slots
#: overflowed the lab's 10,000-packet backlog in bursts (16,038 retransmissions in a 64 MiB
#: allreduce against 354 with 1,024 a member, 4% slower; docs/benchmarks.md has the other pairs).
#: A NIC's receive ring holds 1,024-8,192 frames.
MAX_INFLIGHT_PACKETS = 8192


def default_window(slots: int, packet_bytes: int, members: int = 1) -> int:
    """Chunks in flight when the caller does not say: the job's slots, at most
    ``MAX_INFLIGHT_BYTES`` of packets of ``packet_bytes`` and a ``members``-th share of
    ``MAX_INFLIGHT_PACKETS`` (never fewer than ``MIN_WINDOW``)."""
    share = min(MAX_INFLIGHT_BYTES // max(1, int(packet_bytes)), MAX_INFLIGHT_PACKETS // max(1, int(members)))
    return max(1, min(int(slots), max(MIN_WINDOW, share)))


class RtoEstimator:
    """``rto``: ``srtt + 4 * rttvar`` from the samples so far, never below ``floor`` nor above
    ``cap``; ``initial`` (clamped alike) before the first sample."""

    __slots__ = ("floor", "cap", "srtt", "rttvar", "_rto", "min_rtt", "_min_at", "_samples")

    def __init__(self, initial: float, floor: float, cap: float):
        if not 0 < floor <= cap:
            raise ValueError(f"need 0 < floor <= cap, got floor {floor}, cap {cap}")
        self.floor, self.cap = float(floor), float(cap)
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._rto = min(max(float(initial), self.floor), self.cap)
        #: the shortest answer time of the last ``MIN_RTT_WINDOW`` seconds (None before any)
        self.min_rtt: float | None = None
        self._min_at = 0.0
        self._samples = 0

    @property
    def rto(self) -> float:
        return self._rto

    def sample(self, rtt: float, now: float = 0.0) -> float:
        """Feed one answer time (seconds, of a chunk sent once) taken at ``now``; returns the new
        ``rto``."""
        if not 0 <= rtt < math.inf:
            # a clock step, or a chunk whose send time was cleared to make it due at once
            # (``hurry``): it says nothing about the path
            return self._rto
        self._samples += 1
        if self.min_rtt is None or rtt <= self.min_rtt or now - self._min_at > MIN_RTT_WINDOW:
            self.min_rtt, self._min_at = rtt, now
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = (1 - BETA) * self.rttvar + BETA * abs(self.srtt - rtt)
            self.srtt = (1 - ALPHA) * self.srtt + ALPHA * rtt
        self._rto = min(max(self.srtt + 4 * self.rttvar, self.floor), self.cap)
        return self._rto

    @property
    def queueing(self) -> bool:
        """Whether answers now take ``QUEUE_DELAY_FACTOR`` times the shortest recent one or more
        (True before enough samples to tell: a loss then is taken as congestion, as TCP does)."""
        if self.srtt is None or self.min_rtt is None or self._samples < 8:
            return True
        return self.srtt >= QUEUE_DELAY_FACTOR * self.min_rtt


class CongestionWindow:
    """Chunks a worker may have in flight: ``size`` (an int for the sender) between ``MIN_WINDOW``
    (or ``limit`` if smaller) and ``limit`` (the job's slots, or the caller's window)."""

    __slots__ = ("limit", "floor", "_size", "ssthresh", "_last_cut")

    def __init__(self, limit: int, initial: int = INITIAL_WINDOW):
        if limit < 1:
            raise ValueError(f"window limit must be at least 1, got {limit}")
        self.limit = int(limit)
        self.floor = min(MIN_WINDOW, self.limit)
        self._size = float(min(max(initial, self.floor), self.limit))
        self.ssthresh = float(self.limit)
        self._last_cut = float("-inf")

    @property
    def size(self) -> int:
        return int(self._size)

    def acked(self, n: int) -> None:
        """``n`` chunks in flight were answered: one more chunk per answer in slow start, one more
        per window's worth of answers after it."""
        if n <= 0:
            return
        if self._size < self.ssthresh:
            self._size = min(self._size + n, self.ssthresh)
        else:
            self._size += n / self._size
        self._size = min(self._size, float(self.limit))

    def lost(self, now: float, rtt: float) -> bool:
        """A chunk was lost (its first timeout fired and later chunks were answered): halve the
        window, at most once per ``rtt`` (the losses of one window are one congestion event).
        Whether it cut."""
        if now - self._last_cut < rtt:
            return False
        self._last_cut = now
        self._size = self.ssthresh = max(float(self.floor), self._size / 2)
        return True
