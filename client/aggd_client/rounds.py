"""Rounds in flight and their retransmission: what each round holds, how its steps (sends) leave
chunk by chunk under the window and the order rules, and what is sent again when.

* ``_Round``: one round's result as it fills (chunks answered, their ``n_contrib``, the output).
* ``_Send``: one step of a round on its way: a ring of packets (``_Ring``) indexed by
  ``chunk % slots``, per-chunk send state, quantisation into the ring, acknowledgements and the
  per-chunk retransmission timers.
* ``RoundScheduler``: a mixin of ``AggClient`` over all rounds and sends: admits chunks within the
  congestion window and the per-slot order, scans for timeouts, drops finished sends, fails rounds.

Packets leave through the client's transport (``AggClient._send``); answers come back through the
result handling (``results``), which calls ``_Send.ack``.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from . import _fast, quant
from .errors import AggdError
from .flow import QUORUM_STEADY_MAX, TAIL_PROBE_FLOOR, TAIL_PROBE_MAX, TAIL_PROBES
from .protocol.definition import MAGIC, VERSION, ZERO_EXPONENT, Flag, MsgType, Precision, StrategyKind

if TYPE_CHECKING:
    from .client import AggClient
    from .strategy import StrategyInfo

log = logging.getLogger("aggd_client")  # one logger for the whole client, whatever the module

#: Largest admission batch (keeps temporaries small); without GSO, also the packets one sendmmsg
#: carries (``transport``).
ADMIT_MAX = 64
#: The longest a chunk waits between retransmissions (outside ``quorum``), unless
#: ``retransmit_timeout`` is longer.
RTO_CAP = 1.0
#: Rings kept for reuse by the next sends.
RING_POOL = 4

_PENDING, _INFLIGHT, _DONE = 0, 1, 2
#: ``_Round.res_exp`` of a chunk without our own round's result (no exponent is this low)
NOT_OURS = -(1 << 31)
# plain ints: numpy compares against enum members far more slowly
_CONTRIB, _RETRANSMIT, _ORDERED = int(MsgType.CONTRIB), int(Flag.RETRANSMIT), int(Flag.ORDERED)


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
        # per chunk: the exponent of our own round's result (NOT_OURS: a later round's answered it),
        # to which the aggregator aligned our contributions (``realign_residuals``)
        self.res_exp = np.full(n, NOT_OURS, np.int32)
        self.realigned = False
        self.n_have = 0
        self.answered = number
        self.skips: np.ndarray | None = None  # per chunk: the packets' ``skip`` (None: all 0)
        self.info: StrategyInfo | None = None
        self.sends: list[_Send] = []
        self.steps = 0
        # What of ours may be carried into this round (docs/protocol.md, rule 4): our previous
        # round (its later wbsp steps, and its step 0 unless a result proved it in) and our
        # contributions of older rounds that were not answered when that one started
        # (``RoundScheduler._start_round``; ``carried_in``).
        self.prev: _Round | None = None
        self.unresolved = 0
        self.error: BaseException | None = None
        self.fast = self.dtype != np.float16  # numba has no float16
        # sent with Flag.ORDERED: the aggregator keeps this round's results until we hold them
        self.ordered = False

    @property
    def complete(self) -> bool:
        return self.n_have == self.n_chunks

    def realign_residuals(self) -> None:
        """Once the round is complete: every send's residuals take what the aggregator's alignment
        of our contributions to our own round's results dropped (``_Send.realign``). Done once, for
        all chunks together, so that the numba result path serves rounds with residuals too."""
        if self.realigned:
            return
        self.realigned = True
        own = self.res_exp != NOT_OURS
        if self.sends and own.any():
            chunks = np.flatnonzero(own)
            for s in self.sends:
                s.realign(chunks, self.res_exp[chunks])

    def carried_in(self) -> int:
        """How many contributions of ours to earlier rounds the aggregator may have carried, or
        may still carry, into this round (per chunk): rule 4 carries a late one into the next open
        round of its chunk, on top of our own steps there. Counted: every later wbsp step of our
        previous round (none of them is ever proven in it: a release lists step 0 only), its step
        0 unless a result proved it in (a release that waits for every member; a quorum may have
        been released without it, and a round answered by a later one was), and the contributions
        of older rounds still unanswered when our previous round started (answered ones landed
        before it: no round after it opens without our step 0 of it, quorum aside). A wbsp round
        takes at most ``headroom`` minus this many steps, so that no round holds more than
        ``headroom`` terms of one member (what every round is quantised for)."""
        p = self.prev
        if p is None:
            return 0
        proven = p.info is not None and p.info.kind != StrategyKind.QUORUM and p.answered == p.number
        return max(p.steps - 1, 0) + (not proven) + p.unresolved


class _Ring:
    """``size`` contribution packets, built in place and sent from."""

    __slots__ = ("size", "pk", "u8", "i32", "buf")

    def __init__(self, dtype: np.dtype, size: int):
        self.size = size
        self.pk = np.zeros(size, dtype)
        self.u8 = self.pk.view(np.uint8).reshape(size, dtype.itemsize)
        # the numba fill's int32 view (int32 jobs); a narrow packet need not be a whole number of words
        self.i32 = self.u8.view(np.int32) if dtype.itemsize % 4 == 0 else None
        self.buf = memoryview(self.pk.view(np.uint8))


class _Send:
    """One step of a round on its way: the input, a ring of packets, per-chunk send state."""

    def __init__(self, c: AggClient, rnd: _Round, x: np.ndarray, step: int, kind: StrategyKind,
                 residual: np.ndarray | None = None, cap: np.ndarray | None = None):
        self.c, self.rnd, self.x, self.step = c, rnd, x, step
        self.n, self.S, self.E = rnd.n_chunks, c._slots, c._elements
        # headroom for what the result may hold: the job's, fixed, so that a round quantised under one
        # strategy and governed by another (a swap not yet seen) never holds more than that
        self.terms = (c._span * c._headroom if c._headroom is not None else quant.terms_for(c._span, kind))
        self.precision = c._precision
        self.fq, self.jq = quant._q_frexp(c._world, self.terms, self.precision)
        self.qmax = quant.q_max(c._world, self.terms, self.precision)
        self.R = min(self.S, self.n)  # ring entries; chunk c lives at c % slots
        self.ring: _Ring | None = c._take_ring(self.R)
        h = self.ring.pk[:self.R]["hdr"]
        h[...] = 0
        h["magic"], h["version"], h["type"] = MAGIC, VERSION, _CONTRIB
        h["job"], h["rank"], h["round"], h["step"] = c._job, c._rank, rnd.r32, step
        h["contributors"] = c._tag  # contributions carry the member's tag there (docs/protocol.md)
        h["code"] = int(self.precision)  # the payload's Precision
        # once a round of ours had more chunks than slots, every key is admitted only after our
        # earlier rounds' keys of its slot are answered (``_limit``): the aggregator may count
        # our later rounds as proof that we hold those results (Flag.ORDERED, rule 3's ``held``).
        # Under quorum a round starts only once the one before has every result, so that holds
        # too; there a member whose calls have had more than one size says ORDERED as well, and
        # the aggregator then keeps its round's result for it: the chunk's newest may be another
        # tensor's (docs/protocol.md, "Tensors of different sizes").
        self.flags = _ORDERED if c._chunks_sent > self.S or (kind == StrategyKind.QUORUM and c._sizes_differ) else 0
        h["flags"] = self.flags
        rnd.ordered = rnd.ordered or self.flags != 0
        h["count"] = self.E  # the last chunk's entry is corrected when it is admitted
        self.state = np.zeros(self.n, np.uint8)
        self.sent_at = np.zeros(self.n, np.float64)
        self.retries = np.zeros(self.n, np.uint8)
        self.probes = np.zeros(self.n, np.uint8)   # of those retries, tail loss probes
        self.next = 0        # next chunk to admit
        self.lo = 0          # lowest chunk without an answer
        self.open_lo = 0     # lowest chunk without an answer, sent or not (first_open)
        self.inflight = 0
        self.hi_answered = -1  # highest chunk answered: chunks below it still in flight were lost
        self.answered_at = -np.inf  # when an answer last stopped a chunk in flight
        # RACK (RFC 8985): the newest send time among chunks answered on their first send, and
        # that answer's time. A chunk sent before it and still unanswered a reordering window
        # after that answer time was lost (its own packet, its result, or another member's
        # contribution): it is resent then, not after a timeout
        self.rack_sent = -np.inf
        self.rack_rtt = 0.0
        self.flags_dirty = False  # some ring entry carries the RETRANSMIT flag (reset to ``flags``)
        self.dropped = False
        self.last_ack = time.monotonic()
        self.fast_fill = c._fast
        self.fill_args = None  # the numba fill's masks and scratch, for the input's dtype
        # ``residual``: the caller's array receiving x - dequantised contribution; the values and
        # exponents sent are kept to correct it for the aggregator's alignment (``realign``)
        self.residual = residual
        self.keep_q = self.keep_e = None
        if residual is not None:
            self.keep_q = np.zeros((self.n, self.E), c._lanes.contrib)
            self.keep_e = np.zeros(self.n, np.int32)
        # per chunk: the exponent not to exceed (a shared scale, ``aggd_client.scales``; ZERO_EXPONENT:
        # none), and each chunk's own exponent as quantised
        self.cap = np.full(self.n, ZERO_EXPONENT, np.int32) if cap is None else np.asarray(cap, np.int32)
        self.own_e = np.full(self.n, ZERO_EXPONENT, np.int32)

    @property
    def finished(self) -> bool:
        return self.next >= self.n and self.inflight == 0

    def drop(self) -> None:
        if self.ring is not None:
            self.c._give_ring(self.ring)
        self.ring = None
        self.x = None
        self.dropped = True

    def first_open(self) -> int:
        """The lowest chunk not answered yet, sent or not (``n``: none): where slots serve several
        chunk indices, a later round's key of its slot waits for it (``RoundScheduler._limit``)."""
        t = self.open_lo
        if t < self.next:
            open_ = np.flatnonzero(self.state[t:self.next] != _DONE)
            t = self.open_lo = self.next if open_.size == 0 else t + int(open_[0])
        return min(t, self.n)

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
        """Quantise chunks ``c0 .. c0+k-1`` into ring entries ``r0 .. r0+k-1`` (and their residuals)."""
        self._quantise(c0, k, r0)
        if self.residual is not None:
            self._keep(c0, k, r0)

    def _keep(self, c0: int, k: int, r0: int) -> None:
        """Keep what chunks ``c0 .. c0+k-1`` sent (ring entries ``r0 ..``) and write their residuals:
        the value minus the dequantised contribution, in float64."""
        E, x = self.E, self.x
        pk = self.ring.pk[r0:r0 + k]
        q = self.keep_q[c0:c0 + k]
        q[...] = pk["payload"]
        e = self.keep_e[c0:c0 + k]
        e[...] = pk["hdr"]["exponent"]
        sent = quant.dequantise(q, e)  # exact (float64) unless subnormal
        lo, hi = c0 * E, min((c0 + k) * E, x.size)
        r = self.residual[lo:hi]
        r[...] = x[lo:hi].astype(np.float64) - sent.reshape(-1)[:hi - lo]

    def realign(self, chunks: np.ndarray, e_result: np.ndarray) -> None:
        """The round's results of ``chunks`` came with exponents ``e_result``: the aggregator
        aligned our contributions of those chunks to them with an arithmetic right shift (a floor),
        dropping ``q mod 2**shift`` units of our step; that is added to their residuals, which then
        say what the result does not hold of the values (exactly when every contribution is
        floored on its own; an aggregator flooring a partial sum loses up to a step more, which
        no member can see). Chunks not sent yet are skipped."""
        if self.residual is None or self.dropped or chunks.size == 0:
            return
        sent = self.state[chunks] != _PENDING
        chunks, e_r = chunks[sent], np.asarray(e_result, np.int64)[sent]
        e_s = self.keep_e[chunks].astype(np.int64)
        shift = e_s - e_r
        m = (shift > 0) & (e_s != ZERO_EXPONENT)
        if not m.any():
            return
        chunks, e_r, e_s, shift = chunks[m], e_r[m], e_s[m], shift[m]
        q = self.keep_q[chunks].astype(np.int64)
        aligned = q >> np.minimum(shift, 62)[:, None]
        # both exact in float64, and so is their difference ((q mod 2**shift) * 2**-e_s)
        lost = np.ldexp(q.astype(np.float64), -e_s[:, None]) - np.ldexp(aligned.astype(np.float64),
                                                                         -e_r[:, None])
        E, res = self.E, self.residual
        n_full = res.size // E
        full = chunks < n_full
        if full.any():
            block = res[:n_full * E].reshape(n_full, E)
            block[chunks[full]] += lost[full]  # chunks are distinct
        if not full.all():
            j = int(np.flatnonzero(~full)[0])
            tail = res[n_full * E:]
            tail += lost[j, :tail.size]

    def _quantise(self, c0: int, k: int, r0: int) -> None:
        E, x, ring = self.E, self.x, self.ring
        if self.fast_fill:
            if x.dtype == np.float16:
                xs, xc0 = x[c0 * E:(c0 + k) * E].astype(np.float32), 0
            else:
                xs, xc0 = x, c0
            if self.fill_args is None:
                self.fill_args = _fast.fill_args(xs.dtype)
            absmask, pick_b, pick_f = self.fill_args
            if self.precision == Precision.INT32:
                _fast.fill(xs, xs.view(pick_b.dtype), absmask, pick_b, pick_f, xc0, c0, k, E, self.fq,
                           self.jq, ring.u8, ring.i32, r0, self.flags if self.flags_dirty else -1,
                           self.cap, self.own_e)
            else:
                _fast.fill_narrow(xs, xs.view(pick_b.dtype), absmask, pick_b, pick_f, xc0, c0, k, E, self.fq,
                                  self.jq, ring.u8, ring.u8.view(self.c._lanes.contrib), r0,
                                  self.flags if self.flags_dirty else -1, self.qmax,
                                  self.c._rng_state, self.cap, self.own_e)
            return
        src = x[c0 * E:(c0 + k) * E]
        if src.size == k * E:
            block = src.reshape(k, E)
        else:  # the last, partial chunk: pad with zeros
            block = np.zeros((k, E), x.dtype)
            block.reshape(-1)[:src.size] = src
        pk = ring.pk[r0:r0 + k]
        h = pk["hdr"]
        h["exponent"] = quant._quantise_rows(block, self.c._world, pk["payload"], self.terms,
                                             self.precision, self.c._rng, self.cap[c0:c0 + k],
                                             self.own_e[c0:c0 + k])
        h["chunk"] = np.arange(c0, c0 + k, dtype=np.uint32)
        if self.flags_dirty:
            h["flags"] = self.flags
        if c0 + k == self.n:
            h["count"][k - 1] = self.rnd.last_count

    # -- answers and loss recovery ------------------------------------------------------------
    def ack(self, chunks: np.ndarray, now: float) -> int:
        """Chunks answered (repeats allowed): those in flight stop being retransmitted. Returns
        how many. The longest answer time among those sent once feeds the timeout estimate."""
        c = self.c
        if c._fast:
            out = c._ack_out
            n = _fast.ack(self.state, chunks, chunks.size, self.sent_at, self.retries, now, self.rack_sent, out)
            longest, once, newest = out[0], int(out[1]), out[2]
        else:
            hit = chunks[self.state[chunks] == _INFLIGHT]
            if hit.size > 1:
                hit = np.unique(hit)
            self.state[hit] = _DONE
            n = int(hit.size)
            first = self.sent_at[hit[self.retries[hit] == 0]]
            newest = float(first.max()) if first.size else -np.inf
            timed = first[first >= self.rack_sent]
            once = timed.size
            longest = now - float(timed.min()) if once else 0.0
        if chunks.size:
            self.hi_answered = max(self.hi_answered, int(chunks.max()))
        if n:
            self.inflight -= n
            self.last_ack = self.answered_at = now
            if once:
                c._rtt.sample(longest, now)
            if newest > self.rack_sent:
                self.rack_sent, self.rack_rtt = newest, now - newest
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
        retries, probes = self.retries[cand], self.probes[cand]
        # tail loss probes do not back the timer off: probed while the round waits for a slow
        # member, a chunk would otherwise wait 8 timeouts once that member comes
        rto = np.minimum(c._rtt.rto * np.exp2((retries - probes).astype(np.float64)), cap)
        late = now - self.sent_at[cand] >= rto
        if c._strategy.kind != StrategyKind.QUORUM:
            # As TCP restarts its timer on every new acknowledgement (RFC 6298, 5.3): while
            # answers come, a chunk times out only once answers to later chunks have passed it
            # (lost); one they have not reached is waiting for a slow member. (Quorum rounds
            # keep per-chunk timers: their retransmissions are the clock of the deadline.)
            late &= (cand < self.hi_answered) | (now - self.answered_at >= rto)
        # RACK: sent before a chunk that was answered, and a reordering window past that answer's
        # time. (Under quorum too: there it also resends a chunk a shared slot refused `busy` once
        # the members of a later chunk of that slot have freed its bank.)
        sent = self.sent_at[cand]
        late |= (sent < self.rack_sent) & (now - sent >= self.rack_rtt + (c._rtt.srtt or 0.0) / 4)
        probe = None
        if cand.size <= TAIL_PROBE_MAX and c._rtt.srtt is not None:
            # tail loss probes: the last few chunks in flight, after every other answer came, are
            # resent two answer times after the last answer, then after twice that, up to
            # TAIL_PROBES times (each member probes its own: a chunk waits for every member's)
            pto = np.minimum(max(2 * c._rtt.srtt, TAIL_PROBE_FLOOR) * np.exp2(probes.astype(np.float64)), rto)
            probe = ~late & (probes < TAIL_PROBES) & (now - sent >= pto) & (now - self.answered_at >= pto)
            late |= probe
        due = cand[late]
        if due.size == 0:
            return
        if probe is not None:
            self.probes[cand[probe]] += 1
        first = due[retries[late] == 0]
        if first.size and int(first[0]) < self.hi_answered and c._rtt.queueing:
            # a first timeout of a chunk the answers have passed by: the path dropped it (a
            # timeout with nothing later answered is the round waiting for a slow member), and
            # answers show a queue (a loss at short answer times is the link's, not the window's)
            c._cwnd.lost(now, c._rtt.srtt or c._rtt.rto)
        pk = self.ring.pk
        idx = due % self.S
        pk["hdr"]["flags"][idx] = _RETRANSMIT | self.flags
        self.flags_dirty = True
        packets = pk[idx]  # contiguous copy of the (few) packets to send again
        c._send(memoryview(packets.view(np.uint8)), due.size)
        c.stats["retransmits"] += int(due.size)
        self.sent_at[due] = now
        self.retries[due] = np.minimum(self.retries[due], 29) + 1


class RoundScheduler:
    """The rounds and sends of ``AggClient`` (see the module's docstring)."""

    def _init_rounds(self) -> None:
        self._rounds: list[_Round] = []
        self._sends: list[_Send] = []
        self._ring_pool: list[_Ring] = []
        self._last_round: _Round | None = None   # our newest round with something sent

    def _start_round(self, rnd: _Round) -> None:
        """``rnd`` becomes our newest round: in flight from now on. It records what of ours may be
        carried into it (``_Round.carried_in``): our previous round and the sends still on their
        way; only one round back is kept."""
        prev = self._last_round
        rnd.prev = prev
        rnd.unresolved = sum(1 for s in self._sends if not s.finished)
        if prev is not None:
            prev.prev = None
        self._last_round = rnd
        self._rounds.append(rnd)

    # -- failing ------------------------------------------------------------------------------
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
        unsent chunk of an earlier round (keys grow per slot), or, once a round of ours had more
        chunks than slots, an unanswered one (a slot then serves several chunk indices and its
        order test knows only a chunk's own rounds still in its banks: a later key arriving first
        would open and leave that one late, carried for good), or, for an earlier step of the same
        round, a chunk that step has not sent yet."""
        limit, S = s.n, self._slots
        shared = self._chunks_sent > S
        for p in self._sends[:i]:
            if p.rnd is s.rnd:
                if p.next < p.n:
                    limit = min(limit, p.next)
                continue
            start = p.next
            if shared and not p.rnd.complete:   # (a complete round's keys have all opened)
                start = min(start, p.first_open())
            left = p.n - start
            if left <= 0:
                continue
            if left >= S:  # every slot still has a chunk of p to send or to hear about
                return s.next
            d = (s.next - start) % S  # p's chunks from start cover slots start % S .. + left - 1
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
        cap = self._rto_cap
        if self._strategy.kind == StrategyKind.QUORUM:
            cap = self._quorum_cap
            if sum(s.inflight for s in self._sends) <= QUORUM_STEADY_MAX:
                cap = min(self._rtt.rto, cap)     # no doubling for a few chunks (flow.QUORUM_STEADY_MAX)
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
