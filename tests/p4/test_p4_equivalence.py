"""The P4 backend's writes, interpreted by the reference model, against the real XDP program.

One job is installed on both data planes by their backends: ``XdpDataPlane`` fills the XDP maps,
``P4DataPlane`` writes P4Runtime entries to a fake server on 127.0.0.1 (tests/harness/p4_switch.py). The
captured entries are read back as model configuration (jobs, members, strategy rows, multicast
groups) and the model so configured plays the switch. Every frame goes through both: verdict, the
frame sent (bytes) and where it goes (the job's replication ports, the ingress port, the daemon's
port), and at the end of each sequence every counter as each backend's ``job_stats`` reads it, must
be identical. The fixture tables and the randomised traffic are those of the XDP/model tests.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.dataplane.xdp.bpf_syscall import prog_test_run
from aggd.core.model import AggregatorModel, JobConfig, TableEntry, Verdict
from aggd.testing.frames import AGG_IP, worker_addr
from aggd_client import protocol as proto

from ..bpf.conftest import ELEMENTS, job_config
from tests.fixtures.packets import MALFORMED, contrib
from tests.harness.equivalence import (KINDS, NO_SHRINK, SEQUENCE_SETTINGS, SWAP_TEXTS, describe, frame, member,
                           departures, play_scenario, run_sequence, sequences, swaps, table_for)
from tests.fixtures.scenarios import GROUP, JOB, SCENARIOS, T0_NS, entry, tag
from tests.fixtures.traffic import OTHER_JOB
from .conftest import AGG_PORT_NO, HOSTS, port_of

pytestmark = pytest.mark.root

SEQUENCES = 300          #: randomised sequences per strategy
SWAP_SEQUENCES = 150
BATCH = 5


#: Said when the P4 path and XDP differ but the reference model, configured directly (not from the
#: P4 writes), says what the P4 path says: the difference is the model's and XDP's, not the backend's.
MODEL_XDP = ("the reference model configured without the P4 backend agrees with the P4 path: a model/XDP "
             "divergence (tests/bpf/test_model_equivalence.py shows it too), not a P4 write")


class Twin:
    """One job on the XDP program and on the P4 backend's simulated switch, plus the reference model
    configured directly from the same job (``ref``): the P4 path must equal ``ref`` (the writes
    carry the configuration exactly) and XDP (the data planes agree)."""

    def __init__(self, xdp, p4dp, sim) -> None:
        self.xdp, self.p4, self.sim = xdp, p4dp, sim
        self.seen: collections.Counter = collections.Counter()
        self.ref = AggregatorModel(ELEMENTS)

    def start(self, world: int, slots: int, max_chunks: int, entries: list[TableEntry], tagged: bool = True) -> None:
        """A fresh job; ``tagged``: its members have the fixtures' tags (the XDP fixture frames carry none)."""
        members = {r: member(r) for r in range(world)}
        tags = {r: tag(r) for r in members} if tagged else {}
        cfg = job_config(job=JOB, world=world, slots=slots, max_chunks=max_chunks, group=GROUP, members=members,
                         tags=tags)
        for dp in (self.xdp, self.p4):
            if dp is not None:
                dp.remove_job(OTHER_JOB)
                dp.install_job(cfg)
                dp.set_strategy(JOB, entries)
        if self.xdp is not None:
            self.xdp._reset_stats(proto.MAX_JOBS)
        self.p4.reset_stats(None)
        self.ref = AggregatorModel(ELEMENTS)
        self.ref.add_job(JobConfig(job=JOB, world=world, slots=slots, max_chunks=max_chunks, members=members,
                                   tags=tags, group=GROUP))
        self.ref.set_strategy(JOB, entries)

    def set_strategy(self, entries: list[TableEntry]) -> None:
        if self.xdp is not None:
            self.xdp.set_strategy(JOB, entries)
        self.p4.set_strategy(JOB, entries)
        self.ref.set_strategy(JOB, entries)

    def set_awaited(self, awaited: int) -> None:
        if self.xdp is not None:
            self.xdp.set_awaited(JOB, awaited)
        self.p4.set_awaited(JOB, awaited)
        self.ref.set_awaited(JOB, awaited)

    @property
    def model(self):
        self.sim.sync_model()
        return self.sim.model

    def send_frame(self, pkt: bytes, src_ip: str, now_ns: int, where: str = "") -> Verdict | None:
        out = self.sim.process(pkt, port_of(src_ip), now_ns)
        v = out.verdict
        why = f"{where}\n  in : {describe(pkt[42:])} from {src_ip} at {now_ns}\n  p4 : {out.action} " \
              f"{None if v is None else (v.action, v.reason, v.dest)} {describe(out.frame[42:] if out.frame else None)}"
        self.seen[(out.action, None if v is None or v.reason is None else v.reason.name.lower())] += 1
        if out.msg is not None:
            r = self.ref.process(out.msg, out.src, now_ns)
            assert (r.action, r.reason, r.out, r.dest, r.job) == (v.action, v.reason, v.out, v.dest, v.job), \
                f"the P4 writes configure another aggregator than the job's:{why}\n  ref: {r}"
        if self.xdp is None:
            return v
        self.xdp.set_clock(now_ns)
        res = prog_test_run(self.xdp.prog_fd, pkt)
        why += f"\n  xdp: {res.verdict_name} {describe(res.packet[42:]) if res.verdict_name == 'tx' else ''}"
        if not _xdp_agrees(res, out, pkt):
            why += f"\n  ({MODEL_XDP})"
        if res.verdict_name == "pass":
            assert out.action == "forward" and out.frame == pkt, why
            if v is not None:                          # an aggd message for the daemon's user-space path
                assert out.ports == (AGG_PORT_NO,), why
        elif res.verdict_name == "drop":
            assert out.action == "drop", why
        else:
            assert res.verdict_name == "tx" and out.action == "tx", why
            assert out.frame == without_udp_checksum(res.packet), why
            if v.dest == "group":
                assert set(out.ports) == {HOSTS[ip][1] for ip, _ in self.sim.model.jobs[v.job].cfg.members.values()}, why
            else:
                assert out.ports == (port_of(src_ip),), why
        return v

    def send(self, data: bytes, src: tuple[str, int], now_ns: int, where: str = "") -> Verdict:
        return self.send_frame(frame(data, src), src[0], now_ns, where)

    def check_counters(self, where: str = "") -> None:
        ref = self.ref.stats()
        p4 = self.p4.job_stats(JOB)
        assert {k: ref["jobs"][JOB]["counters"][k] for k in p4.counters} == p4.counters, where
        assert ref["jobs"][JOB]["drops"] == p4.drops, where
        if self.xdp is None:
            return
        for job in (JOB, None):
            x, q = self.xdp.job_stats(job), self.p4.job_stats(job)
            diff = {k: (q.counters[k], x.counters[k]) for k in q.counters if q.counters[k] != x.counters[k]}
            diff |= {k: (q.drops[k], x.drops[k]) for k in q.drops if q.drops[k] != x.drops[k]}
            assert not diff, (where, job, "(p4, xdp):", diff, MODEL_XDP)
        assert self.p4.max_round(JOB) == self.xdp.max_round(JOB), where


def _xdp_agrees(res, out, pkt) -> bool:
    if res.verdict_name == "pass":
        return out.action == "forward" and out.frame == pkt
    if res.verdict_name == "drop":
        return out.action == "drop"
    return out.action == "tx" and out.frame == without_udp_checksum(res.packet)


def without_udp_checksum(frame: bytes) -> bytes:
    """An XDP frame as the P4 program sends it: the same but for the UDP checksum, which XDP
    computes for results (docs/protocol.md, "Transport") and a switch leaves 0."""
    return frame[:40] + b"\0\0" + frame[42:]


@pytest.fixture
def twin(xdp_program, p4dp, sim):
    t = Twin(xdp_program, p4dp, sim)
    yield t
    xdp_program.set_clock(0)
    xdp_program.remove_job(JOB)


@pytest.fixture
def model_twin(p4dp, sim):
    """The P4 path against the reference model alone (no XDP, no root)."""
    return Twin(None, p4dp, sim)


# ---------------------------------------------------------------------------------------------
# The fixture tables (tests/fixtures/scenarios.py), with their expectations.

@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(twin, name):
    play_scenario(twin, name)


# ---------------------------------------------------------------------------------------------
# The XDP fixture frames (tests/bpf/test_xdp_fixtures.py).

def test_sync_round_goes_to_the_group_ports(twin):
    twin.start(3, 8, 1 << 20, [entry("sync")], tagged=False)
    for r in range(3):
        v = twin.send_frame(contrib(r), worker_addr(r)[1], T0_NS)
    assert v.dest == "group"
    twin.check_counters()


@pytest.mark.parametrize("name,make,bucket,reason,nack", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed(twin, name, make, bucket, reason, nack):
    twin.start(3, 8, 1 << 20, [entry("sync")], tagged=False)
    pkt = make()
    v = twin.send_frame(pkt, ".".join(str(b) for b in pkt[26:30]), T0_NS, name)
    assert v.reason == reason
    for r in range(3):
        twin.send_frame(contrib(r), worker_addr(r)[1], T0_NS)
    twin.check_counters(name)


def test_other_traffic_is_forwarded_untouched(twin):
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import ARP, Ether
    from scapy.packet import Raw
    twin.start(3, 8, 1 << 20, [entry("sync")], tagged=False)
    for p in (Ether() / ARP(), Ether() / IP(dst=AGG_IP) / TCP(dport=proto.DEFAULT_PORT),
              Ether() / IP(dst=AGG_IP) / UDP(dport=53) / Raw(b"x" * 100),
              Ether() / IP(dst=AGG_IP, flags="MF") / UDP(dport=proto.DEFAULT_PORT) / Raw(b"x" * 100)):
        assert twin.send_frame(bytes(p), "10.9.9.9", T0_NS) is None


def test_what_the_switch_cannot_hold_goes_to_the_daemon(twin):
    twin.start(3, 8, 1 << 20, [entry("sync")], tagged=False)
    from aggd.testing.frames import frame as mkframe
    hdr = proto.Header(type=proto.MsgType.CONTRIB, job=JOB, rank=0, count=10)
    v = twin.send_frame(mkframe(hdr, np.ones(10, np.int32)), worker_addr(0)[1], T0_NS)
    assert v.action == "pass"
    twin.check_counters()


# ---------------------------------------------------------------------------------------------
# Randomised sequences (the traffic of tests/fixtures/traffic.py).

RUN: collections.Counter = collections.Counter()


SETTINGS = settings(SEQUENCE_SETTINGS, max_examples=SEQUENCES // BATCH)
#: Against XDP: no shrinking. A difference there that the model-only tests do not show is the
#: model's and XDP's (tests/bpf/test_model_equivalence.py shrinks it); shrinking here only costs CI time.
XDP_SETTINGS = settings(SETTINGS, phases=NO_SHRINK)


@pytest.mark.parametrize("kind", KINDS)
@XDP_SETTINGS
@given(batch=st.lists(sequences, min_size=BATCH, max_size=BATCH))
def test_random_sequences(twin, kind, batch):
    for shape, ops in batch:
        run_sequence(twin, RUN, kind, table_for(kind, shape), shape, ops)


@settings(XDP_SETTINGS, max_examples=SWAP_SEQUENCES // BATCH)
@given(batch=st.lists(st.tuples(sequences, st.sampled_from(SWAP_TEXTS), swaps), min_size=BATCH, max_size=BATCH))
def test_random_sequences_with_hot_swaps(twin, batch):
    for (shape, ops), first, changes in batch:
        run_sequence(twin, RUN, "swap", [entry(first)], shape, ops, changes)


@settings(XDP_SETTINGS, max_examples=SWAP_SEQUENCES // BATCH)
@given(batch=st.lists(st.tuples(sequences, st.sampled_from(SWAP_TEXTS), departures), min_size=BATCH, max_size=BATCH))
def test_random_sequences_with_departures(twin, batch):
    """Members declared gone and back: the jobs entry's all_members, written by set_awaited."""
    for (shape, ops), first, leaving in batch:
        run_sequence(twin, RUN, "departures", [entry(first)], shape, ops, departures=leaving)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(batch=st.lists(sequences, min_size=BATCH, max_size=BATCH))
def test_random_sequences_against_the_model(model_twin, kind, batch):
    """The captured writes configure exactly the job's aggregator: the P4 path equals the model
    configured directly, message by message and counter by counter (independent of XDP)."""
    for shape, ops in batch:
        run_sequence(model_twin, RUN, f"model-{kind}", table_for(kind, shape), shape, ops)


@settings(SETTINGS, max_examples=SWAP_SEQUENCES // BATCH)
@given(batch=st.lists(st.tuples(sequences, st.sampled_from(SWAP_TEXTS), swaps), min_size=BATCH, max_size=BATCH))
def test_random_hot_swaps_against_the_model(model_twin, batch):
    for (shape, ops), first, changes in batch:
        run_sequence(model_twin, RUN, "model-swap", [entry(first)], shape, ops, changes)


def test_sequence_counts():
    """Each randomised test that ran compared its number of sequences."""
    for kind in KINDS:
        for label in (kind, f"model-{kind}"):
            if RUN[label]:
                assert RUN[label] >= SEQUENCES, (label, RUN[label])
    for label in ("swap", "model-swap"):
        if RUN[label]:
            assert RUN[label] >= SWAP_SEQUENCES, (label, RUN[label])
