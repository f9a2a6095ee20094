"""The reference model's strategies (docs/protocol.md, "Strategies"): fixture tables with fixed times
for each strategy and the hot swap, and randomised traffic with strategy swaps.

The tables (SCENARIOS) and the traffic generator (Traffic) are shared with
tests/bpf/test_model_equivalence.py, which runs them through the real XDP program as well: packets
are described without a payload size or addresses, and built for whichever harness runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggd.core.model import (BANKS, AggregatorModel, BankState, JobConfig, TableEntry, Verdict, check_table,
                        governing)
from aggd.core.strategy import StrategyTable, parse, to_entry
from aggd_client.protocol import (HEADER_SIZE, MAGIC, ZERO_EXPONENT, Counter, DropReason, Flag, Header,
                                  MsgType, StrategyKind, decode)

E = 8                       # the unit tests' packet size; the BPF harness builds the same packets with 256
JOB = 1
GROUP = ("239.77.0.1", 47001)
T0_NS = 1_000_000_000       # scenario time 0 (the XDP program's frozen clock must not be 0)
SYNC, QUORUM, SSP, ASYNC, WBSP = (StrategyKind.SYNC, StrategyKind.QUORUM, StrategyKind.SSP,
                                  StrategyKind.ASYNC, StrategyKind.WBSP)
RT = Flag.RETRANSMIT


def addr(rank: int) -> tuple[str, int]:
    return (f"10.0.1.{rank + 1}", 40000 + rank)


def entry(text: str, version: int = 0, from_round: int = 0) -> TableEntry:
    return to_entry(parse(text), version, from_round)


# ---------------------------------------------------------------------------------------------
# Scenario tables: packets at fixed times, the verdict expected after each.

@dataclass(frozen=True)
class Pkt:
    """One aggd message, independent of the packet size (``values`` fill the front of the payload)."""
    rank: int
    round: int = 0
    chunk: int = 0
    values: tuple[int, ...] = (1,)
    type: int = MsgType.CONTRIB
    flags: int = 0
    step: int = 0
    exponent: int = 0

    def build(self, elements: int, job: int = JOB) -> bytes:
        payload = np.zeros(elements, "<i4")
        payload[:len(self.values)] = self.values
        return Header(type=self.type, job=job, rank=self.rank, round=self.round, chunk=self.chunk,
                      count=max(len(self.values), 1), flags=self.flags, step=self.step,
                      exponent=self.exponent).pack() + payload.tobytes()


def c(rank: int, round_: int = 0, values=(1,), **kw) -> Pkt:
    return Pkt(rank, round_, values=tuple(values), **kw)


def rr(rank: int, round_: int = 0, **kw) -> Pkt:
    return Pkt(rank, round_, values=(0,), type=MsgType.REREAD, **kw)


@dataclass(frozen=True)
class Expect:
    action: str
    reason: DropReason | None = None
    dest: str | None = None
    hdr: dict = field(default_factory=dict)     # expected header fields of the message sent
    values: tuple | None = None                 # expected leading payload values


ABSORBED = Expect("drop")
_RESULT = dict(type=MsgType.RESULT, rank=0xFFFF, code=0, step=0)


def drop(reason: DropReason) -> Expect:
    return Expect("drop", reason)


def released(values, **hdr) -> Expect:
    """The round is released: the sum goes to the group."""
    return Expect("tx", dest="group", values=tuple(values), hdr=_RESULT | dict(flags=0) | hdr)


def resent(values, **hdr) -> Expect:
    """A released result re-sent to the sender alone (re-read, retransmission, late answer)."""
    return Expect("tx", dest="sender", values=tuple(values), hdr=_RESULT | dict(flags=Flag.REREAD) | hdr)


def partial(values, **hdr) -> Expect:
    """async: the running sum, to the sender alone, not flagged as a re-send."""
    return Expect("tx", dest="sender", values=tuple(values), hdr=_RESULT | dict(flags=0) | hdr)


@dataclass(frozen=True)
class Swap:
    """Install a new strategy table (the rows every data plane stores)."""
    entries: tuple[TableEntry, ...]


Step = Union[tuple[int, Pkt, Expect], Swap]   # (time in µs, packet, expectation) or a table swap


@dataclass(frozen=True)
class Scenario:
    table: tuple[TableEntry, ...]
    steps: tuple[Step, ...]
    world: int = 4
    slots: int = 1
    max_chunks: int = 8
    counters: dict = field(default_factory=dict)   # expected counters at the end, by name


Q3 = entry("quorum:3:10ms")

SCENARIOS: dict[str, Scenario] = {
    "quorum:3 releases without the straggler; its late contribution is carried into the next round":
    Scenario((Q3,), (
        (0, c(0, 0, [1, 1]), ABSORBED),
        (1, c(1, 0, [2, 2]), ABSORBED),
        (2, c(2, 0, [4, 4]), released([7, 7], round=0, contributors=0b0111, n_contrib=3, strategy=QUORUM,
                                      param=3, strategy_version=0)),
        (3, c(0, 1, [10]), ABSORBED),                       # the next round opens
        # The straggler: carried into round 1, answered with round 0's result so its call completes.
        (4, c(3, 0, [8, 8]), resent([7, 7], round=0, contributors=0b0111, n_contrib=3)),
        (5, c(3, 0, [8, 8], flags=RT), resent([7, 7], round=0)),   # answered again, not carried twice
        (6, c(1, 1, [20]), ABSORBED),
        (7, c(2, 1, [40]), released([78, 8], round=1, contributors=0b0111, n_contrib=4, flags=Flag.CARRIED)),
        # Late for round 1 too: no open round of chunk 0 above it, so round 2 opens for it.
        (8, c(3, 1, [80]), resent([78, 8], round=1, n_contrib=4, flags=Flag.CARRIED | Flag.REREAD)),
        (9, c(0, 2, [100]), ABSORBED),
        (10, c(1, 2, [100]), ABSORBED),
        (11, c(2, 2, [100]), released([380], round=2, contributors=0b0111, n_contrib=4, flags=Flag.CARRIED)),
    ), counters=dict(contributions=11, carried=2, released=3, rereads=3, timeouts=0)),

    "quorum: a straggler two rounds behind gets the newest released result":
    Scenario((Q3,), (
        *[(r, c(r, 0, [1]), ABSORBED if r < 2 else released([3], round=0)) for r in range(3)],
        *[(10 + r, c(r, 1, [2]), ABSORBED if r < 2 else released([6], round=1)) for r in range(3)],
        (20, c(3, 0, [100]), resent([6], round=1, n_contrib=3)),     # carried into round 2 (opened)
        (21, c(3, 1, [100]), resent([6], round=1)),                  # carried into round 2 as well
        (22, c(0, 2, [3]), ABSORBED),
        (23, c(1, 2, [3]), ABSORBED),
        (24, c(2, 2, [3]), released([209], round=2, contributors=0b0111, n_contrib=5, flags=Flag.CARRIED)),
    ), counters=dict(contributions=11, carried=2, released=3, rereads=2)),

    "quorum timeout releases a round with fewer than k on the next packet to the slot":
    Scenario((entry("quorum:3:1ms"),), (
        (0, c(0, 0, [1]), ABSORBED),
        (100, c(1, 0, [2]), ABSORBED),
        (999, c(0, 0, [1], flags=RT), drop(DropReason.DUPLICATE)),  # 999 µs after the first: still open
        # 1000 µs: the re-read itself releases the round; its answer announces it to the group.
        (1000, rr(1, 0), released([3], round=0, contributors=0b11, n_contrib=2, strategy=QUORUM, param=3)),
        (1001, c(0, 0, [1], flags=RT), resent([3], round=0)),    # from then on, re-sends
        (1002, c(2, 0, [4]), resent([3], round=0)),              # late: round 1 opens, holding it
        (1003, c(0, 1, [10]), ABSORBED),                         # round 1's deadline runs from here
        (2002, c(1, 1, [20]), ABSORBED),
        (2003, c(0, 1, [1], chunk=1), ABSORBED),                 # another key of the slot expires it
        (2004, rr(2, 1), released([34], round=1, contributors=0b011, n_contrib=3, flags=Flag.CARRIED)),
        (2005, rr(2, 1), resent([34], round=1, flags=Flag.CARRIED | Flag.REREAD)),
    ), counters=dict(timeouts=2, released=2, rereads=3, contributions=6, carried=1)),

    "ssp:2 opens rounds r+1 and r+2 while r is open; r+3 is busy":
    Scenario((entry("ssp:2"),), (
        (0, c(0, 0, [1]), ABSORBED),
        (1, c(0, 1, [1]), ABSORBED),
        (2, c(0, 2, [1]), ABSORBED),
        (3, c(0, 3, [1]), drop(DropReason.BUSY)),                # the slowest would be 3 behind
        (4, c(1, 1, [2]), ABSORBED),
        (5, c(1, 0, [2]), ABSORBED),                             # an older open round is not late
        (6, c(2, 0, [4]), ABSORBED),
        (7, c(3, 0, [8]), released([15], round=0, contributors=0b1111, n_contrib=4, strategy=SSP, param=2)),
        (8, c(0, 3, [1], flags=RT), ABSORBED),                   # round 1 is the oldest open now
        (9, c(0, 4, [1]), drop(DropReason.BUSY)),
        (10, rr(0, 3), drop(DropReason.NOT_READY)),
        (11, rr(2, 0), resent([15], round=0)),
        (12, c(2, 1, [4]), ABSORBED),
        (13, c(3, 1, [8]), released([15], round=1, strategy=SSP)),
        (14, c(0, 4, [1]), ABSORBED),                            # takes round 0's bank
        (15, rr(1, 0), drop(DropReason.STALE)),
    ), counters=dict(released=2, contributions=11)),

    "async answers every contribution with the running sum; at most 3 rounds open":
    Scenario((entry("async"),), (
        (0, c(0, 0, [1]), partial([1], round=0, contributors=0b1, n_contrib=1, strategy=ASYNC)),
        (1, c(1, 0, [2]), partial([3], contributors=0b11, n_contrib=2)),
        (2, c(1, 0, [2], flags=RT), drop(DropReason.DUPLICATE)),
        (3, c(2, 0, [4]), partial([7], contributors=0b111, n_contrib=3)),
        (4, c(3, 0, [8]), released([15], contributors=0b1111, n_contrib=4, strategy=ASYNC)),
        *[(4 + r, c(0, r, [1]), partial([1], round=r)) for r in (1, 2, 3)],
        (8, c(0, 4, [1]), drop(DropReason.BUSY)),               # three open: round 0's result stays
        (9, rr(1, 0), resent([15], round=0)),
        (10, c(1, 1, [2]), partial([3], round=1)),
        (11, c(2, 1, [4]), partial([7], round=1)),
        (12, c(3, 1, [8]), released([15], round=1)),
        (13, c(0, 4, [1]), partial([1], round=4)),               # takes round 0's bank
        (14, rr(1, 0), drop(DropReason.STALE)),
        # A first transmission for a round the slot no longer holds: carried into round 2.
        (15, c(1, 0, [2]), resent([15], round=1)),
        (16, c(1, 2, [2]), partial([5], round=2, contributors=0b11, n_contrib=3, flags=Flag.CARRIED)),
    ), counters=dict(released=2, partials=10, carried=1, rereads=2)),

    "wbsp takes several steps of a fast member into one round; the slowest member releases it":
    Scenario((entry("wbsp"),), (
        (0, c(0, 0, [1], step=0), ABSORBED),
        (1, c(0, 0, [1], step=1), ABSORBED),
        (2, c(0, 0, [1], step=1, flags=RT), drop(DropReason.DUPLICATE)),
        (3, c(0, 0, [1], step=2), ABSORBED),
        (4, c(1, 0, [10]), ABSORBED),
        (5, c(1, 0, [10], step=1), ABSORBED),
        (6, c(2, 0, [100]), ABSORBED),
        (7, c(3, 0, [1000]), released([1123], contributors=0b1111, n_contrib=7, strategy=WBSP)),
        (8, c(0, 0, [1], step=3), resent([1123], round=0, n_contrib=7)),   # after the release: carried
        (9, c(0, 0, [1], step=3, flags=RT), resent([1123], round=0)),      # not carried twice
        (10, c(0, 0, [1], step=1, flags=RT), resent([1123], round=0)),
        (11, c(0, 0, [1], step=4), resent([1123], round=0)),     # another late step: carried as well
        (12, c(0, 0, [1], step=4, flags=RT), resent([1123], round=0)),     # not carried twice
        (13, c(1, 1, [10]), ABSORBED),
        (14, c(0, 1, [1]), ABSORBED),
        (15, c(2, 1, [100]), ABSORBED),
        (16, c(3, 1, [1000]), released([1113], round=1, n_contrib=6, contributors=0b1111, flags=Flag.CARRIED)),
    ), counters=dict(released=2, contributions=13, carried=2, rereads=5)),

    "wbsp steps 0..7 are deduplicated one by one; a lost step may arrive late":
    Scenario((entry("wbsp"),), (
        (0, c(0, 0, [1], step=2), ABSORBED),
        (1, c(0, 0, [1], step=0), ABSORBED),                     # a step lost and retransmitted later
        (2, c(0, 0, [1], step=2, flags=RT), drop(DropReason.DUPLICATE)),
        (3, c(0, 0, [1], step=8), drop(DropReason.DUPLICATE)),   # beyond the 8 steps of a round
        (4, c(0, 0, [1], step=7), ABSORBED),
        (5, c(1, 0, [10], step=5), ABSORBED),                    # counted, but not member 1's step 0:
        (6, c(1, 0, [100], step=0), released([113], contributors=0b11, n_contrib=5, strategy=WBSP)),
        (7, c(0, 0, [1], step=300), resent([113], round=0)),
    ), world=2, counters=dict(contributions=5, released=1, rereads=1)),

    "every strategy deduplicates by (member, step): a wbsp step reaching a sync round is summed":
    Scenario((entry("sync"),), (
        (0, c(0, 0, [1], step=0), ABSORBED),
        (1, c(0, 0, [1], step=1), ABSORBED),                     # a second step of the same member
        (2, c(0, 0, [1], step=1, flags=RT), drop(DropReason.DUPLICATE)),
        (3, c(1, 0, [10]), released([12], contributors=0b11, n_contrib=3)),
        (4, c(0, 0, [1], step=1, flags=RT), resent([12], round=0)),
        (5, c(0, 0, [1], step=2), resent([12], round=0)),        # after the release: late, carried
        (6, c(0, 0, [1], step=2, flags=RT), resent([12], round=0)),
        (7, c(0, 1, [2]), ABSORBED),
        (8, c(1, 1, [20]), released([23], round=1, n_contrib=3, contributors=0b11, flags=Flag.CARRIED)),
    ), world=2, counters=dict(contributions=6, carried=1, released=2, rereads=3)),

    "hot swap: sync governs rounds 0-4, quorum:3 from round 5":
    Scenario((entry("sync"), entry("quorum:3:10ms", 1, 5)), (
        *[(r, c(r, 3, [1]), ABSORBED if r < 3 else released([4], round=3, strategy_version=0, strategy=SYNC))
          for r in range(4)],
        *[(10 + r, c(r, 4, [1]), ABSORBED) for r in range(3)],              # sync: three are not enough
        (13, c(3, 4, [1]), released([4], round=4, strategy_version=0, strategy=SYNC, param=0)),
        (20, c(0, 5, [1]), ABSORBED),
        (21, c(1, 5, [1]), ABSORBED),
        (22, c(2, 5, [1]), released([3], round=5, strategy_version=1, strategy=QUORUM, param=3,
                                    contributors=0b0111)),
        (23, c(3, 5, [1]), resent([3], round=5, strategy_version=1)),       # late: carried into round 6
        *[(30 + r, c(r, 6, [1]), ABSORBED if r < 2 else
           released([4], round=6, strategy_version=1, n_contrib=4, flags=Flag.CARRIED)) for r in range(3)],
    ), counters=dict(released=4, carried=1)),

    "a round keeps the strategy it opened with, whatever is installed later":
    Scenario((entry("sync"),), (
        (0, c(0, 5, [1]), ABSORBED),                                        # round 5 opens under sync
        Swap((entry("sync"), entry("quorum:3:10ms", 1, 5))),
        (1, c(1, 5, [1]), ABSORBED),
        (2, c(2, 5, [1]), ABSORBED),                                        # still sync: needs 4
        (3, c(3, 5, [1]), released([4], round=5, strategy_version=0, strategy=SYNC)),
        *[(10 + r, c(r, 6, [1]), ABSORBED if r < 2 else released([3], round=6, strategy_version=1, strategy=QUORUM))
          for r in range(3)],
        Swap((entry("sync"), entry("quorum:3:10ms", 1, 5), entry("ssp:1", 2, 8))),
        *[(20 + r, c(r, 7, [1]), ABSORBED if r < 2 else released([3], round=7, strategy_version=1))
          for r in range(3)],
        (30, c(0, 8, [1]), ABSORBED),
        (31, c(0, 9, [1]), ABSORBED),                                      # ssp:1 opens round 9 early
        (32, c(0, 10, [1]), drop(DropReason.BUSY)),
    ), counters=dict(released=3)),

    "a carry whose new round takes the origin's bank: remembered, answered once its chunk has a result":
    Scenario((entry("quorum:1:10ms"),), (
        *[(ch, c(0, 0, [1], chunk=ch), released([1], round=0, chunk=ch)) for ch in range(4)],
        # (1, 0) opens for the carry in the released bank with the smallest key: (0, 0) itself.
        (4, c(1, 0, [10], chunk=0), ABSORBED),
        (5, c(1, 0, [10], chunk=0, flags=RT), drop(DropReason.NOT_READY)),   # counted, no result yet
        (6, c(0, 1, [2], chunk=0), released([12], round=1, chunk=0, n_contrib=2, contributors=0b1,
                                            flags=Flag.CARRIED)),
        (7, c(1, 0, [10], chunk=0, flags=RT), resent([12], round=1, chunk=0, n_contrib=2, contributors=0b1,
                                                     flags=Flag.CARRIED | Flag.REREAD)),
    ), max_chunks=8, counters=dict(carried=1, released=5, rereads=1)),

    "governing row: before every row the oldest one; on equal from_round the newest version":
    Scenario((TableEntry(1, 10, SSP, 2, 0), TableEntry(2, 20, SYNC, 0, 0)), (
        (0, c(0, 5, [1]), ABSORBED),                            # round 5 precedes every row: ssp:2
        (1, c(0, 6, [1]), ABSORBED),
        *[(2 + r, c(r, 5, [1]), ABSORBED if r < 3 else
           released([4], round=5, strategy_version=1, strategy=SSP, param=2)) for r in (1, 2, 3)],
        Swap((TableEntry(2, 20, SYNC, 0, 0), TableEntry(3, 30, ASYNC, 0, 0),
              TableEntry(4, 30, QUORUM, 2, 10_000))),
        (10, c(0, 30, [1], chunk=1), ABSORBED),                 # quorum:2 (version 4), not async
        (11, c(1, 30, [1], chunk=1), released([2], round=30, chunk=1, strategy_version=4, strategy=QUORUM,
                                              param=2)),
    ), slots=2, counters=dict(released=2, partials=0)),

    "two chunks share a slot: carries go to the next round of the late chunk, held ahead of the slot's order":
    Scenario((Q3,), (
        *[(r, c(r, 0, [1], chunk=0), ABSORBED if r < 2 else released([3], round=0, chunk=0)) for r in range(3)],
        *[(5 + r, c(r, 0, [2], chunk=1), ABSORBED if r < 2 else released([6], round=0, chunk=1)) for r in range(3)],
        (10, c(0, 1, [3], chunk=0), ABSORBED),
        # carried into (1, 1), a holding bank: it opens while (1, 0) is open
        (11, c(3, 0, [5], chunk=1), resent([6], round=0, chunk=1)),
        (12, c(1, 1, [3], chunk=0), ABSORBED),
        (13, c(2, 1, [3], chunk=0), released([9], round=1, chunk=0)),
        (14, c(3, 0, [5], chunk=1, flags=RT), resent([6], round=0, chunk=1)),   # its copy: answered
        # (2, 0) opens ahead of (1, 1) as a holding bank (no part in the slot's key order or
        # admission until its round starts), taking (0, 0)'s bank
        (15, c(3, 0, [7], chunk=0), resent([9], round=1, chunk=0)),
        *[(20 + r, c(r, 1, [4], chunk=1), ABSORBED if r < 2 else
           released([17], round=1, chunk=1, n_contrib=4, flags=Flag.CARRIED)) for r in range(3)],
        (30, c(0, 2, [1], chunk=0), ABSORBED),                    # round 2 of chunk 0 starts in it
        (31, c(3, 0, [7], chunk=0, flags=RT), drop(DropReason.STALE)),  # a copy of one counted
        (32, c(3, 0, [7], chunk=0, flags=RT), drop(DropReason.STALE)),
        (33, c(1, 2, [1], chunk=0), ABSORBED),
        (34, c(2, 2, [1], chunk=0), released([10], round=2, chunk=0, n_contrib=4, flags=Flag.CARRIED)),
        (35, rr(3, 1, chunk=0), resent([9], round=1, chunk=0)),
        (36, c(3, 1, [7], chunk=1), resent([17], round=1, chunk=1, flags=Flag.CARRIED | Flag.REREAD)),
        (37, c(0, 2, [1], chunk=1), ABSORBED),
    ), counters=dict(released=5, carried=3)),
}


# ---------------------------------------------------------------------------------------------
# Checking one verdict.

def check(v: Verdict, exp: Expect, elements: int = E, where: str = "") -> None:
    assert (v.action, v.reason, v.dest) == (exp.action, exp.reason, exp.dest), (where, v)
    if exp.action != "tx":
        assert v.out is None, where
        return
    hdr, payload = decode(v.out)
    for name, value in exp.hdr.items():
        assert getattr(hdr, name) == value, (where, name, hdr)
    if hdr.type == MsgType.RESULT:
        assert len(payload) == elements, where
    if exp.values is not None:
        assert payload[:len(exp.values)].tolist() == list(exp.values), (where, payload[:8])
        assert not payload[len(exp.values):].any(), where


def job_config(world: int, slots: int, max_chunks: int, addr_of=addr) -> JobConfig:
    return JobConfig(job=JOB, world=world, slots=slots, max_chunks=max_chunks,
                     members={r: addr_of(r) for r in range(world)}, group=GROUP)


def scenario_model(sc: Scenario, elements: int = E, addr_of=addr) -> AggregatorModel:
    m = AggregatorModel(elements)
    m.add_job(job_config(sc.world, sc.slots, sc.max_chunks, addr_of))
    m.set_strategy(JOB, list(sc.table))
    return m


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    sc = SCENARIOS[name]
    m = scenario_model(sc)
    for i, step in enumerate(sc.steps):
        if isinstance(step, Swap):
            m.set_strategy(JOB, list(step.entries))
            continue
        t_us, p, exp = step
        check(m.process(p.build(E), addr(p.rank), T0_NS + t_us * 1000), exp, where=f"step {i}: {p}")
    for counter, value in sc.counters.items():
        assert m.counter(JOB, counter) == value, counter


def test_without_a_clock_nothing_expires():
    m = scenario_model(Scenario((entry("quorum:3:1us"),), ()))
    assert m.process(c(0, 0).build(E), addr(0)).action == "drop"
    assert m.process(rr(0, 0).build(E), addr(0)).reason == DropReason.NOT_READY   # now 0 - t_first 0
    assert m.process(rr(0, 0).build(E), addr(0), now_ns=1000).action == "tx"      # 1 µs later


def test_time_is_unsigned():
    """A clock that moved backwards looks like a huge interval (u64 subtraction), as in C."""
    m = scenario_model(Scenario((entry("quorum:3:1s"),), ()))
    m.process(c(0, 0).build(E), addr(0), now_ns=5000)
    assert m.process(rr(0, 0).build(E), addr(0), now_ns=4999).action == "tx"
    assert m.counter(JOB, "timeouts") == 1


def test_model_only_counters_are_named_in_stats():
    m = scenario_model(SCENARIOS["quorum timeout releases a round with fewer than k on the next packet to the slot"])
    counters = m.stats()["jobs"][JOB]["counters"]
    for name in ("carried", "timeouts", "partials"):
        assert name in counters
    assert len(m.counters(JOB)) == len(Counter)


def test_governing_row():
    rows = [TableEntry(3, 20, SYNC, 0, 0), TableEntry(1, 10, SSP, 1, 0), TableEntry(2, 10, ASYNC, 0, 0)]
    assert governing(rows, 25).version == 3
    assert governing(rows, 15).version == 2          # equal from_round: the larger version
    assert governing(rows, 5).version == 2           # before every row: the oldest from_round
    t = StrategyTable(parse("sync"))
    for v, r in ((1, 10), (2, 20), (3, 30), (4, 40)):
        t.install(v, r, parse("ssp:1"))
    assert [e.version for e in t.table_entries()] == [1, 2, 3, 4]
    assert governing(t.table_entries(), 5) == t.table_entries()[0]


def test_strategy_tables_are_checked():
    m = scenario_model(Scenario((Q3,), ()))
    for bad in ([], [Q3] * 5, [TableEntry(0, 0, 9, 0, 0)], [TableEntry(0, 0, QUORUM, 300, 1)],
                [TableEntry(70000, 0, SYNC, 0, 0)], [TableEntry(0, -1, SYNC, 0, 0)]):
        with pytest.raises(ValueError):
            m.set_strategy(JOB, bad)
    assert m.strategy_table(JOB) == [Q3]
    with pytest.raises(ValueError):
        check_table([TableEntry(0, 0, QUORUM, 3, 2**32)])


def test_release_observer_and_slot_layout():
    sc = SCENARIOS["quorum timeout releases a round with fewer than k on the next packet to the slot"]
    m = scenario_model(sc)
    seen = []
    m.on_release = lambda job, bank, cause: seen.append((job, bank.key, bank.n_contrib, cause))
    for t_us, p, _ in sc.steps:
        m.process(p.build(E), addr(p.rank), T0_NS + t_us * 1000)
    assert seen == [(JOB, (0, 0), 2, "timeout"), (JOB, (1, 0), 3, "timeout")]
    banks = m.jobs[JOB].slots[0].banks
    assert len(banks) == BANKS
    assert [b.state for b in banks] == [BankState.RELEASED, BankState.RELEASED, BankState.OPEN, BankState.EMPTY]


# ---------------------------------------------------------------------------------------------
# Randomised traffic: members that behave like clients (windows, retransmissions, re-reads, extra
# wbsp steps, late and early contributions) plus noise, decoded from a list of 32-bit ops so
# hypothesis can shrink it. Shared with the XDP equivalence test.

DT_US = (2, 2, 30, 30, 200, 500, 2_000, 12_000)   # between packets; quorum timeouts here are 10 ms
_pool = np.random.default_rng(20261123)
SMALL = _pool.integers(-1000, 1000, (64, 512), dtype=np.int64).astype(np.int32)
HUGE = (_pool.integers(2**29, 2**31, (16, 512), dtype=np.int64)
        * _pool.choice([-1, 1], (16, 512))).clip(-2**31, 2**31 - 1).astype(np.int32)
STRANGER = ("10.9.9.9", 40000)
OTHER_JOB = 9


@dataclass
class Sent:
    """One packet of a sequence: the aggd message, its source, its time, and what it meant."""
    data: bytes
    src: tuple[str, int]
    now_ns: int
    rank: int = -1             #: the member it came from (-1: noise)
    key: int = -1              #: the key index it asked about
    contribution: tuple | None = None   #: (rank, round, chunk, step) of a contribution


class Traffic:
    """A job's members, driven by ops. Keys are numbered ``round * chunks + chunk``.

    ``exact``: exponent 0 and small values only, so sums are exact (the conservation property).
    ``junk``: contributions sometimes carry junk in the header fields the aggregator ignores.

    An op's bits: 0-1 rank, 2-5 action, 6-8 its argument, 9-10 and 20 the time step, 11-13 the
    exponent class (noise: the variant), 14-16 the exponent, 17-19 the value class, 21-31 a seed.
    Shrinking towards 0 means: rank 0 sends the next key of its window, 2 µs later.
    """

    def __init__(self, *, world: int, slots: int, chunks: int | tuple[int, ...], max_chunks: int,
                 window: int, elements: int, addr_of: Callable[[int], tuple[str, int]] = addr,
                 exact: bool = False, noise: bool = True, junk: bool = False) -> None:
        # ``chunks``: every round's chunks, or a cycle of rounds' chunks (tensors of several sizes,
        # as DDP's buckets): a chunk sits out the rounds with fewer, and its packets say ``skip``.
        self.layout = (chunks,) if isinstance(chunks, int) else tuple(chunks)
        self.per_cycle = sum(self.layout)
        self.starts = [sum(self.layout[:j]) for j in range(len(self.layout))]
        self.chunks = max(self.layout)
        self.world, self.slots, self.max_chunks = world, slots, max_chunks
        self.window, self.elements, self.addr_of = window, elements, addr_of
        self.exact, self.noise, self.junk = exact, noise, junk
        self.done: list[set[int]] = [set() for _ in range(world)]
        self.sent: list[dict[int, int]] = [{} for _ in range(world)]   # key -> highest step sent
        self.lo = [0] * world
        self.now_us = 0
        self.max_round = 0

    def key(self, idx: int) -> tuple[int, int]:
        cycle, rem = divmod(idx, self.per_cycle)
        j = max(j for j, start in enumerate(self.starts) if start <= rem)
        return cycle * len(self.layout) + j, rem - self.starts[j]

    def index(self, round_: int, chunk: int) -> int:
        cycle, j = divmod(round_, len(self.layout))
        return cycle * self.per_cycle + self.starts[j] + chunk

    def skip(self, round_: int, chunk: int) -> int:
        """Rounds since ``chunk``'s previous round that left it out (its first: from round -1)."""
        prev = next((r for r in range(round_ - 1, -1, -1)
                     if self.layout[r % len(self.layout)] > chunk), -1)
        return round_ - prev - 1

    def _pick(self, keys: list[int], a: int) -> int | None:
        return keys[a % len(keys)] if keys else None

    def next(self, op: int) -> Sent:
        rank = (op & 3) % self.world
        action, a = (op >> 2) & 15, (op >> 6) & 7
        self.now_us += DT_US[(op >> 9) & 3 | (op >> 18) & 4]
        now = T0_NS + self.now_us * 1000
        if action == 14 and self.noise:
            return self._noise(op, a, now)
        lo, w = self.lo[rank], self.window
        back = 3 * self.chunks
        sent = self.sent[rank]
        recent = [k for k in range(max(0, lo - back), lo + w) if k in sent]
        flags, step, typ = 0, 0, MsgType.CONTRIB
        if action in (8, 9) and recent:                         # retransmission
            idx = self._pick(recent, a)
            flags, step = RT, sent[idx]
        elif action == 10:                                      # re-read
            idx, typ = max(0, lo - back + a % (back + w)), MsgType.REREAD
        elif action == 11 and [k for k in recent if k >= lo and k not in self.done[rank]]:
            idx = max(k for k in recent if k >= lo and k not in self.done[rank])   # wbsp: another step
            step = sent[idx] + (255 if a == 7 else 1)
        elif action == 12 and lo > 0:                           # late (never sent, or a retransmission)
            idx = max(0, lo - 1 - a)
            flags, step = (RT, sent[idx]) if idx in sent else (0, 0)
        elif action == 13:                                      # early: beyond the window
            idx = lo + w + a % 3
            flags, step = (RT, sent[idx]) if idx in sent else (0, 0)
        else:                                                   # the next key of the window
            fresh = [k for k in range(lo, lo + w) if k not in sent]
            if fresh:
                idx = fresh[0]
            else:
                idx, flags = lo + a % w, RT
                step = sent[idx]
        round_, chunk = self.key(idx)
        if typ == MsgType.CONTRIB:
            sent[idx] = max(sent.get(idx, 0), step)
            self.max_round = max(self.max_round, round_)
        values, exponent = self._values(op)
        hdr = Header(type=typ, job=JOB, rank=rank, round=round_, chunk=chunk, count=self.elements,
                     flags=flags, step=step, exponent=exponent, skip=self.skip(round_, chunk))
        if self.junk and (op >> 21) % 8 == 0:
            hdr.strategy_version, hdr.strategy, hdr.param = 0xBEEF, 0xA5, 0x5A
            hdr.contributors, hdr.n_contrib, hdr.code = 0xDEADBEEF, 77, 3
        data = hdr.pack() + values.tobytes()
        contribution = (rank, round_, chunk, step) if typ == MsgType.CONTRIB else None
        return Sent(data, self.addr_of(rank), now, rank, idx, contribution)

    def _values(self, op: int) -> tuple[np.ndarray, int]:
        seed, vclass, eclass = op >> 21, (op >> 17) & 7, (op >> 11) & 7
        if self.exact:
            return SMALL[seed % 64, :self.elements].astype("<i4"), 0
        if eclass == 7:
            return np.zeros(self.elements, "<i4"), ZERO_EXPONENT
        values = (HUGE[seed % 16] if vclass == 7 else SMALL[seed % 64])[:self.elements].astype("<i4")
        exponent = ((op >> 14) & 7) - 2 if eclass == 6 else 0
        return values, exponent

    def _noise(self, op: int, a: int, now: int) -> Sent:
        """Malformed, foreign or misdirected packets, one of each check's refusals."""
        sub = (op >> 11) & 7
        rank = (op & 3) % self.world
        round_, chunk = self.key(self.lo[rank])
        hdr = Header(type=MsgType.CONTRIB, job=JOB, rank=rank, round=round_, chunk=chunk,
                     count=self.elements, skip=self.skip(round_, chunk))
        payload = SMALL[(op >> 21) % 64, :self.elements].astype("<i4").tobytes()
        src = self.addr_of(rank)
        if self.junk and (op >> 21) % 2:     # NACKs must zero what they do not echo
            hdr.strategy_version, hdr.strategy, hdr.param, hdr.skip = 0xBEEF, 0xA5, 0x5A, 0x1234
            hdr.contributors, hdr.n_contrib, hdr.step, hdr.exponent = 0xDEADBEEF, 77, 9, -3
        if a == 0:
            data = (hdr.pack() + payload)[:sub * 5]                          # too short
        elif a == 1:
            hdr.magic = MAGIC ^ (1 << sub)
            data = hdr.pack() + payload
        elif a == 2:
            hdr.version = 2 + sub
            data = hdr.pack() + payload
        elif a == 3:
            hdr.type = (0, MsgType.RESULT, MsgType.NACK, MsgType.JOIN, MsgType.JOIN_ACK, 9, 255, 0)[sub]
            data = hdr.pack() + payload
        elif a == 4:
            hdr.count = (0, self.elements + 1, 0xFFFF, 8)[sub % 4]
            data = hdr.pack() + (payload if sub < 3 else payload[:28])           # count beyond the payload
        elif a == 5:
            hdr.job = (OTHER_JOB, 0xFFFF)[sub % 2]
            data = hdr.pack() + payload
        elif a == 6:
            if sub < 3:
                hdr.rank = self.world + sub                                      # bad rank
            src = STRANGER if sub in (3, 4, 5) else self.addr_of((rank + 1) % self.world)
            if self.world == 1 and sub >= 6:
                src = STRANGER
            data = hdr.pack() + payload
        else:
            if sub < 4:
                hdr.chunk = self.max_chunks + sub * 1000                         # bad chunk
                data = hdr.pack() + payload
            else:                                                                # the kernel cannot hold it
                data = hdr.pack() + payload[:-4 * (sub - 3)] if sub < 7 else hdr.pack() + payload + payload[:4]
        return Sent(data, src, now)

    def observe(self, sent: Sent, v: Verdict) -> None:
        """Members learn results: the group's reach everyone, the others only their sender."""
        if v.action != "tx" or v.header.type != MsgType.RESULT:
            return
        hdr = v.header
        got = self.index(hdr.round, hdr.chunk)
        for r in (range(self.world) if v.dest == "group" else (sent.rank,)):
            self.done[r].add(got)
            if v.dest != "group":
                self.done[r].add(sent.key)
            while self.lo[r] in self.done[r]:
                self.lo[r] += 1


#: Rounds' chunk counts a random run may take (shape bits 12-14): a constant, or tensors of several
#: sizes in turn (DDP's unequal buckets), so chunks sit out rounds and shrink and grow.
LAYOUTS: tuple[int | tuple[int, ...], ...] = (1, 2, 4, 3, (2, 1), (1, 3, 2), (3, 1, 1, 4), (1, 4))


def layout_of(shape: int, constant: int) -> int | tuple[int, ...]:
    """Half the shapes keep ``constant`` chunks a round; the others take a layout of LAYOUTS."""
    pick = (shape >> 12) % 8
    return constant if pick < 4 else LAYOUTS[pick]


STRATEGY_TEXTS = ("sync", "quorum:3:10ms", "quorum:2:10ms", "quorum:4:10ms", "ssp:1", "ssp:2", "ssp:0",
                  "async", "wbsp")


def swap_table(table: StrategyTable, version: int, m: AggregatorModel, traffic: Traffic,
               text: str, ahead: int) -> list[TableEntry]:
    """A new version from a round nobody has reached yet (a round boundary), as the daemon does."""
    top = max([traffic.max_round] + [b.key[0] for s in m.jobs[JOB].slots for b in s.banks
                                     if b.state != BankState.EMPTY])
    table.install(version, max(top + 1 + ahead, table.entries[-1][1]), parse(text))
    return table.table_entries()


ops_lists = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_lists, shape=st.integers(0, 2**16 - 1),
       swaps=st.lists(st.tuples(st.integers(0, 79), st.sampled_from(STRATEGY_TEXTS), st.integers(0, 2)),
                      max_size=5))
def test_property_conservation_with_swaps(ops, shape, swaps):
    """Over any run, with strategy swaps at round boundaries: every contribution added is in exactly
    one bank's sum (released, or still open), each contribution (rank, round, chunk, step) is added at
    most once, and n_contrib accounts for every one."""
    world = 1 + shape % 4
    slots = 1 + (shape >> 2) % 2
    traffic = Traffic(world=world, slots=slots, chunks=layout_of(shape, 1 + (shape >> 3) % 4), max_chunks=8,
                      window=1 + (shape >> 5) % 3, elements=E, exact=True)
    m = AggregatorModel(E)
    m.add_job(job_config(world, slots, 8))
    table = StrategyTable(parse(STRATEGY_TEXTS[(shape >> 7) % len(STRATEGY_TEXTS)]))
    m.set_strategy(JOB, table.table_entries())
    rows = {e.version: e for e in table.table_entries()}
    releases: list[tuple[np.ndarray, int, int]] = []
    m.on_release = lambda job, bank, cause: releases.append((bank.values.astype(np.int64), bank.n_contrib,
                                                             bank.version))
    added_sum = np.zeros(E, np.int64)
    added: set[tuple] = set()
    n_added = 0
    pending = sorted(swaps)
    for i, op in enumerate(ops):
        while pending and pending[0][0] <= i:
            _, text, ahead = pending.pop(0)
            for e in swap_table(table, len(rows), m, traffic, text, ahead):
                rows[e.version] = e
            m.set_strategy(JOB, table.table_entries())
        sent = traffic.next(op)
        before = m.counter(JOB, "contributions")
        v = m.process(sent.data, sent.src, sent.now_ns)
        if m.counter(JOB, "contributions") > before:
            assert sent.contribution is not None and sent.contribution not in added, (i, sent.contribution)
            added.add(sent.contribution)
            n_added += 1
            added_sum += np.frombuffer(sent.data, "<i4", offset=HEADER_SIZE)
        traffic.observe(sent, v)
        if v.action == "tx" and v.header.type == MsgType.RESULT:
            hdr = v.header
            row = rows[hdr.strategy_version]
            assert (hdr.strategy, hdr.param) == (row.kind, row.param)
    open_banks = [b for s in m.jobs[JOB].slots for b in s.banks if b.state == BankState.OPEN]
    total = sum((vals for vals, _, _ in releases), np.zeros(E, np.int64))
    total += sum((b.values.astype(np.int64) for b in open_banks), np.zeros(E, np.int64))
    assert total.tolist() == added_sum.tolist()
    assert sum(n for _, n, _ in releases) + sum(b.n_contrib for b in open_banks) == n_added
    assert m.counter(JOB, "contributions") == n_added
    assert m.counter(JOB, "released") == len(releases)
    for _, _, version in releases:
        assert version in rows


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_lists, text=st.sampled_from(STRATEGY_TEXTS))
def test_property_every_packet_counted_once(ops, text):
    """Each packet of a known job is one of: a counted drop, a hand-off, an absorbed contribution, or
    one message sent (counted as a release, a re-send or a running sum)."""
    traffic = Traffic(world=4, slots=2, chunks=4, max_chunks=8, window=2, elements=E)
    m = AggregatorModel(E)
    m.add_job(job_config(4, 2, 8))
    m.set_strategy(JOB, [entry(text)])
    for op in ops:
        sent = traffic.next(op)
        before, drops_before = m.stats()["jobs"][JOB]["counters"], m.drops(JOB).sum()
        v = m.process(sent.data, sent.src, sent.now_ns)
        traffic.observe(sent, v)
        after = m.stats()["jobs"][JOB]["counters"]
        d = {k: after[k] - before[k] for k in after}
        if v.job != JOB:
            assert d["rx_packets"] == 0
            continue
        assert d["rx_packets"] == 1
        drops = m.drops(JOB).sum() - drops_before
        if v.reason is not None:
            assert drops == 1 and d["contributions"] == 0
        elif v.action == "pass":
            assert d["to_userspace"] == 1 and drops == 0
        elif v.action == "drop":
            assert d["contributions"] == 1 and drops == 0                    # absorbed
        elif v.dest == "group":            # a release, or the announcement of a deadline release
            assert d["rereads"] == d["partials"] == 0 and not v.header.flags & Flag.REREAD
        elif v.header.flags & Flag.REREAD:
            assert d["rereads"] == 1 and d["partials"] == 0
        else:
            assert d["partials"] == 1 and d["contributions"] == 1
