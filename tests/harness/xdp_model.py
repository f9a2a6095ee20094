"""The reference model and the real XDP program side by side (BPF_PROG_TEST_RUN): one job installed
on both, every packet through both, verdicts, bytes, destinations and counters compared. Used by
tests/bpf/test_model_equivalence.py and tests/bpf/test_fuzz_packets.py."""
from __future__ import annotations

import collections
import socket
import struct

from aggd.core.model import NO_JOB, AggregatorModel, JobConfig, TableEntry, Upstream, Verdict, member_rows
from aggd.dataplane.xdp.bpf_syscall import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run
from aggd.dataplane.xdp.loader import multicast_mac
from aggd.testing.frames import AGG_IP, udp_checksum_ok
from aggd_client.protocol import Counter, DropReason, Header, MsgType

from tests.bpf.conftest import ELEMENTS, job_config
from tests.fixtures.scenarios import GROUP, JOB, tag
from tests.fixtures.traffic import OTHER_JOB
from tests.harness.equivalence import (_AGG_MAC, MACS, STRANGER_MAC, describe, frame, ip_checksum, mac_bytes,
                                      member)

VERDICTS = {"drop": XDP_DROP, "tx": XDP_TX, "pass": XDP_PASS}
_GROUP_MAC = multicast_mac(GROUP[0])


class Harness:
    """One job on both data planes; ``send`` runs a packet through both and compares."""

    def __init__(self, dp, elements: int = ELEMENTS) -> None:
        self.dp = dp
        self.elements = elements
        self.packets = 0
        self.seen: collections.Counter = collections.Counter()   # model outcomes compared

    def start(self, world: int, slots: int, max_chunks: int, entries: list[TableEntry],
              precision: int = 0, bound=None, norm_bound=None) -> None:
        members = {r: member(r) for r in range(world)}
        self.model = AggregatorModel(self.elements, frames_grow=not self.dp.frags)
        self.model.add_job(JobConfig(job=JOB, world=world, slots=slots, max_chunks=max_chunks,
                                     members=members, tags={r: tag(r) for r in members}, group=GROUP,
                                     precision=precision, bound=bound, norm_bound=norm_bound))
        self.dp.remove_job(OTHER_JOB)
        self.dp.install_job(job_config(job=JOB, world=world, slots=slots, max_chunks=max_chunks, group=GROUP,
                                       members=members, tags={r: tag(r) for r in members}, precision=precision,
                                       bound=bound, norm_bound=norm_bound))
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
        # a fixed IP ID with don't-fragment, and on results a UDP checksum: a receiver's GRO
        # coalesces a train of results only so (docs/protocol.md, "Transport")
        assert out[18:22] == b"\0\0\x40\0", why
        if Header.unpack(msg).type == MsgType.RESULT:
            assert udp_checksum_ok(out) is True, why
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


#: The next hop to a rack job's upper aggregator, as the fixtures give it.
UPPER_MAC = mac_bytes("02:00:00:00:09:01")


class RackPair:
    """A rack job (docs/protocol.md, "Two levels") on the model and the XDP program side by side:
    ``process(data, src, now_ns)`` runs the packet through both, checks that they agree (verdict,
    bytes, where it goes: the job's group, the sender, the upper aggregator) and returns the
    model's verdict, so it can stand for a rack in tests/harness/tree_sim.py."""

    def __init__(self, dp, cfg: JobConfig, upstream: Upstream, elements: int = ELEMENTS) -> None:
        self.dp, self.cfg, self.upstream, self.elements = dp, cfg, upstream, elements
        self.model = AggregatorModel(elements)
        self.model.add_job(cfg)
        self.dp.remove_job(cfg.job)
        self.dp.install_job(job_config(job=cfg.job, world=cfg.world, slots=cfg.slots, max_chunks=cfg.max_chunks,
                                       group=cfg.group, members=cfg.members, tags=cfg.tags,
                                       upstream=cfg.upstream))
        self.dp._reset_stats(NO_JOB)
        self.link(upstream)

    def link(self, upstream: Upstream) -> None:
        self.model.set_upstream(self.cfg.job, upstream)
        self.dp.set_upstream(self.cfg.job, upstream, via=(AGG_IP, _AGG_MAC, UPPER_MAC))

    def process(self, data: bytes, src: tuple[str, int], now_ns: int = 0) -> Verdict:
        v = self.model.process(data, src, now_ns)
        self.dp.set_clock(now_ns or 1)
        pkt = frame(data, src)
        res = prog_test_run(self.dp.prog_fd, pkt)
        why = f"  in : {describe(data)} from {src}\n  model: {v.action} {v.reason} {v.dest} " \
              f"{describe(v.out)}\n  xdp  : {res.verdict_name}"
        if res.verdict == XDP_TX:
            why += f" to {socket.inet_ntoa(res.packet[30:34])} {describe(res.packet[42:])}"
        assert res.verdict == VERDICTS[v.action], why
        if v.action != "tx":
            return v
        out = res.packet
        udp_len = struct.unpack_from("!H", out, 38)[0]
        assert out[42:34 + udp_len] == v.out, why
        eth_dst, ip_dst, dport = out[0:6], socket.inet_ntoa(out[30:34]), struct.unpack_from("!H", out, 36)[0]
        if v.dest == "group":
            where = (multicast_mac(self.cfg.group[0]), self.cfg.group[0], self.cfg.group[1])
        elif v.dest == "upstream":
            where = (UPPER_MAC, *self.upstream.addr)
        else:
            where = (mac_bytes(MACS.get(src, STRANGER_MAC)), src[0], src[1])
        assert (eth_dst, ip_dst, dport) == where, why
        assert socket.inet_ntoa(out[26:30]) == AGG_IP and ip_checksum(out[14:34]) == 0, why
        # a fixed IP ID with don't-fragment, and for int32 results a UDP checksum: a receiver's GRO
        # coalesces a train of results only so (docs/protocol.md, "Transport")
        assert out[18:22] == b"\0\0\x40\0", why
        # (an upper result relayed down has none: its addresses changed)
        assert udp_checksum_ok(out) is not False, why
        return v

    def check_counters(self) -> None:
        job = self.cfg.job
        counters = self.model.counters(job)
        assert {c.name.lower(): int(counters[c]) for c in Counter} == self.dp.job_stats(job).counters
        drops = self.model.drops(job)
        assert {r.name.lower(): int(drops[r]) for r in DropReason} == self.dp.job_stats(job).drops
