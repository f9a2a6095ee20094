"""The namespace lab: connectivity, multicast flooding, XDP_TX through the bridge, loss, teardown."""
from __future__ import annotations

import contextlib
import json
import re
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from aggd.cli.main import main as aggctl
from aggd.cli.commands.lab import LossPercent
import aggd.lab.namespaces as lab_module
from aggd.lab.namespaces import Lab, LabError, in_netns, xdp_prog_id
from aggd.lab.xsk import TURN_ROUND_PROGRAM
from aggd_client.transport import UDP_SEGMENT
from tests.conftest import unique_lab_name

pytestmark = pytest.mark.root

GROUP = "239.77.0.1"
BOUNCE_PORT = 47999
SO_RCVBUFFORCE = 33  # not exported by the socket module


def udp_socket(ns: str, bind: tuple[str, int] = ("0.0.0.0", 0), timeout: float = 1.0):
    with in_netns(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(bind)
    sock.settimeout(timeout)
    return sock


def drain(sock: socket.socket, quiet: float = 0.5) -> list[bytes]:
    """Everything that arrives until ``quiet`` seconds pass without a datagram."""
    sock.settimeout(quiet)
    got = []
    try:
        while True:
            got.append(sock.recv(2048))
    except socket.timeout:
        return got


def lab_leftovers(name: str) -> list[str]:
    namespaces = subprocess.check_output(["ip", "netns", "list"], text=True)
    links = subprocess.check_output(["ip", "-o", "link", "show"], text=True)
    return [line for line in (namespaces + links).splitlines() if name in line]


def test_workers_ping_the_aggregator(make_lab):
    lab = make_lab(workers=2)
    for i in range(2):
        assert lab.ping(lab.worker_ns(i), lab.agg_ip), f"worker {i} cannot reach the aggregator"
        assert lab.ping(lab.agg_ns, lab.worker_ip(i))
    assert "10.77.0.10/24" in lab.check_output(lab.worker_ns(0), ["ip", "-o", "addr", "show", "eth0"])


def test_multicast_from_aggregator_reaches_every_worker(make_lab):
    lab = make_lab(workers=3)
    receivers = []
    for i in range(lab.workers):
        sock = udp_socket(lab.worker_ns(i), ("0.0.0.0", 47001))
        mreq = socket.inet_aton(GROUP) + socket.inet_aton(lab.worker_ip(i))  # join on eth0
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
        receivers.append(sock)
    sender = udp_socket(lab.agg_ns)
    sender.sendto(b"result", (GROUP, 47001))  # no IP_MULTICAST_IF: the lab's route picks agg0
    for i, sock in enumerate(receivers):
        data, (src, _) = sock.recvfrom(64)
        assert (data, src) == (b"result", lab.agg_ip), f"worker {i}"
        sock.close()
    sender.close()


def test_xdp_tx_on_agg0_comes_back_through_the_bridge(make_lab):
    from bcc import BPF

    lab = make_lab(workers=2)
    assert xdp_prog_id(lab.switch_ns, "sw-agg"), "the peer XDP_PASS program is missing"
    bpf = BPF(text=TURN_ROUND_PROGRAM, cflags=[f"-DPORT={BOUNCE_PORT}"])
    try:
        fn = bpf.load_func(b"turn_round", BPF.XDP)
        with in_netns(lab.agg_ns):
            BPF.attach_xdp(lab.agg_ifname.encode(), fn, BPF.XDP_FLAGS_DRV_MODE)
        assert "xdp " in lab.check_output(lab.agg_ns, ["ip", "link", "show", "agg0"])  # native
        for i in range(lab.workers):
            sock = udp_socket(lab.worker_ns(i))
            for seq in range(3):
                sock.sendto(b"bounce %d" % seq, (lab.agg_ip, BOUNCE_PORT))
                data, src = sock.recvfrom(64)
                assert (data, src) == (b"bounce %d" % seq, (lab.agg_ip, BOUNCE_PORT))
            sock.close()
    finally:
        bpf.cleanup()


def _port_drops(lab: Lab, port: str) -> int:
    stats = json.loads(lab.check_output(lab.switch_ns, ["ip", "-j", "-s", "link", "show", port]))
    return stats[0]["stats64"]["tx"]["dropped"]


def test_bursts_into_a_native_xdp_aggregator_wait_in_the_port_queue(make_lab):
    """Every worker at once sends bursts of GSO batches to the aggregator, whose interface runs a
    native XDP program (a 256-frame ring behind the bridge's port): none is dropped on the way
    at the port (its queue holds them while the ring is full), and the host's per-CPU backlog is
    large enough for a lab's floods."""
    lab = make_lab(workers=4, mtu=9000)
    assert int(open("/proc/sys/net/core/netdev_max_backlog").read()) >= lab_module.HOST_BACKLOG_PACKETS
    qdisc = lab.check_output(lab.switch_ns, ["tc", "qdisc", "show", "dev", "sw-agg"])
    assert "pfifo" in qdisc and f"limit {lab_module.PORT_QUEUE_PACKETS}p" in qdisc, qdisc
    lab.set_aggregator_rate(0, 100)   # a slow link and back: the queue comes back with it
    lab.set_aggregator_rate(0, None)
    assert f"limit {lab_module.PORT_QUEUE_PACKETS}p" in lab.check_output(lab.switch_ns, ["tc", "qdisc", "show", "dev", "sw-agg"])

    lab_module.attach_xdp_pass(lab.agg_ns, lab.agg_ifname, frags=True)   # native, as the daemon's
    receiver = udp_socket(lab.agg_ns, ("0.0.0.0", 47001))
    receiver.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    before = _port_drops(lab, "sw-agg")
    # one process a worker (threads would take turns on the GIL: no burst at once)
    batches, per_batch = 50, 64   # 12,800 frames of 1,000 bytes, 50x the ring
    sender = ("import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
              f"s.setsockopt(socket.SOL_UDP, {UDP_SEGMENT}, 1000); sys.stdin.read(1); "
              f"[s.sendto(bytes(1000 * {per_batch}), ('{lab.agg_ip}', 47001)) for _ in range({batches})]")
    procs = [lab.run(lab.worker_ns(i), [sys.executable, "-c", sender], stdin=subprocess.PIPE)
             for i in range(lab.workers)]
    time.sleep(0.5)   # all started: go at once
    for p in procs:
        p.stdin.write(b"g")
        p.stdin.flush()
    for p in procs:
        assert p.wait(timeout=60) == 0
    got = drain(receiver, quiet=1.0)
    receiver.close()
    assert got and _port_drops(lab, "sw-agg") == before   # (without the queue: hundreds)


def test_loss_drops_about_the_requested_share(make_lab):
    lab = make_lab(workers=1, loss_percent=20)
    receiver = udp_socket(lab.agg_ns, ("0.0.0.0", 47000))
    receiver.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)  # 500 datagrams must fit
    sender = udp_socket(lab.worker_ns(0))
    sent = 500
    for seq in range(sent):
        sender.sendto(struct.pack("!I", seq), (lab.agg_ip, 47000))  # no error: dropped in transit
    lost = sent - len(drain(receiver))
    assert 0.08 * sent <= lost <= 0.35 * sent, f"{lost} of {sent} lost at 20%"

    lab.set_loss(0)
    for seq in range(200):
        sender.sendto(struct.pack("!I", seq), (lab.agg_ip, 47000))
    assert len(drain(receiver)) == 200
    assert Lab.load(lab.name).loss_percent == 0
    sender.close()
    receiver.close()


def test_fractional_loss_threshold(make_lab):
    lab = make_lab(workers=1, loss_percent=0.5)
    rules = lab.check_output(lab.switch_ns, ["nft", "list", "table", "bridge", "aggd_loss"])
    assert "numgen random mod 10000 < 50" in rules


def test_down_removes_everything_even_after_a_crash():
    lab = Lab(unique_lab_name(), workers=2)
    try:
        lab.up()
        sleeper = lab.run(lab.worker_ns(0), ["sleep", "60"])
        # What a crashed run leaves: a stray namespace with a process of its own in it.
        subprocess.run(["ip", "netns", "add", f"{lab.name}-w7"], check=True)
        stray = subprocess.Popen(["ip", "netns", "exec", f"{lab.name}-w7", "sleep", "60"])
        time.sleep(0.2)
        assert Lab.exists(lab.name)
        Lab(lab.name, workers=1).down()  # a fresh object: down() goes by name, not by memory
        lab.down()  # idempotent
        assert stray.wait(timeout=5) is not None
        assert sleeper.wait(timeout=5) is not None
        assert lab_leftovers(lab.name) == []
        assert not lab.state_file.exists()
        assert not Lab.exists(lab.name)
        with pytest.raises(LabError):
            Lab.load(lab.name)
    finally:
        lab.down()


def test_failed_up_cleans_up_and_existing_lab_is_refused(make_lab, monkeypatch):
    lab = make_lab(workers=1)
    with pytest.raises(LabError, match="already exists"):
        Lab(lab.name, workers=1).up()
    assert lab.ping(lab.worker_ns(0), lab.agg_ip), "refusing must not harm the running lab"

    broken = Lab(unique_lab_name(), workers=1, mtu=1500)
    broken.mtu = 9000  # past the one-page limit: attaching XDP_PASS fails mid-way
    with pytest.raises(LabError, match="native XDP"):
        with monkeypatch.context() as m:  # (a lab that large takes multi-buffer: force one without)
            m.setattr(lab_module, "PAGE_MTU", 65535)
            broken.up()
    assert lab_leftovers(broken.name) == []


def test_two_labs_built_at_once_share_the_subnet(make_lab):
    labs, errors = [], []

    def build():
        try:
            labs.append(make_lab(workers=1))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for lab in labs:
        assert lab.ping(lab.worker_ns(0), "10.77.0.1")


def test_aggctl_lab_up_status_down():
    name = unique_lab_name()
    runner = CliRunner()
    try:
        res = runner.invoke(aggctl, ["lab", "up", "--workers", "2", "--loss", "2%", "--name", name])
        assert res.exit_code == 0, res.output
        assert f"{name}-w1" in res.output and "10.77.0.11/24" in res.output

        res = runner.invoke(aggctl, ["lab", "status", "--name", name, "--json"])
        assert res.exit_code == 0, res.output
        info = json.loads(res.output)
        assert info["workers"] == 2 and info["loss_percent"] == 2.0
        assert [n["state"] for n in info["nodes"]] == ["up"] * 4
        assert info["sw_agg_xdp_prog_id"]

        res = runner.invoke(aggctl, ["lab", "status", "--name", name])
        assert res.exit_code == 0 and "aggregator" in res.output and f"{name}-agg" in res.output

        res = runner.invoke(aggctl, ["lab", "up", "--workers", "1", "--name", name])
        assert res.exit_code != 0 and "already exists" in res.output

        res = runner.invoke(aggctl, ["lab", "down", "--name", name])
        assert res.exit_code == 0 and "removed" in res.output
        assert lab_leftovers(name) == []
        res = runner.invoke(aggctl, ["lab", "status", "--name", name])
        assert res.exit_code != 0 and "no lab" in res.output
    finally:
        Lab(name, 1).down()


@contextlib.contextmanager
def aggctl_lab(*options: str):
    """`aggctl lab up` with ``options`` under a fresh name: (the CLI runner, the lab as loaded); the
    test ends with `aggctl lab down` and nothing left, and the lab is removed even on failure."""
    name = unique_lab_name()
    runner = CliRunner()
    try:
        res = runner.invoke(aggctl, ["lab", "up", *options, "--name", name])
        assert res.exit_code == 0, res.output
        yield runner, Lab.load(name)
        assert runner.invoke(aggctl, ["lab", "down", "--name", name]).exit_code == 0
        assert lab_leftovers(name) == []
    finally:
        Lab(name, 1).down()


def test_a_lab_with_several_aggregators():
    """`aggctl lab up --aggregators 3`: three aggregator namespaces (10.77.0.1-3), each reachable
    from every worker, listed by status, found again by load, removed by down."""
    with aggctl_lab("--workers", "2", "--aggregators", "3") as (runner, lab):
        name = lab.name
        assert lab.aggregators == 3 and lab.agg_ns_of(2) == f"{name}-agg2"
        for i in range(3):
            assert lab.ping(lab.worker_ns(1), lab.agg_ip_of(i)), i
            assert xdp_prog_id(lab.switch_ns, lab.agg_port_of(i))  # native XDP_TX comes back
        info = json.loads(runner.invoke(aggctl, ["lab", "status", "--name", name, "--json"]).output)
        assert [n["address"] for n in info["nodes"] if n["role"].startswith("aggregator")] == \
            ["10.77.0.1/24", "10.77.0.2/24", "10.77.0.3/24"]
        with pytest.raises(IndexError, match="aggregators 0..2"):
            lab.agg_ip_of(3)


def test_two_racks_behind_a_spine():
    """`aggctl lab up --racks 2`: a bridge a rack (its half of the workers and aggregator r) joined
    to the spine bridge (the last aggregator); everything reaches everything, the racks' ports are
    on their own bridges, and the lab is found again by load."""
    with aggctl_lab("--workers", "4", "--racks", "2") as (runner, lab):
        name = lab.name
        assert (lab.racks, lab.aggregators, lab.spine_aggregator) == (2, 3, 2)
        assert [lab.rack_workers(r) for r in range(2)] == [[0, 1], [2, 3]]
        for w in range(4):
            for i in range(3):
                assert lab.ping(lab.worker_ns(w), lab.agg_ip_of(i)), (w, i)
        links = json.loads(lab.check_output(lab.switch_ns, ["ip", "-j", "link", "show"]))
        master = {link["ifname"]: link.get("master") for link in links}
        assert master["sw-w0"] == master["sw-agg"] == master["up-r0"] == "rack0"
        assert master["sw-w3"] == master["sw-agg1"] == master["up-r1"] == "rack1"
        assert master["sw-agg2"] == master["sp-r0"] == master["sp-r1"] == "br0"
        roles = [n["role"] for n in json.loads(runner.invoke(aggctl, ["lab", "status", "--name", name,
                                                                        "--json"]).output)["nodes"]]
        assert roles[1:] == ["aggregator (rack 0)", "aggregator 1 (rack 1)", "aggregator 2 (spine)",
                             "worker 0 (rack 0)", "worker 1 (rack 0)", "worker 2 (rack 1)", "worker 3 (rack 1)"]
        # a slower link, then one that is gone, and back
        assert runner.invoke(aggctl, ["lab", "link", "--name", name, "-a", "1", "--rate", "50"]).exit_code == 0
        assert "tbf" in lab.check_output(lab.switch_ns, ["tc", "qdisc", "show", "dev", "sw-agg1"])
        shown = runner.invoke(aggctl, ["lab", "status", "--name", name]).output
        assert re.search(r"aggregator 1 .* up, 50 Mbit/s$", shown, re.M), shown
        assert runner.invoke(aggctl, ["lab", "link", "--name", name, "-a", "1", "--rate", "off",
                                      "--state", "down"]).exit_code == 0
        assert "tbf" not in lab.check_output(lab.switch_ns, ["tc", "qdisc", "show", "dev", "sw-agg1"])
        info = json.loads(runner.invoke(aggctl, ["lab", "status", "--name", name, "--json"]).output)
        ports = [(n["port_state"], n["rate_mbit"]) for n in info["nodes"] if n["role"].startswith("aggregator")]
        assert ports == [("up", None), ("down", None), ("up", None)], ports
        assert not lab.ping(lab.worker_ns(3), lab.agg_ip_of(1), timeout=0.3)
        assert runner.invoke(aggctl, ["lab", "link", "--name", name, "-a", "1", "--state", "up"]).exit_code == 0
        assert lab.ping(lab.worker_ns(3), lab.agg_ip_of(1))
        bad = runner.invoke(aggctl, ["lab", "link", "--name", name, "-a", "7", "--rate", "5"])
        assert bad.exit_code != 0 and "aggregators 0..2" in bad.output
        with pytest.raises(ValueError, match="racks"):
            Lab("x", 4, aggregators=2, racks=2)


def test_aggctl_binary_runs_lab_commands():
    aggctl_bin = os.path.join(os.path.dirname(sys.executable), "aggctl")  # .venv/bin/aggctl
    name = unique_lab_name()
    try:
        subprocess.run([aggctl_bin, "lab", "up", "-n", "1", "--name", name], check=True,
                       capture_output=True)
        out = subprocess.run([aggctl_bin, "lab", "status", "--name", name], check=True,
                             capture_output=True, text=True).stdout
        assert f"{name}-w0" in out
    finally:
        subprocess.run([aggctl_bin, "lab", "down", "--name", name], check=True, capture_output=True)
    assert lab_leftovers(name) == []


@pytest.mark.parametrize("text, percent", [("2%", 2.0), ("2", 2.0), ("0.5%", 0.5), (" 0 ", 0.0)])
def test_loss_option_accepts_percentages(text, percent):
    assert LossPercent().convert(text, None, None) == percent


@pytest.mark.parametrize("text", ["abc", "2%%", "-1%", "101", "%"])
def test_loss_option_rejects_nonsense(text):
    res = CliRunner().invoke(aggctl, ["lab", "up", "--workers", "1", "--loss", text, "--name", "x"])
    assert res.exit_code == 2 and "--loss" in res.output
    assert not Lab.exists("x")


def _features(ns: str, ifname: str) -> dict[str, bool]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-k", ifname], capture_output=True, text=True,
                         check=True).stdout
    return {k.strip(): v.split()[0] == "on" for k, v in (line.split(":", 1) for line in out.splitlines()[1:] if ":" in line)}


def test_workers_receive_as_nics_do_with_gro():
    """`aggctl lab up --gro`: GRO on every worker's veth, TSO off on its bridge port (TCP cut to the
    MTU there, as on a wire); kept by load, and ``set_gro(False)`` restores the plain veths."""
    with aggctl_lab("--workers", "2", "--gro") as (_, lab):
        assert lab.gro
        for i in range(2):
            assert _features(lab.worker_ns(i), "eth0")["generic-receive-offload"]
            assert not _features(lab.switch_ns, f"sw-w{i}")["tx-tcp-segmentation"]
        lab.set_gro(False)
        assert not Lab.load(lab.name).gro
        for i in range(2):
            assert not _features(lab.worker_ns(i), "eth0")["generic-receive-offload"]
            assert _features(lab.switch_ns, f"sw-w{i}")["tx-tcp-segmentation"]
