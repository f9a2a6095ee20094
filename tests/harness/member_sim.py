"""Simulated members driving the reference model: a discrete-event run of ``world`` workers that
follow the client's rules (aggd_client: admission per strategy, wbsp steps, acknowledgements,
retransmission, hurrying later steps when a round completes, quorum catch-up, ``skip``) over a
network with random delays and losses, while the strategy is hot-swapped at random rounds.

Pure Python and deterministic for a seed: no sockets, no clock. It runs on the reference model
alone (``ModelPlane``) or on a side-by-side harness that compares a data plane with it
(tests/bpf/test_model_equivalence.py). Every contribution of member
``r`` carries the value 1 in payload element ``r`` and ``Q = q_max(world, terms)`` (the largest
value the client's quantisation lets a term have, at exponent 0) in the last element, so a released
sum says exactly how many terms of each member it holds, and it overflows int32 exactly when it
holds more terms than the job quantises for. (``admission`` is the client's rule for a new round or
a step, the thing under test; ``client_admission`` below is what ``AggClient._admission`` does.)
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import numpy as np

from aggd.core.model import AggregatorModel, JobConfig, TableEntry, Verdict, check_table
from aggd.core.strategy import StrategyTable, parse
from aggd.testing.frames import worker_addr
from aggd_client import quant
from aggd_client.client import AggClient
from aggd_client.protocol import Flag, Header, MsgType, StrategyKind
from aggd_client.rounds import RoundScheduler, _Round
from aggd_client.strategy import StrategyInfo

from tests.fixtures.scenarios import GROUP, JOB, tag

ELEMENTS = 8
MS = 1_000_000
PENDING, INFLIGHT, DONE = 0, 1, 2
STRATEGIES = ("sync", "quorum:3:20ms", "ssp:2", "wbsp", "async")


def addr(rank: int) -> tuple[str, int]:
    """A member's address: the fixture workers' (tests/harness/equivalence.py's ``member``)."""
    return worker_addr(rank)[1:]


class ModelPlane:
    """The reference model alone, with the interface of the side-by-side harnesses
    (tests/harness/xdp_model.py ``Harness``: ``start``, ``set_strategy``, ``send``, ``model``), which
    a simulation can be given instead to compare a data plane with the model on its traffic."""

    def __init__(self, elements: int = ELEMENTS) -> None:
        self.elements = elements

    def start(self, world: int, slots: int, max_chunks: int, entries: list[TableEntry]) -> None:
        members = {r: addr(r) for r in range(world)}
        self.model = AggregatorModel(self.elements)
        self.model.add_job(JobConfig(job=JOB, world=world, slots=slots, max_chunks=max_chunks, members=members,
                                     tags={r: tag(r) for r in members}, group=GROUP))
        self.set_strategy(entries)

    def set_strategy(self, entries: list[TableEntry]) -> None:
        self.model.set_strategy(JOB, entries)

    def send(self, data: bytes, src: tuple[str, int], now_ns: int, where: str = "") -> Verdict:
        return self.model.process(data, src, now_ns)


@dataclass
class SimSend:
    rnd: _Round
    step: int
    state: list[int]
    sent_at: list[int]
    retries: list[int]
    last_ack: int = 0
    ordered: bool = False    #: Flag.ORDERED: a round of the member had more chunks than slots, or quorum with several sizes

    @property
    def finished(self) -> bool:
        return all(s == DONE for s in self.state)


class Member:
    """One worker: the client's state for what matters to the slot rules. Rounds are the client's
    own ``_Round`` objects, and admission is ``AggClient._admission`` itself (called on this
    object: it reads ``_rounds`` and ``_strategy``), unless the simulation is given another rule."""

    def __init__(self, sim: "Sim", rank: int, compute_ns: int):
        self.sim, self.rank, self.compute_ns = sim, rank, compute_ns
        self._strategy = StrategyInfo()
        self.strategy_round = -1
        self._next_round = 0
        self._rounds: list[_Round] = []
        self._sends: list[SimSend] = []
        self._last_round: _Round | None = None
        self.chunk_last = [-1] * sim.chunks
        self._new_chunks_round = -1     # the client's: every chunk index is new in its first round
        self.chunks_sent = 0            # the client's ``_chunks_sent``: the most chunks a round of ours had
        self.first_k: int | None = None     # chunks of our first round
        self.sizes_differ = False       # the client's ``_sizes_differ``: a round of ours had another size
        self.seen_quorum: dict[int, set] = {}
        self.blocked = False
        self.done = False
        self.calls = 0

    @property
    def rounds(self) -> list[_Round]:
        return self._rounds

    @property
    def sends(self) -> list[SimSend]:
        return self._sends

    # -- admission (the client's rule) ---------------------------------------------------------
    def admission(self):
        return self.sim.admission(self)

    def start_round(self, rnd: _Round) -> None:
        start = getattr(RoundScheduler, "_start_round", None)
        if start is not None:
            start(self, rnd)
        else:                       # a client that keeps no account of carries
            self._rounds.append(rnd)

    def call(self, now: int) -> None:
        """An allreduce call: a new round, a wbsp step of the outstanding round, or wait."""
        if self._next_round >= self.sim.rounds:
            self.done = True
            return
        into = self.admission()
        if into is None:
            self.blocked = True
            return
        self.blocked = False
        if into is True:
            self.catch_up()
            n = self._next_round
            k = self.sim.chunks_of(n)
            self.first_k = k if self.first_k is None else self.first_k
            self.sizes_differ = self.sizes_differ or k != self.first_k
            skips = [max(0, n - self.chunk_last[c] - 1) for c in range(k)]
            for c in range(k):
                self.chunk_last[c] = n
            if self._new_chunks_round < 0:
                self._new_chunks_round = n
            self.chunks_sent = max(self.chunks_sent, k)
            E = self.sim.elements
            rnd = _Round(n, (k * E,), np.float32, k * E, E, False)
            rnd.skips = skips
            self._next_round += 1
            self.start_round(rnd)
        else:
            rnd = into
        k = rnd.n_chunks
        send = SimSend(rnd, rnd.steps, [PENDING] * k, [now] * k, [0] * k, now,
                       ordered=self.chunks_sent > self.sim.slots
                       or (self._strategy.kind == StrategyKind.QUORUM and self.sizes_differ))
        rnd.ordered = rnd.ordered or send.ordered
        rnd.steps += 1
        rnd.sends.append(send)
        self.sends.append(send)
        self.sim.top_round = max(self.sim.top_round, rnd.number)
        self.pump(now)
        self.calls += 1
        self.sim.schedule(now + self.sim.compute(self), "compute", self.rank)

    # -- sending (the client's order rules, RoundScheduler._limit and _Send.admit) -------------
    def pump(self, now: int) -> None:
        """Send every chunk the order rules let go: chunk ``c + slots`` once chunk ``c`` of its
        send is answered; no key of a slot before an earlier round's unsent one there, nor, once
        slots serve several chunk indices, before its unanswered one; no step's chunk before the
        earlier step of its round sent it."""
        S = self.sim.slots
        shared = self.chunks_sent > S
        for i, s in enumerate(self.sends):
            for c in range(s.rnd.n_chunks):
                if s.state[c] != PENDING or (c >= S and s.state[c - S] != DONE):
                    continue
                if any(self._holds_back(p, s, c, shared) for p in self.sends[:i]):
                    continue
                s.state[c], s.sent_at[c] = INFLIGHT, now
                self.sim.to_aggregator(self, s.rnd, s, c, now, retransmit=False)

    def _holds_back(self, p: SimSend, s: SimSend, c: int, shared: bool) -> bool:
        if p.rnd is s.rnd:
            return p.state[c] == PENDING
        S = self.sim.slots
        return any(p.state[x] == PENDING or (shared and not p.rnd.complete and p.state[x] != DONE)
                   for x in range(c % S, p.rnd.n_chunks, S))

    # -- results -----------------------------------------------------------------------------
    def on_result(self, hdr: Header, now: int) -> None:
        kind = StrategyKind(hdr.strategy)
        reread = bool(hdr.flags & Flag.REREAD)
        if hdr.flags & Flag.OVERFLOW:
            self.sim.overflows.append((self.rank, hdr.round, hdr.chunk, hdr.n_contrib))
        for rnd in list(self.rounds):
            own = hdr.round == rnd.number
            later = kind == StrategyKind.QUORUM and reread and hdr.round > rnd.number
            if not (own or later) or hdr.chunk >= rnd.n_chunks:
                continue
            if later and rnd.ordered and not self.sim.uniform and not rnd.have[hdr.chunk]:
                continue    # the aggregator keeps our round's own result: a later one may be another tensor's
            partial = kind in (StrategyKind.QUORUM, StrategyKind.WBSP, StrategyKind.ASYNC)
            lists_us = own and (not partial or hdr.contributors >> self.rank & 1)
            for s in rnd.sends:
                if reread or (lists_us and s.step == 0):
                    if s.state[hdr.chunk] == INFLIGHT:
                        s.state[hdr.chunk] = DONE
                        s.last_ack = now
            if not rnd.have[hdr.chunk]:
                rnd.have[hdr.chunk] = 1
                rnd.n_have += 1
                self.learn(rnd, hdr)
                if rnd.complete:
                    for s in rnd.sends:
                        s.last_ack = now
                        if s.step > 0:      # hurry: ask at once while the bank exists
                            for c in range(rnd.n_chunks):
                                if s.state[c] == INFLIGHT:
                                    s.sent_at[c] = -10**15
        if kind == StrategyKind.QUORUM:
            self.chunk_last[hdr.chunk] = max(self.chunk_last[hdr.chunk], hdr.round)
            if not self.sim.uniform:
                pass                # rounds hold different tensors: keep our own order
            elif reread:
                self._next_round = max(self._next_round, hdr.round + 1)
            else:
                if hdr.round >= self._next_round - 1:
                    self.seen_quorum.setdefault(hdr.round, set()).add(hdr.chunk)
                self.catch_up()
        self.pump(now)
        self.tidy()
        if self.blocked and not self.done:
            self.call(now)

    def learn(self, rnd: _Round, hdr: Header) -> None:
        """``ResultHandler._learn``: what answered the round, and the strategy in force."""
        info = StrategyInfo(StrategyKind(hdr.strategy), hdr.param, hdr.strategy_version)
        if rnd.info is None or hdr.round >= rnd.answered:
            rnd.answered, rnd.info = max(rnd.answered, hdr.round), info
        if hdr.round >= self.strategy_round:
            self._strategy, self.strategy_round = info, hdr.round

    def catch_up(self) -> None:
        seen = self.seen_quorum
        if not seen:
            return
        target = max(seen)
        whole = [r for r, cs in seen.items() if len(cs) >= self.sim.chunks]
        if whole:
            target = max(target, max(whole) + 1)
        self._next_round = max(self._next_round, target)
        for r in [r for r in seen if r < self._next_round - 1]:
            del seen[r]

    def tidy(self) -> None:
        for s in [s for s in self.sends if s.finished]:
            self.sends.remove(s)
            s.rnd.sends.remove(s)
        self._rounds = [r for r in self._rounds if not (r.complete and not r.sends)]

    def scan(self, now: int) -> None:
        """Retransmission timers (and giving up on answers to a finished round)."""
        sim = self.sim
        for s in list(self.sends):
            if s.rnd.complete and now - s.last_ack >= sim.give_up_ns:
                self.sends.remove(s)
                s.rnd.sends.remove(s)
                continue
            for c in range(s.rnd.n_chunks):
                if s.state[c] != INFLIGHT:
                    continue
                rto = min(sim.rto_ns << min(s.retries[c], 5), sim.rto_cap_ns)
                if now - s.sent_at[c] >= rto:
                    s.sent_at[c] = now
                    s.retries[c] += 1
                    sim.to_aggregator(self, s.rnd, s, c, now, retransmit=True)
        self.pump(now)          # (a send given up on may have held chunks back)
        self.tidy()
        if self.blocked and not self.done:
            self.call(now)


def client_admission(m: Member):
    """The client's: True (a new round), a round (a wbsp step), None (wait)."""
    return AggClient._admission(m, None)


def unbounded_admission(m: Member):
    """The client's rule before it counted carries: up to 4 steps a wbsp round, whatever the
    previous round's late steps."""
    waiting = [r for r in m.rounds if not r.complete]
    info = m._strategy
    if len(waiting) < info.max_outstanding:
        return True
    if info.kind == StrategyKind.WBSP and len(waiting) == 1 and waiting[0].steps < 4:
        return waiting[0]
    return None


@dataclass
class Release:
    round: int
    chunk: int
    kind: StrategyKind
    n_contrib: int
    per_member: tuple[int, ...]
    overflow: bool


class Sim:
    """``world`` members (the last one ``slow`` times slower), ``chunks`` chunks a round on
    ``slots`` slots (default one a chunk), the strategy swapped every ``swap_every`` rounds to a
    random one of ``strategies``."""

    def __init__(self, seed: int, *, world: int = 4, chunks: int = 3, rounds: int = 120,
                 headroom: int = 4, slow: float = 2.0, loss: float = 0.02, loss_down: float | None = None, swap_every: int = 12,
                 strategies=STRATEGIES, start: str = "sync", admission=client_admission,
                 compute_ms: float = 8.0, jitter: float = 0.5, delay_ms: float = 0.3, plane=None,
                 slots: int | None = None, sizes: tuple[int, ...] = ()):
        self.seed, self.rng = seed, random.Random(seed)
        # ``sizes``: chunks of each round in turn (tensors of several sizes), else ``chunks`` each
        self.sizes = tuple(sizes) or (chunks,)
        self.uniform = len(set(self.sizes)) == 1   # else members keep their order (catch_up=False)
        chunks = max(self.sizes)
        self.world, self.chunks, self.rounds, self.headroom = world, chunks, rounds, headroom
        self.slots = chunks if slots is None else slots
        self.terms = world * headroom
        self.q = quant.q_max(world, self.terms)
        self.loss, self.swap_every, self.strategies = loss, swap_every, strategies
        self.loss_down = loss if loss_down is None else loss_down
        self.admission = admission
        self.jitter, self.delay_ns = jitter, int(delay_ms * MS)
        self.rto_ns, self.rto_cap_ns, self.give_up_ns = 5 * MS, 40 * MS, 300 * MS
        self.plane = ModelPlane() if plane is None else plane
        self.elements = self.plane.elements
        self.table = StrategyTable(parse(start))
        self.plane.start(world, self.slots, 1 << 16, check_table(self.table.table_entries()))
        self.model = self.plane.model
        self.model.on_release = self._released
        self.releases: list[Release] = []
        self.overflows: list[tuple] = []
        self.swaps: list[tuple[str, int]] = []
        self.top_round = -1
        self.events: list = []
        self.seq = 0
        self.link_free = {}          # FIFO per (direction, rank): delivery times never go back
        self.members = [Member(self, r, int(compute_ms * MS * (slow if r == world - 1 else 1.0)))
                        for r in range(world)]
        self.next_swap = swap_every

    # -- plumbing ----------------------------------------------------------------------------
    def chunks_of(self, round_: int) -> int:
        return self.sizes[round_ % len(self.sizes)]

    def schedule(self, t: int, what: str, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, what, args))

    def compute(self, m: Member) -> int:
        return int(m.compute_ns * (1 + self.rng.uniform(-self.jitter, self.jitter)))

    def _link(self, key, now: int) -> int | None:
        if self.rng.random() < (self.loss if key[0] == "up" else self.loss_down):
            return None
        t = max(now + int(self.delay_ns * self.rng.expovariate(1.0)) + 1, self.link_free.get(key, 0))
        self.link_free[key] = t
        return t

    def to_aggregator(self, m: Member, rnd: SimRound, send: SimSend, chunk: int, now: int,
                      retransmit: bool) -> None:
        payload = np.zeros(self.elements, "<i4")
        payload[m.rank] = 1
        payload[-1] = self.q
        hdr = Header(type=MsgType.CONTRIB, job=JOB, rank=m.rank, round=rnd.number, chunk=chunk,
                     contributors=tag(m.rank), count=self.elements, step=send.step, exponent=0, skip=min(rnd.skips[chunk], 0xFFFF),
                     flags=(Flag.RETRANSMIT if retransmit else 0) | (Flag.ORDERED if send.ordered else 0))
        t = self._link(("up", m.rank), now)
        if t is not None:
            self.schedule(t, "agg", hdr.pack() + payload.tobytes(), m.rank)

    def _released(self, job: int, bank, cause: str) -> None:
        v = bank.values
        self.releases.append(Release(bank.key[0], bank.key[1], StrategyKind(bank.kind), bank.n_contrib,
                                     tuple(int(x) for x in v[:self.world]),
                                     bool(v[-1] > (1 << 31) - 1)))

    def _maybe_swap(self) -> None:
        if self.top_round < self.next_swap:
            return
        self.next_swap += self.swap_every
        text = self.rng.choice([s for s in self.strategies if s != str(self.table.entries[-1][2])])
        version = self.table.entries[-1][0] + 1
        first = max(self.table.entries[-1][1] + 1, self.top_round + 8)
        self.table.install(version, first, parse(text))
        self.plane.set_strategy(check_table(self.table.table_entries()))
        self.swaps.append((text, first))

    # -- the run -----------------------------------------------------------------------------
    def run(self, until_ms: float = 60_000) -> "Sim":
        for m in self.members:
            self.schedule(self.compute(m), "compute", m.rank)
        for m in self.members:
            self.schedule(MS, "scan", m.rank)
        end = int(until_ms * MS)
        while self.events:
            t, _, what, args = heapq.heappop(self.events)
            if t > end:
                break
            now = t + 1_000_000_000   # the data plane's clock must not be 0
            if what == "compute":
                self.members[args[0]].call(t)
            elif what == "scan":
                m = self.members[args[0]]
                m.scan(t)
                if not (m.done and not m.sends):
                    self.schedule(t + MS, "scan", m.rank)
            elif what == "agg":
                data, rank = args
                v = self.plane.send(data, addr(rank), now, f"seed {self.seed} at {t} ns, swaps {self.swaps}")
                self._maybe_swap()
                if v.action == "tx" and v.out is not None and v.header.type == MsgType.RESULT:
                    dests = range(self.world) if v.dest == "group" else [rank]
                    for r in dests:
                        t2 = self._link(("down", r), t)
                        if t2 is not None:
                            self.schedule(t2, "member", v.out, r)
            elif what == "member":
                data, rank = args
                self.members[rank].on_result(Header.unpack(data), t)
        return self

    # -- what the run shows ------------------------------------------------------------------
    def over_headroom(self) -> list[Release]:
        """Released results holding more terms of one member than the quantisation allows."""
        return [r for r in self.releases if max(r.per_member) > self.headroom]

    def over_terms(self) -> list[Release]:
        """Released results holding more terms than the job quantises for (they overflow)."""
        return [r for r in self.releases if r.n_contrib > self.terms or r.overflow]
