"""The aggd P4 program on a real BMv2 switch in the lab: compiled by p4c, run by simple_switch_grpc,
installed by P4DataPlane, fed the strategy fixture tables from the lab's workers, and compared
message by message and counter by counter with the reference model.

Needs p4c (``p4c-bm2-ss``) and BMv2 (``simple_switch_grpc``), which no registry this project reaches
has: without them every test here is skipped, naming what is missing (docs/p4.md says how to
install them). The only skipping test of tests/p4.
"""
from __future__ import annotations

import select
import shutil
import socket
import subprocess
import time
import types
from pathlib import Path

import pytest

from aggd.dataplane.p4.backend import P4DataPlane
from aggd.dataplane.p4.p4info import P4INFO, P4Info
from aggd.lab.namespaces import in_netns
from aggd.core.model import AggregatorModel, JobConfig
from aggd_client import protocol as proto

from tests.fixtures.scenarios import GROUP, JOB, SCENARIOS, Depart, Swap, T0_NS, check, tag

TOOLS = ("p4c-bm2-ss", "simple_switch_grpc")
MISSING = [t for t in TOOLS if shutil.which(t) is None]
pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(bool(MISSING), reason=f"needs {' and '.join(MISSING)} (p4c and BMv2 are not installable "
                                             f"from any registry here; docs/p4.md, 'BMv2', says how to build them)"),
]

SOURCE = P4INFO.parent / "aggd.p4"
ELEMENTS = 256
AGG_SWITCH_PORT = 100
QUIET = 0.3          #: seconds without a message that mean "nothing was sent"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("p4build")
    subprocess.run(["p4c-bm2-ss", "--arch", "v1model", "--std", "p4-16", "-o", str(out / "aggd.json"),
                    "--p4runtime-files", str(out / "aggd.p4info.txtpb"), str(SOURCE)], check=True)
    return out / "aggd.json", out / "aggd.p4info.txtpb"


def test_compiled_p4info_is_the_committed_one(compiled):
    """p4c's P4Info has every object of the hand-kept one, with the same ids, types and sizes."""
    ours, theirs = P4Info(P4INFO), P4Info(compiled[1])
    P4DataPlane.check_program(theirs)
    for kind in ("tables", "actions", "registers", "counters"):
        for name, obj in getattr(ours, kind).items():
            other = getattr(theirs, kind).get(name)
            assert other is not None, f"p4c's P4Info has no {kind[:-1]} {name}"
            assert other.preamble.id == obj.preamble.id, name
            for f in ("match_fields", "params", "size", "type_spec", "spec"):
                if hasattr(obj, f):
                    assert getattr(other, f) == getattr(obj, f), (name, f)


class Bmv2Lab:
    """A lab whose switch namespace runs simple_switch_grpc instead of the Linux bridge."""

    def __init__(self, lab, compiled, tmp: Path) -> None:
        self.lab = lab
        ports = [(AGG_SWITCH_PORT, "sw-agg")] + [(i + 1, f"sw-w{i}") for i in range(lab.workers)]
        for _, ifname in ports:
            lab.check_output(lab.switch_ns, ["ip", "link", "set", ifname, "nomaster"])
        lab.check_output(lab.switch_ns, ["ip", "link", "del", lab.bridge])
        self.grpc = f"unix:{tmp / 'p4runtime.sock'}"       # the filesystem crosses namespaces, TCP does not
        argv = ["simple_switch_grpc", "--device-id", "0", "--no-p4", "--thrift-port", "9090", "--log-console"]
        for port, ifname in ports:
            argv += ["-i", f"{port}@{ifname}"]
        argv += ["--", "--grpc-server-addr", self.grpc]
        self.log = open(tmp / "bmv2.log", "w")
        self.proc = lab.run(lab.switch_ns, argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while not (tmp / "p4runtime.sock").exists():
            assert self.proc.poll() is None and time.time() < deadline, (tmp / "bmv2.log").read_text()[-2000:]
            time.sleep(0.1)
        self.hosts = {lab.agg_ip: (lab.agg_mac, AGG_SWITCH_PORT)}
        self.hosts |= {lab.worker_ip(i): (lab.worker_mac(i), i + 1) for i in range(lab.workers)}
        from aggd.dataplane.p4.thrift import Bmv2Registers
        with in_netns(lab.switch_ns):                       # the Thrift socket lives in the switch's namespace
            registers = Bmv2Registers("127.0.0.1:9090")
        self.dp = P4DataPlane(self.grpc, address=lab.agg_ip, hosts=self.hosts, registers=registers,
                              device_config=compiled[0], p4info=compiled[1], elements=ELEMENTS)
        self.dp._owned.append(registers)
        self.sockets = {}
        self.group_sockets = {}
        for i in range(lab.workers):
            with in_netns(lab.worker_ns(i)):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.bind((lab.worker_ip(i), 40000 + i))
                g = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                g.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                g.bind(("", GROUP[1]))
                g.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                             socket.inet_aton(GROUP[0]) + socket.inet_aton(lab.worker_ip(i)))
            self.sockets[i], self.group_sockets[i] = s, g

    def addr(self, rank: int) -> tuple[str, int]:
        return (self.lab.worker_ip(rank), 40000 + rank)

    def send(self, rank: int, data: bytes) -> dict[tuple[int, str], bytes]:
        """Send from worker ``rank``; what arrived within QUIET seconds, by (rank, "group"|"unicast")."""
        self.sockets[rank].sendto(data, (self.lab.agg_ip, proto.DEFAULT_PORT))
        got, socks = {}, {s: (r, "unicast") for r, s in self.sockets.items()}
        socks |= {s: (r, "group") for r, s in self.group_sockets.items()}
        end = time.time() + QUIET
        while time.time() < end:
            ready, _, _ = select.select(list(socks), [], [], max(0.0, end - time.time()))
            for s in ready:
                got[socks[s]] = s.recv(65536)
        return got

    def close(self) -> None:
        for s in (*self.sockets.values(), *self.group_sockets.values()):
            s.close()
        self.dp.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def bmv2(make_lab, compiled, tmp_path):
    lab = make_lab(workers=4)
    b = Bmv2Lab(lab, compiled, tmp_path)
    yield b
    b.close()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_on_bmv2(bmv2, name):
    """Each fixture table on the switch, clock frozen per step: every answer (bytes, and who gets
    it) and every counter as the model says."""
    sc = SCENARIOS[name]
    members = {r: bmv2.addr(r) for r in range(sc.world)}
    tags = {r: tag(r) for r in members}
    cfg = types.SimpleNamespace(job=JOB, world=sc.world, slots=sc.slots, max_chunks=sc.max_chunks,
                                members=members, tags=tags, group=GROUP)
    bmv2.dp.install_job(cfg)
    bmv2.dp.set_strategy(JOB, list(sc.table))
    model = AggregatorModel(ELEMENTS)
    model.add_job(JobConfig(job=JOB, world=sc.world, slots=sc.slots, max_chunks=sc.max_chunks,
                            members=members, tags=tags, group=GROUP))
    model.set_strategy(JOB, list(sc.table))
    for i, step in enumerate(sc.steps):
        if isinstance(step, Swap):
            bmv2.dp.set_strategy(JOB, list(step.entries))
            model.set_strategy(JOB, list(step.entries))
            continue
        if isinstance(step, Depart):
            bmv2.dp.set_awaited(JOB, step.awaited)
            model.set_awaited(JOB, step.awaited)
            continue
        t_us, p, exp = step
        now = T0_NS + t_us * 1000
        bmv2.dp.set_clock(now)
        data = p.build(ELEMENTS)
        v = model.process(data, bmv2.addr(p.rank), now)
        check(v, exp, ELEMENTS, where=f"step {i}")
        got = bmv2.send(p.rank, data)
        if v.action == "drop":
            assert got == {}, (i, got)
        elif v.dest == "group":
            assert got == {(r, "group"): v.out for r in range(sc.world)}, (i, got)
        else:
            assert got == {(p.rank, "unicast"): v.out}, (i, got)
    stats = bmv2.dp.job_stats(JOB)
    assert stats.counters == {c.name.lower(): int(model.counters(JOB)[c]) for c in proto.Counter}
    assert stats.drops == {r.name.lower(): int(model.drops(JOB)[r]) for r in proto.DropReason}


def test_other_traffic_is_switched(bmv2):
    """A plain L2 switch for everything else: workers reach the aggregator's host by ping."""
    assert bmv2.lab.ping(bmv2.lab.worker_ns(0), bmv2.lab.agg_ip, timeout=2.0)

