"""The reference model and the real XDP program, packet by packet (BPF_PROG_TEST_RUN).

Every packet goes through ``aggd.core.model.AggregatorModel`` and through the production XDP program; they
must agree on the verdict (XDP_DROP / XDP_TX / XDP_PASS), on the bytes of the aggd message sent and
on where it goes (the job's group or the sender), and, at the end of each sequence, on every per-job
counter and drop counter (the job's and the "no job" bucket). Time is frozen: the model gets
``now_ns`` and the program reads the same value from its one-entry ``clock`` map
(``XdpDataPlane.set_clock``); strategy tables go to both with ``set_strategy``.

Runs: the strategy fixture tables of tests/fixtures/scenarios.py (with their expectations),
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
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from aggd.dataplane.xdp.bpf_syscall import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run
from aggd.dataplane.xdp.loader import multicast_mac
from aggd.core.model import NO_JOB, AggregatorModel, JobConfig, TableEntry, Verdict, member_rows
from aggd.testing.frames import AGG_IP
from aggd_client.protocol import Counter, DropReason

from tests.harness.equivalence import (KINDS, MACS, NO_SHRINK, SEQUENCE_SETTINGS, STRANGER_MAC, SWAP_TEXTS, describe, frame,
                           ip_checksum, mac_bytes, member, play_scenario, departures, run_sequence, sequences, swaps,
                           table_for)
from tests.fixtures.scenarios import GROUP, JOB, SCENARIOS, entry, tag
from tests.fixtures.traffic import OTHER_JOB
from .conftest import ELEMENTS, job_config

pytestmark = pytest.mark.root

MIN_SEQUENCES = 1000     #: per strategy
BATCH = 5                #: sequences per hypothesis example
SWAP_SEQUENCES = 1000    #: sequences with random strategy swaps
DEPARTURE_SEQUENCES = 500  #: sequences in which members are declared gone (and come back)
ODD_ELEMENTS = 7         #: a packet size the pairwise payload loops do not divide
ODD_SEQUENCES = 200      #: per strategy, at ODD_ELEMENTS
VERDICTS = {"drop": XDP_DROP, "tx": XDP_TX, "pass": XDP_PASS}
_GROUP_MAC = multicast_mac(GROUP[0])


# ---------------------------------------------------------------------------------------------
# The two data planes side by side.

class Harness:
    """One job on both data planes; ``send`` runs a packet through both and compares."""

    def __init__(self, dp, elements: int = ELEMENTS) -> None:
        self.dp = dp
        self.elements = elements
        self.packets = 0
        self.seen: collections.Counter = collections.Counter()   # model outcomes compared

    def start(self, world: int, slots: int, max_chunks: int, entries: list[TableEntry]) -> None:
        members = {r: member(r) for r in range(world)}
        self.model = AggregatorModel(self.elements)
        self.model.add_job(JobConfig(job=JOB, world=world, slots=slots, max_chunks=max_chunks,
                                     members=members, tags={r: tag(r) for r in members}, group=GROUP))
        self.dp.remove_job(OTHER_JOB)
        self.dp.install_job(job_config(job=JOB, world=world, slots=slots, max_chunks=max_chunks, group=GROUP,
                                       members=members, tags={r: tag(r) for r in members}))
        self.dp._reset_stats(NO_JOB)
        self.set_strategy(entries)

    def set_strategy(self, entries: list[TableEntry]) -> None:
        self.model.set_strategy(JOB, entries)
        self.dp.set_strategy(JOB, entries)

    def set_awaited(self, awaited: int) -> None:
        self.model.set_awaited(JOB, awaited)
        self.dp.set_awaited(JOB, awaited)

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
            assert (eth_dst, ip_dst, dport) == (mac_bytes(MACS.get(src, STRANGER_MAC)), src[0], src[1]), why
        assert socket.inet_ntoa(out[26:30]) == AGG_IP and ip_checksum(out[14:34]) == 0, why
        return v

    def check_counters(self, where: str = "") -> None:
        xdp = self.dp.job_stats(JOB)
        counters = self.model.counters(JOB)
        assert {c.name.lower(): int(counters[c]) for c in Counter} == xdp.counters, where
        drops = self.model.drops(JOB)
        assert {r.name.lower(): int(drops[r]) for r in DropReason} == xdp.drops, where
        no_job = self.model.drops(NO_JOB)
        assert {r.name.lower(): int(no_job[r]) for r in DropReason} == self.dp.job_stats(None).drops, where
        state = self.model.jobs[JOB]
        assert member_rows(state.members, state.cfg.world) == self.dp.member_stats(JOB, state.cfg.world), where


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
    play_scenario(harness, name)


# ---------------------------------------------------------------------------------------------
# Randomised sequences.

RUN: collections.Counter = collections.Counter()   # sequences compared, by strategy

#: AGGD_SHRINK=1 shrinks a failing batch to a minimal one (minutes per test).
PHASES = tuple(Phase) if os.environ.get("AGGD_SHRINK") else NO_SHRINK
SETTINGS = settings(SEQUENCE_SETTINGS, max_examples=MIN_SEQUENCES // BATCH, phases=PHASES)


@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences(harness, kind):
    before = RUN[kind]

    @SETTINGS
    @given(batch=st.lists(sequences, min_size=BATCH, max_size=BATCH))
    def sequences_agree(batch):
        for shape, ops in batch:
            run_sequence(harness, RUN, kind, table_for(kind, shape), shape, ops)

    sequences_agree()
    assert RUN[kind] - before >= MIN_SEQUENCES


@pytest.fixture(scope="module")
def odd_harness():
    """The program built for an odd packet size: the payload loops that take lanes in pairs end with a
    lone lane (xdp/aggd_lanes.h)."""
    from aggd.dataplane.xdp.loader import XdpDataPlane
    dp = XdpDataPlane(None, elements=ODD_ELEMENTS, total_slots=64)
    yield Harness(dp, ODD_ELEMENTS)
    dp.close()


@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences_odd_elements(odd_harness, kind):
    before = RUN[f"odd {kind}"]

    @settings(SETTINGS, max_examples=ODD_SEQUENCES // BATCH)
    @given(batch=st.lists(sequences, min_size=BATCH, max_size=BATCH))
    def sequences_agree(batch):
        for shape, ops in batch:
            run_sequence(odd_harness, RUN, f"odd {kind}", table_for(kind, shape), shape, ops,
                         elements=ODD_ELEMENTS)

    sequences_agree()
    assert RUN[f"odd {kind}"] - before >= ODD_SEQUENCES


def test_random_sequences_with_hot_swaps(harness):
    before = RUN["swap"]

    @settings(SETTINGS, max_examples=SWAP_SEQUENCES // BATCH)
    @given(batch=st.lists(st.tuples(sequences, st.sampled_from(SWAP_TEXTS), swaps), min_size=BATCH,
                          max_size=BATCH))
    def swapped_sequences_agree(batch):
        for (shape, ops), first, changes in batch:
            run_sequence(harness, RUN, "swap", [entry(first)], shape, ops, changes)

    swapped_sequences_agree()
    assert RUN["swap"] - before >= SWAP_SEQUENCES


def test_random_sequences_with_departures(harness):
    """Members declared gone mid-sequence (and back): a round waiting only for them is released
    at the next packet to its slot (rule 0), under every strategy and across swaps."""
    before = RUN["departures"]

    @settings(SETTINGS, max_examples=DEPARTURE_SEQUENCES // BATCH)
    @given(batch=st.lists(st.tuples(sequences, st.sampled_from(SWAP_TEXTS), st.lists(swaps, max_size=1), departures),
                          min_size=BATCH, max_size=BATCH))
    def departed_sequences_agree(batch):
        for (shape, ops), first, changes, leaving in batch:
            run_sequence(harness, RUN, "departures", [entry(first)], shape, ops,
                         changes[0] if changes else (), departures=leaving)

    departed_sequences_agree()
    assert RUN["departures"] - before >= DEPARTURE_SEQUENCES
