"""The real daemon with ``[dataplane] kind = "p4"``: started as a process (as every service test), its
switch a fake P4Runtime server (``tests/harness/p4_switch.py``: strict about ids, widths and existence, keeping
tables and multicast groups as a switch would) and BMv2's Thrift register API served from an
in-memory register file of the program's sizes. What aggctl asks for must arrive at the switch as
P4Runtime writes (jobs, members from a worker's JOIN over the network, multicast groups, strategy
versions) and register writes, and what the switch's registers hold must come back through aggctl
and /metrics. No switch runs the program here: what the program computes is tests/p4's business."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from aggd.dataplane.p4 import layout as L
from aggd.core.hotswap import SWAP_MARGIN
from aggd.core.strategy import parse, to_entry
from aggd_client import protocol as proto
from tests.harness.p4_switch import SimSwitch, ThriftRegisterServer, settled_rows, switch_config

pytestmark = pytest.mark.root

AGG_PORT_NO = 100


def hosts_of(lab) -> dict[str, tuple[str, int]]:
    """The lab's hosts as switch ports: the daemon host on 100, worker i on i + 1."""
    hosts = {lab.agg_ip: (lab.agg_mac, AGG_PORT_NO)}
    hosts.update({lab.worker_ip(i): (lab.worker_mac(i), i + 1) for i in range(lab.workers)})
    return hosts


@pytest.fixture
def switch():
    from aggd.dataplane.p4.p4info import P4Info
    sim = SimSwitch(P4Info(), {})
    thrift = ThriftRegisterServer(sim.registers)
    yield sim, thrift
    thrift.close()
    sim.close()


def p4_daemon(make_daemon, lab, grpc_address, thrift, **p4):
    settings = {"grpc": grpc_address, "registers": thrift.address, "timeout": 5,
                "hosts": {ip: list(v) for ip, v in hosts_of(lab).items()}, **p4}
    return make_daemon(lab, dataplane={"kind": "p4"}, p4=settings)


JOIN = textwrap.dedent("""
    import sys
    from aggd_client import join
    join((sys.argv[1], 47000), sys.argv[2], int(sys.argv[3]), sys.argv[4], bind=(sys.argv[5], 40000),
         timeout=10).close()
    print("joined")
""")


def scrape(lab) -> str:
    from aggd.lab.namespaces import in_netns
    with in_netns(lab.agg_ns), urllib.request.urlopen("http://127.0.0.1:9477/metrics", timeout=10) as resp:
        return resp.read().decode()


def sample(text: str, name: str, **labels) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = f"{name}{{{want}}} " if labels else f"{name} "
    for row in text.splitlines():
        if row.startswith(line):
            return float(row.split()[-1])
    return None


def test_daemon_drives_the_switch(make_lab, make_daemon, tmp_path):
    """As docs/p4.md sets up BMv2 in a lab: P4Runtime on a Unix socket, the Thrift register server
    in the switch's namespace (p4.registers_netns), the daemon's user-space path in the
    aggregator's (dataplane.netns)."""
    from aggd.dataplane.p4.p4info import P4Info
    lab = make_lab(2)
    hosts = hosts_of(lab)
    sim = SimSwitch(P4Info(), {})
    grpc_server, grpc_address = sim.fake.serve(f"unix:{tmp_path / 'p4rt.sock'}")
    thrift = ThriftRegisterServer(sim.registers, netns=lab.switch_ns)
    try:
        run_daemon_against_the_switch(make_daemon, lab, hosts, sim, grpc_address, thrift)
    finally:
        thrift.close()
        grpc_server.stop(None)
        sim.close()


def run_daemon_against_the_switch(make_daemon, lab, hosts, sim, grpc_address, thrift):
    fake, regs = sim.fake, sim.registers
    d = p4_daemon(make_daemon, lab, grpc_address, thrift, registers_netns=lab.switch_ns)

    # at start: the service address and the hosts' L2 entries, the flood group of every host port
    service = fake.entries(L.SERVICE)
    assert [(e.m["hdr.ipv4.dst_addr"], e.m["hdr.udp.dst_port"]) for e in service] == \
        [(int.from_bytes(socket.inet_aton(lab.agg_ip), "big"), 47000)]
    assert len(fake.entries(L.FORWARD)) == len(hosts)
    assert fake.groups[L.FLOOD_GROUP] == (1, 2, AGG_PORT_NO)
    assert f"serving on {lab.agg_ip}:47000 (P4 bmv2 switch at {grpc_address})" in d.log()
    status = d.aggctl("status")
    assert status.exit_code == 0, status.output
    assert f"P4 bmv2 switch at {grpc_address} (connected)" in status.output
    s = d.call("status")
    assert s["dataplane"]["kind"] == "p4" and s["kernel"]["budget_bytes"] is None
    assert s["kernel"]["budget_slots"] == s["dataplane"]["p4"]["program_slots"] > 0

    # a job from aggctl: members (none yet), its strategy, its multicast group, then the jobs entry
    res = d.aggctl("jobs", "create", "train", "--world", "2", "--slots", "8", "--strategy", "quorum:2:20ms",
                   "--json")
    assert res.exit_code == 0, res.output + d.log()
    job = json.loads(res.output)
    view = switch_config(fake, hosts)[job["id"]]
    assert (view.cfg.world, view.cfg.slots, view.cfg.members) == (2, 8, {})
    assert view.params["switch_slots"] == job["kernel_slots"] == 8
    assert view.cfg.group == tuple(job["group"])
    assert view.rows == [to_entry(parse("quorum:2:20ms"), 0, 0)]
    assert fake.groups[L.job_group(job["id"])] == ()
    # ... and its slots and counters cleared on the switch, over Thrift
    assert thrift.calls > 0
    assert regs.read(L.REG_MAX_ROUND, job["id"]) == 0

    # a worker joins over the network: its member entry and its port in the job's group
    out = lab.check_output(lab.worker_ns(1), [sys.executable, "-c", JOIN, lab.agg_ip, "train", "1",
                                              job["token"], lab.worker_ip(1)], timeout=60)
    assert "joined" in out
    view = switch_config(fake, hosts)[job["id"]]
    assert view.cfg.members == {1: (lab.worker_ip(1), 40000)}
    assert view.ports == (2,)

    # a hot swap: a new version from a later round, written as the settled range entries
    res = d.aggctl("strategy", "set", "train", "sync", "--from-round", "5")
    assert res.exit_code == 0, res.output + d.log()
    assert settled_rows(fake, job["id"]) == [to_entry(parse("quorum:2:20ms"), 0, 0),
                                             to_entry(parse("sync"), 1, 5)]
    shown = d.call("strategy.show", job="train")
    assert [v["version"] for v in shown["versions"]] == [0, 1]
    # a round already reached on the switch (its max_round register) bounds the next swap
    regs.write(L.REG_MAX_ROUND, job["id"], 0)
    regs.write(L.REG_BANK_STATE, L.bank_index(view.params["slot_base"], 0), L.BANK_OPEN)
    regs.write(L.REG_BANK_ROUND, L.bank_index(view.params["slot_base"], 0), 9)
    regs.write(L.REG_BANK_BITMAP, L.bank_index(view.params["slot_base"], 0), 0b10)
    workers = d.call("workers", job="train")
    assert workers["round"] == 9 and workers["workers"][1]["last_round"] == 9
    refused = d.aggctl("strategy", "set", "train", "quorum:1:5ms", "--from-round", "8")
    assert refused.exit_code != 0 and "reached round 9" in refused.output
    res = d.aggctl("strategy", "set", "train", "quorum:1:5ms")
    assert res.exit_code == 0, res.output
    rows = settled_rows(fake, job["id"])
    assert rows[-1] == to_entry(parse("quorum:1:5ms"), 2, 9 + SWAP_MARGIN)  # round 9 + the margin

    # the switch's counters, as its registers hold them, through aggctl and /metrics
    regs.write(L.REG_JOB_COUNTERS, L.counter_index(job["id"], proto.Counter.CONTRIBUTIONS), 42)
    regs.write_counter(L.CTR_DROPS, L.drop_index(job["id"], proto.DropReason.NOT_MEMBER), 3)
    paths = d.call("jobs.show", job="train")["paths"]["kernel"]
    assert paths["counters"]["contributions"] == 42 and paths["drops"]["not_member"] == 3
    shown = d.aggctl("jobs", "show", "train")
    assert shown.exit_code == 0, shown.output
    assert "  switch:     slots 0..7" in shown.output
    assert any(line.split() == ["contributions", "42", "0"] for line in shown.output.splitlines()), shown.output
    text = scrape(lab)
    assert sample(text, "aggd_p4_connected") == 1.0
    assert sample(text, "aggd_xdp_attached") is None and sample(text, "aggd_kernel_memory_bytes") is None
    assert sample(text, "aggd_job_slots_busy", aggd_job="train", path="kernel") == 1.0
    assert sample(text, "aggd_kernel_slots_allocated") == 8.0

    # deleted: every entry and the group gone, as before the job
    before = {k: v for k, v in fake.tables.items() if v.table in (L.SERVICE, L.FORWARD)}
    d.call("jobs.create", name="other", world=3, slots=4)
    res = d.aggctl("jobs", "delete", "other")
    assert res.exit_code == 0, res.output
    assert set(switch_config(fake, hosts)) == {job["id"]}
    assert {k: v for k, v in fake.tables.items() if v.table in (L.SERVICE, L.FORWARD)} == before

    # a restart finds the switch as the old daemon left it: its entries are replaced, the job
    # comes back from state.json with its members and strategy versions
    assert d.stop(signal.SIGTERM) == 0
    gen = fake.generation[job["id"]]
    d.start()
    view = switch_config(fake, hosts)[job["id"]]
    assert view.generation == gen + 1
    assert view.cfg.members == {1: (lab.worker_ip(1), 40000)}
    assert view.rows == rows
    assert len(fake.entries(L.SERVICE)) == 1 and fake.groups[L.FLOOD_GROUP] == (1, 2, AGG_PORT_NO)
    assert "left on the switch" in d.log()


FAKE_SDE = Path(__file__).resolve().parents[1] / "p4" / "fake_sde"


def test_tofino_target(make_lab, make_daemon):
    """target = "tofino": the TNA program's P4Info, 32 values a packet, registers over BF Runtime
    (the SDE's bfrt_grpc: a stand-in here, tests/p4/fake_sde). Sync and quorum run; ssp, async and
    wbsp and slot counts that are not powers of two are refused by aggctl with the reason, and
    nothing changes; a member is declared gone and readmitted on the switch; counters the TNA
    program does not keep are absent. Without bfrt_grpc the daemon does not start, saying so."""
    from aggd.dataplane.p4.p4info import TNA_P4INFO, P4Info
    sim = SimSwitch(P4Info(TNA_P4INFO), {})
    lab = make_lab(1)
    hosts = hosts_of(lab)
    try:
        d = make_daemon(lab, start=False, dataplane={"kind": "p4", "elements_per_packet": 32},
                        p4={"target": "tofino", "grpc": sim.address, "registers": "127.0.0.1:50052", "timeout": 2,
                            "hosts": {ip: list(v) for ip, v in hosts.items()}})
        d.start(wait=False)
        assert d.proc.wait(60) == 1
        log = d.log()
        assert "cannot start: the P4 switch at" in log and "bfrt_grpc" in log and "Traceback" not in log

        d.start(env={"PYTHONPATH": f"{FAKE_SDE}:{os.environ.get('PYTHONPATH', '')}"})
        assert len(sim.fake.entries(L.TNA_RANK_BITS)) == proto.MAX_MEMBERS
        job = d.call("jobs.create", name="tna", world=2, slots=8, strategy="quorum:2:5ms")
        view = switch_config(sim.fake, hosts)[job["id"]]
        assert view.rows == [to_entry(parse("quorum:2:5ms"), 0, 0)] and view.params["switch_slots"] == 8
        requests = len(sim.fake.requests)
        for strategy in ("ssp:1", "async", "wbsp"):
            res = d.aggctl("strategy", "set", "tna", strategy)
            assert res.exit_code != 0 and "sync and quorum only" in res.output, res.output
        res = d.aggctl("jobs", "create", "odd", "--world", "2", "--slots", "6")
        assert res.exit_code != 0 and "slots must be a power of two" in res.output, res.output
        assert len(sim.fake.requests) == requests                      # nothing written for any of them
        assert [j["name"] for j in d.call("jobs.list")] == ["tna"]
        assert [v["version"] for v in d.call("strategy.show", job="tna")["versions"]] == [0]
        res = d.aggctl("strategy", "set", "tna", "sync")
        assert res.exit_code == 0, res.output
        assert settled_rows(sim.fake, job["id"])[-1].kind == proto.StrategyKind.SYNC
        # a member declared gone: the jobs entry's all_members, which the TNA program's sync release
        # test reads, leaves it out; readmitted, it is back
        res = d.aggctl("workers", "remove", "tna", "1")
        assert res.exit_code == 0, res.output
        assert switch_config(sim.fake, hosts)[job["id"]].params["all_members"] == 0b01
        assert d.call("workers", job="tna")["workers"][1]["gone"]
        res = d.aggctl("workers", "readmit", "tna", "1")
        assert res.exit_code == 0, res.output
        assert switch_config(sim.fake, hosts)[job["id"]].params["all_members"] == 0b11
        counters = d.call("jobs.show", job="tna")["paths"]["kernel"]["counters"]
        assert set(counters) == {"rx_packets", "contributions", "released", "rereads", "to_userspace"}
        shown = d.aggctl("jobs", "show", "tna").output.splitlines()
        assert any(line.split()[:2] == ["retransmits", "-"] for line in shown), shown    # not kept: not 0
        text = scrape(lab)
        assert sample(text, "aggd_packets_total", aggd_job="tna", path="kernel") == 0.0
        assert sample(text, "aggd_bytes_total", aggd_job="tna", path="kernel") is None
        status = d.aggctl("status")
        assert "P4 tofino switch at" in status.output, status.output
    finally:
        sim.close()


def test_unreachable_switch_is_a_clear_error(make_lab, make_daemon, switch):
    sim, thrift = switch
    lab = make_lab(1)
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{port.getsockname()[1]}"       # bound, never listening: nobody answers
    try:
        d = make_daemon(lab, start=False, dataplane={"kind": "p4"},
                        p4={"grpc": dead, "registers": thrift.address, "timeout": 1,
                            "hosts": {lab.agg_ip: [lab.agg_mac, AGG_PORT_NO]}})
        t0 = time.monotonic()
        d.start(wait=False)
        assert d.proc.wait(60) == 1 and time.monotonic() - t0 < 30
        log = d.log()
        assert f"cannot start: the P4 switch at {dead}" in log and "no P4Runtime server" in log
        assert "Traceback" not in log
        # the switch is up but its registers are not: named as well
        d.configure(p4={"grpc": sim.address, "registers": dead})
        d.start(wait=False)
        assert d.proc.wait(60) == 1
        assert f"no BMv2 Thrift server at {dead}" in d.log() and "Traceback" not in d.log()
        d.configure(p4={"registers": thrift.address, "registers_netns": "no-such-ns"})
        d.start(wait=False)
        assert d.proc.wait(60) == 1
        assert "p4.registers_netns: no network namespace no-such-ns" in d.log()
    finally:
        port.close()
