"""The reference model and the real XDP program, packet by packet (BPF_PROG_TEST_RUN).

Every packet goes through ``aggd.model.AggregatorModel`` and through the production XDP program; they
must agree on the verdict (XDP_DROP / XDP_TX / XDP_PASS), on the bytes of the aggd message sent and
on where it goes (the job's group or the sender), and, at the end of each sequence, on every per-job
counter and drop counter (the job's and the "no job" bucket). Time is frozen: the model gets
``now_ns`` and the program reads the same value from its one-entry ``clock`` map
(``XdpDataPlane.set_clock``); strategy tables go to both with ``set_strategy``.

Runs: the strategy fixture tables of tests/unit/test_model_strategies.py (with their expectations),
and at least MIN_SEQUENCES randomised sequences per strategy (hypothesis; each example is a batch of
BATCH sequences; each sequence starts from a freshly installed job) built by that module's
``Traffic``: members in random order, several chunks and rounds, windows, duplicates and
retransmissions, re-reads, late and early contributions, extra wbsp steps (some beyond 7), unequal
exponents, overflow-prone values, malformed packets, non-members, quorum deadlines, and random
strategy swaps at round boundaries. Contributions and refused packets carry junk in the header fields
the aggregator must overwrite (results) or zero (NACKs).
"""
from __future__ import annotations

import collections
import os
import socket
import struct

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from aggd.dataplane.bpf_syscall import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run
from aggd.dataplane.xdp import multicast_mac
from aggd.model import NO_JOB, AggregatorModel, JobConfig, TableEntry, Verdict
from aggd.strategy import StrategyTable, from_entry, parse
from aggd.testing.frames import AGG_IP, AGG_MAC, worker_addr
from aggd_client import protocol as proto
from aggd_client.protocol import Counter, DropReason

from ..unit.test_model_strategies import (GROUP, JOB, OTHER_JOB, SCENARIOS, T0_NS, Scenario, Sent, Swap,
                                          Traffic, check, entry, swap_table)
from .conftest import ELEMENTS, job_config

pytestmark = pytest.mark.root

MIN_SEQUENCES = 1000     #: per strategy
BATCH = 5                #: sequences per hypothesis example
MIN_OPS, MAX_OPS = 20, 80   #: packets per sequence
SWAP_SEQUENCES = 1000    #: sequences with random strategy swaps
KINDS = ("sync", "quorum", "ssp", "async", "wbsp")
VERDICTS = {"drop": XDP_DROP, "tx": XDP_TX, "pass": XDP_PASS}
STRANGER_MAC = "02:00:00:00:09:09"


def member(rank: int) -> tuple[str, int]:
    return worker_addr(rank)[1:]


_MACS = {member(r): worker_addr(r)[0] for r in range(proto.MAX_MEMBERS)}
_AGG_MAC = bytes.fromhex(AGG_MAC.replace(":", ""))
_AGG_IP = socket.inet_aton(AGG_IP)
_GROUP_MAC = multicast_mac(GROUP[0])


def _mac(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


def _ip_checksum(header: bytes) -> int:
    s = sum(struct.unpack("!10H", header))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def frame(data: bytes, src: tuple[str, int]) -> bytes:
    """Ethernet/IPv4/UDP around an aggd message, from ``src`` to the aggregator's port."""
    udp_len = 8 + len(data)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0, 64, 17, 0, socket.inet_aton(src[0]), _AGG_IP)
    ip = ip[:10] + struct.pack("!H", _ip_checksum(ip)) + ip[12:]
    eth = _AGG_MAC + _mac(_MACS.get(src, STRANGER_MAC)) + b"\x08\x00"
    return eth + ip + struct.pack("!HHHH", src[1], proto.DEFAULT_PORT, udp_len, 0) + data


def describe(msg: bytes | None) -> str:
    if not msg or len(msg) < proto.HEADER_SIZE:
        return repr(msg)
    hdr, payload = proto.decode(msg)
    return f"{hdr} payload[:4]={payload[:4].tolist()}"


# ---------------------------------------------------------------------------------------------
# The two data planes side by side.

class Harness:
    """One job on both data planes; ``send`` runs a packet through both and compares."""

    def __init__(self, dp) -> None:
        self.dp = dp
        self.packets = 0
        self.seen: collections.Counter = collections.Counter()   # model outcomes compared

    def start(self, world: int, slots: int, max_chunks: int, entries: list[TableEntry]) -> None:
        members = {r: member(r) for r in range(world)}
        self.model = AggregatorModel(ELEMENTS)
        self.model.add_job(JobConfig(job=JOB, world=world, slots=slots, max_chunks=max_chunks,
                                     members=members, group=GROUP))
        self.dp.remove_job(OTHER_JOB)
        self.dp.install_job(job_config(job=JOB, world=world, slots=slots, max_chunks=max_chunks, group=GROUP,
                                       members=members))
        self.dp._reset_stats(NO_JOB)
        self.set_strategy(entries)

    def set_strategy(self, entries: list[TableEntry]) -> None:
        self.model.set_strategy(JOB, entries)
        self.dp.set_strategy(JOB, entries)

    def send(self, data: bytes, src: tuple[str, int], now_ns: int, where: str = "") -> Verdict:
        v = self.model.process(data, src, now_ns)
        self.dp.set_clock(now_ns)
        pkt = frame(data, src)
        res = prog_test_run(self.dp.prog_fd, pkt)
        self.packets += 1
        self.seen[(v.action, None if v.reason is None else v.reason.name.lower(), v.dest)] += 1
        why = f"{where}\n  in : {describe(data)} from {src} at {now_ns}\n  model: {v.action} {v.reason} " \
              f"{v.dest} {describe(v.out)}\n  xdp  : {res.verdict_name}"
        if res.verdict == XDP_TX:
            why += f" to {socket.inet_ntoa(res.packet[30:34])} {describe(res.packet[42:])}"
        assert res.verdict == VERDICTS[v.action], why
        if v.action == "pass":
            assert res.packet == pkt, why
        if v.action != "tx":
            return v
        out = res.packet
        udp_len = struct.unpack_from("!H", out, 38)[0]
        msg = out[42:34 + udp_len]
        assert msg == v.out, why
        eth_dst, ip_dst, dport = out[0:6], socket.inet_ntoa(out[30:34]), struct.unpack_from("!H", out, 36)[0]
        if v.dest == "group":
            assert (eth_dst, ip_dst, dport) == (_GROUP_MAC, GROUP[0], GROUP[1]), why
        else:
            assert (eth_dst, ip_dst, dport) == (_mac(_MACS.get(src, STRANGER_MAC)), src[0], src[1]), why
        assert socket.inet_ntoa(out[26:30]) == AGG_IP and _ip_checksum(out[14:34]) == 0, why
        return v

    def check_counters(self, where: str = "") -> None:
        xdp = self.dp.job_stats(JOB)
        counters = self.model.counters(JOB)
        assert {c.name.lower(): int(counters[c]) for c in Counter} == xdp.counters, where
        drops = self.model.drops(JOB)
        assert {r.name.lower(): int(drops[r]) for r in DropReason} == xdp.drops, where
        no_job = self.model.drops(NO_JOB)
        assert {r.name.lower(): int(no_job[r]) for r in DropReason} == self.dp.job_stats(None).drops, where


@pytest.fixture(scope="module")
def harness(xdp_program):
    h = Harness(xdp_program)
    yield h
    xdp_program.set_clock(0)      # real time again for whoever uses the program next
    xdp_program.remove_job(JOB)


# ---------------------------------------------------------------------------------------------
# The fixture tables.

@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(harness, name):
    sc: Scenario = SCENARIOS[name]
    harness.start(sc.world, sc.slots, sc.max_chunks, list(sc.table))
    for i, step in enumerate(sc.steps):
        if isinstance(step, Swap):
            harness.set_strategy(list(step.entries))
            continue
        t_us, p, exp = step
        v = harness.send(p.build(ELEMENTS), member(p.rank), T0_NS + t_us * 1000, f"step {i}: {p}")
        check(v, exp, ELEMENTS, where=f"step {i}: {p}")
    harness.check_counters(name)


# ---------------------------------------------------------------------------------------------
# Randomised sequences.

RUN: collections.Counter = collections.Counter()   # sequences compared, by strategy


def table_for(kind: str, shape: int) -> list[TableEntry]:
    if kind == "quorum":
        k, timeout = 1 + (shape >> 9) % 4, ("10ms", "1ms")[(shape >> 11) % 2]
        return [entry(f"quorum:{k}:{timeout}")]
    if kind == "ssp":
        return [entry(f"ssp:{(shape >> 9) % 3}")]
    return [entry(kind)]


def run_sequence(h: Harness, label: str, entries: list[TableEntry], shape: int, ops: list[int],
                 swaps: list[tuple[int, str, int]] = ()) -> None:
    """One sequence from a fresh job: ``shape`` picks world, slots, chunks and window; ``swaps``
    are (op index, strategy, rounds ahead) installed as new versions at round boundaries."""
    world, slots = (4, 4, 4, 3, 2, 1, 4, 4)[shape % 8], 1 + (shape >> 3) % 2
    chunks, window = (1, 2, 3, 4)[(shape >> 4) % 4], 1 + (shape >> 6) % 3
    traffic = Traffic(world=world, slots=slots, chunks=chunks, max_chunks=8, window=window, elements=ELEMENTS,
                      addr_of=member, junk=True)
    h.start(world, slots, 8, entries)
    table = StrategyTable(parse("sync"))
    table.entries = [(e.version, e.from_round, from_entry(e)) for e in entries]
    pending = sorted(swaps)
    for i, op in enumerate(ops):
        while pending and pending[0][0] <= i:
            _, text, ahead = pending.pop(0)
            h.set_strategy(swap_table(table, table.entries[-1][0] + 1, h.model, traffic, text, ahead))
        sent: Sent = traffic.next(op)
        where = f"{label} op {i} of shape={shape} ops={ops} swaps={swaps} table={entries}"
        traffic.observe(sent, h.send(sent.data, sent.src, sent.now_ns, where))
    h.check_counters(f"{label}: counters after shape={shape} ops={ops} swaps={swaps} table={entries}")
    RUN[label] += 1


#: Shrinking a failing batch of sequences can take minutes per test; the failure message already has
#: the whole sequence (replay it with ``run_sequence``). AGGD_SHRINK=1 shrinks to a minimal one.
PHASES = tuple(Phase) if os.environ.get("AGGD_SHRINK") else (Phase.explicit, Phase.reuse, Phase.generate)
sequences = st.tuples(st.integers(0, 2**16 - 1), st.lists(st.integers(0, 2**32 - 1), min_size=MIN_OPS,
                                                         max_size=MAX_OPS))
SETTINGS = settings(max_examples=MIN_SEQUENCES // BATCH, deadline=None, database=None, phases=PHASES,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences(harness, kind):
    before = RUN[kind]

    @SETTINGS
    @given(batch=st.lists(sequences, min_size=BATCH, max_size=BATCH))
    def sequences_agree(batch):
        for shape, ops in batch:
            run_sequence(harness, kind, table_for(kind, shape), shape, ops)

    sequences_agree()
    assert RUN[kind] - before >= MIN_SEQUENCES


SWAP_TEXTS = ("sync", "quorum:3:10ms", "quorum:2:1ms", "ssp:1", "ssp:2", "async", "wbsp")
swaps = st.lists(st.tuples(st.integers(0, MAX_OPS - 1), st.sampled_from(SWAP_TEXTS), st.integers(0, 2)),
                 min_size=1, max_size=4)


def test_random_sequences_with_hot_swaps(harness):
    before = RUN["swap"]

    @settings(max_examples=SWAP_SEQUENCES // BATCH, deadline=None, database=None, phases=PHASES,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(st.tuples(sequences, st.sampled_from(SWAP_TEXTS), swaps), min_size=BATCH,
                          max_size=BATCH))
    def swapped_sequences_agree(batch):
        for (shape, ops), first, changes in batch:
            run_sequence(harness, "swap", [entry(first)], shape, ops, changes)

    swapped_sequences_agree()
    assert RUN["swap"] - before >= SWAP_SEQUENCES
