"""A lab whose switch runs BMv2 (simple_switch_grpc) instead of the Linux bridge, driven by
P4DataPlane, for tests/p4/test_bmv2.py: workers' sockets send fixture frames and collect what the
switch sends back."""
from __future__ import annotations

import select
import socket
import subprocess
import time
from pathlib import Path

from aggd.dataplane.p4.backend import P4DataPlane
from aggd.lab.namespaces import in_netns
from aggd_client import protocol as proto

from tests.fixtures.scenarios import GROUP

ELEMENTS = 256
AGG_SWITCH_PORT = 100
QUIET = 0.3          #: seconds without a message that mean "nothing was sent"


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
