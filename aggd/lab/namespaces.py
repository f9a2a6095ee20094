"""A lab of network namespaces that lets one host play a rack: a bridge, an aggregator, N workers.

    {name}-sw    br0 (multicast snooping off, so results flood to every port)
                 ports sw-agg, sw-w0 .. sw-w{N-1}; nftables loss rules; XDP_PASS on sw-agg
                 (at MTUs native XDP takes; above NATIVE_MAX_MTU the lab is for generic mode only)
                 and a queue (PORT_QUEUE_PACKETS), as a switch port has
    {name}-agg   agg0  10.77.0.1/24
    {name}-w{i}  eth0  10.77.0.{10+i}/24

With ``racks`` (two racks behind a spine, docs/hierarchy.md) the switch namespace holds a bridge
per rack (``rack0`` ..) besides the spine ``br0``, each joined to the spine by a veth pair
(``up-r{r}`` in the rack's bridge, ``sp-r{r}`` in the spine's): rack r's workers and aggregator r
hang off its bridge, the last aggregator off the spine. One subnet still: a rack is an L2 segment.

Every lab lives entirely inside its own namespaces (veths are created with their peer placed
straight into the target namespace), so labs share 10.77.0.0/24 and never touch the root
namespace. ``aggctl lab up`` leaves a lab running and records it in /run/aggd/lab-NAME.json.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns

from aggd_client import protocol as proto

from aggd.dataplane.netns import NETNS_DIR, in_netns, netns_exists  # noqa: F401 (the lab's API too)

STATE_DIR = Path("/run/aggd")
SUBNET_PREFIX = 24
AGG_IP = "10.77.0.1"
AGG_IFNAME = "agg0"
WORKER_IFNAME = "eth0"
BRIDGE = "br0"
MULTICAST_NET = "224.0.0.0/4"
LOSS_TABLE = "aggd_loss"
MCAST_TABLE = "aggd_mcast"
MAX_WORKERS = 64
# Aggregator hosts of a lab (a job sharded over several: aggd_client.shards): 10.77.0.1 onwards,
# below the workers' 10.77.0.10.
MAX_AGGREGATORS = 8
# Only namespace names carry it (interface names are fixed); short, as they show up in ps and logs.
_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,12}$")
# Native XDP on a veth without multi-buffer support needs the frame in one page (3506). Above it,
# up to NATIVE_MAX_MTU, native programs are loaded with multi-buffer (frags) support.
PAGE_MTU = proto.PAGE_MAX_MTU
NATIVE_MAX_MTU = proto.NATIVE_MAX_MTU
# Above that a lab serves generic (skb) mode XDP only, which takes any frame a veth carries: jumbo
# packets (protocol.MAX_ELEMENTS) need a 32,836-byte MTU.
JUMBO_MAX_MTU = 65535

# A queue on each aggregator's bridge port, as a switch port has a buffer: a veth into a native XDP
# program hands frames over in a 256-frame ring and, with no qdisc, drops what overflows it (bursts
# of 4-8 workers' GSO sends did, 1-4% of packets). With a qdisc a full ring stops the port's queue
# until the program has drained it (veth backpressure, Linux 6.16 on).
PORT_QUEUE_PACKETS = 10000
# The host's per-CPU backlog of received packets (net.core.netdev_max_backlog; host-wide, only the
# root namespace has it). Every frame a veth without XDP receives waits there, and a result flooded
# to 8 workers is 8 frames: the default 1,000 dropped about 2% of a lab's packets at MTU 9000. The
# lab raises it to at least this and leaves it (other labs may be running).
HOST_BACKLOG_PACKETS = 10000

_SIOCETHTOOL = 0x8946
_ETHTOOL_STXCSUM = 0x17  # legacy ethtool_value commands, still the simplest way to flip them
_ETHTOOL_SGRO = 0x2c
_ETHTOOL_STSO = 0x1f
_libc = ctypes.CDLL(None, use_errno=True)


class LabError(RuntimeError):
    pass


# --- namespaces --------------------------------------------------------------------------------


def _remove_netns(ns_name: str) -> None:
    try:
        pr_netns.remove(ns_name)
    except FileNotFoundError:
        pass


def _ns_pids(ns_name: str) -> list[int]:
    """Processes whose network namespace is ``ns_name`` (like `ip netns pids`)."""
    try:
        ino = os.stat(NETNS_DIR / ns_name).st_ino
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == ino:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _kill_pids(pids: list[int], grace: float = 2.0) -> None:
    pids = [p for p in pids if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
            if not pids:
                return
            time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _ethtool_set(ns_name: str, ifname: str, cmd: int, value: int) -> None:
    with in_netns(ns_name):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the ioctl acts in its netns
    with sock:
        buf = ctypes.create_string_buffer(struct.pack("II", cmd, value))
        ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(buf))
        fcntl.ioctl(sock, _SIOCETHTOOL, ifreq)


def set_gro(ns_name: str, ifname: str, on: bool) -> None:
    """GRO on (or off) for the veth ``ifname``, as a NIC has it: the veth then receives in NAPI (not
    through the host's backlog) and coalesces a train of datagrams for a socket that asks
    (UDP_GRO: the client's result sockets)."""
    _ethtool_set(ns_name, ifname, _ETHTOOL_SGRO, int(on))


def set_tso(ns_name: str, ifname: str, on: bool) -> None:
    """TSO off (``on`` False) makes the veth ``ifname`` cut TCP to its MTU itself, as a wire does;
    then its peer, with GRO on (``set_gro``), receives what the bridge forwards in NAPI, where GRO
    runs (veth takes that path only from a sender without TSO: veth_skb_is_eligible_for_gro)."""
    _ethtool_set(ns_name, ifname, _ETHTOOL_STSO, int(on))


def disable_tx_checksum(ns_name: str, ifname: str) -> None:
    """Make ``ifname`` compute UDP/TCP checksums itself instead of leaving them to "hardware".

    A veth with TX checksum offload sends CHECKSUM_PARTIAL packets whose checksum field holds only
    the pseudo-header sum. The stack forgives that, but a packet an XDP program bounces (XDP_TX)
    loses the metadata and arrives with a bad checksum (UdpInCsumErrors). Off, frames carry real
    checksums, as on a wire.
    """
    _ethtool_set(ns_name, ifname, _ETHTOOL_STXCSUM, 0)


def _write_sysctl(key: str, value: str) -> None:
    """Write a sysctl in the calling thread's network namespace (use inside in_netns)."""
    Path("/proc/sys", *key.split(".")).write_text(value)


def raise_host_backlog(packets: int = HOST_BACKLOG_PACKETS) -> None:
    """Raise the host's ``net.core.netdev_max_backlog`` to at least ``packets`` (never lowers it)."""
    path = Path("/proc/sys/net/core/netdev_max_backlog")
    if int(path.read_text()) < packets:
        path.write_text(str(packets))


# --- XDP helper ----------------------------------------------------------------------------------

_XDP_PASS_SRC = b"int xdp_pass(struct xdp_md *ctx) { return XDP_PASS; }\n" \
                b"int xdp_pass_frags(struct xdp_md *ctx) { return XDP_PASS; }"
_xdp_pass_lock = threading.Lock()
_xdp_pass_bpf = None  # compiled once per process: a bcc compile costs ~0.3 s


def attach_xdp_pass(ns_name: str, ifname: str, frags: bool = False) -> None:
    """Attach a do-nothing XDP program to ``ifname`` in ``ns_name`` in native (driver) mode, with
    multi-buffer support (``frags``) where the MTU is larger than a page takes.

    Native XDP_TX on a veth is delivered only if the PEER veth runs an XDP program. The netlink
    attachment holds its own reference, so it outlives this process.
    """
    global _xdp_pass_bpf
    from bcc import BPF  # heavy import, only when a lab is built

    from aggd.dataplane.xdp.loader import load_xdp_function

    with _xdp_pass_lock:
        if _xdp_pass_bpf is None:
            _xdp_pass_bpf = BPF(text=_XDP_PASS_SRC)
        fn = load_xdp_function(_xdp_pass_bpf, "xdp_pass_frags" if frags else "xdp_pass", frags=frags)
    try:
        with in_netns(ns_name):
            BPF.attach_xdp(ifname.encode(), fn, BPF.XDP_FLAGS_DRV_MODE)
    except Exception as exc:  # bcc raises a bare Exception
        limit = NATIVE_MAX_MTU if frags else PAGE_MTU
        raise LabError(f"native XDP on {ifname} in {ns_name} failed: {exc} "
                       f"(a veth's MTU must stay <= {limit} for native XDP"
                       f"{'' if frags else ' without multi-buffer support'})") from exc


def xdp_prog_id(ns_name: str, ifname: str) -> int | None:
    """Id of the XDP program attached to ``ifname`` in ``ns_name``, or None."""
    with IPRoute(netns=ns_name, flags=0) as ipr:
        links = ipr.get_links(ifname=ifname)
        if not links:
            return None
        xdp = links[0].get_attr("IFLA_XDP")
        return (xdp.get_attr("IFLA_XDP_PROG_ID") if xdp is not None else None) or None


# --- loss ----------------------------------------------------------------------------------------


def _loss_ruleset(percent: float) -> str:
    # Create-then-delete makes the replacement atomic and valid whether or not the table exists.
    script = f"table bridge {LOSS_TABLE} {{}}\ndelete table bridge {LOSS_TABLE}\n"
    threshold = round(percent * 100)  # mod 10000 so fractional percentages work
    if threshold > 0:
        # Only IPv4 is dropped: losing ARP would stall or fail neighbour resolution, which tests
        # nothing aggd does. The forward hook drops in transit, so senders see no error.
        script += (
            f"table bridge {LOSS_TABLE} {{\n"
            f"  chain forward {{\n"
            f"    type filter hook forward priority 0; policy accept;\n"
            f"    ether type ip numgen random mod 10000 < {threshold} counter drop\n"
            f"  }}\n"
            f"}}\n"
        )
    return script


def _check_percent(percent: float) -> float:
    percent = float(percent)
    if not 0.0 <= percent <= 100.0:
        raise ValueError(f"loss must be between 0 and 100 percent, got {percent}")
    return percent


# --- the lab -------------------------------------------------------------------------------------


@dataclass
class Node:
    """One endpoint of the lab as `status()` reports it."""

    role: str
    namespace: str
    ifname: str
    address: str | None
    mac: str | None
    state: str  # "up", "down" or "missing"
    #: an aggregator's bridge port, which `aggctl lab link` shapes or cuts: "up", "down" or "missing"
    port_state: str | None = None
    #: that port's token-bucket limit towards the aggregator, Mbit/s (None: none)
    rate_mbit: float | None = None


class Lab:
    """A switch namespace with a bridge, an aggregator namespace and ``workers`` worker namespaces.

    ``with Lab("demo", workers=2) as lab:`` builds it and always tears it down.
    """

    def __init__(self, name: str, workers: int, loss_percent: float = 0.0, mtu: int = 1500,
                 aggregators: int = 1, racks: int = 0, gro: bool = False):
        if not _NAME_RE.match(name):
            raise ValueError(f"lab name {name!r}: use 1-12 letters, digits or underscores")
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers must be 1..{MAX_WORKERS}, got {workers}")
        if not 1 <= aggregators <= MAX_AGGREGATORS:
            raise ValueError(f"aggregators must be 1..{MAX_AGGREGATORS}, got {aggregators}")
        self.aggregators = aggregators
        if racks and not (2 <= racks <= min(workers, aggregators - 1)):
            raise ValueError(f"racks must be 2 or more, with a worker each and an aggregator each besides the "
                             f"spine's (aggregators = racks + 1 or more), not {racks}")
        self.racks = racks
        if not 68 <= mtu <= JUMBO_MAX_MTU:
            raise ValueError(f"mtu must be 68..{JUMBO_MAX_MTU} (above {NATIVE_MAX_MTU}: generic-mode XDP "
                             f"only), got {mtu}")
        self.name = name
        self.workers = workers
        self.loss_percent = _check_percent(loss_percent)
        self.mtu = mtu
        self.gro = bool(gro)
        self._procs: list[subprocess.Popen] = []

    # names and addresses
    @property
    def switch_ns(self) -> str:
        return f"{self.name}-sw"

    @property
    def agg_ns(self) -> str:
        return f"{self.name}-agg"

    agg_ip = AGG_IP
    agg_ifname = AGG_IFNAME
    agg_mac = "02:77:00:00:00:01"

    # aggregator i (0 is agg_ns, agg_ip, agg_mac); each has its interface agg0 in its namespace
    def agg_ns_of(self, i: int) -> str:
        self._check_aggregator(i)
        return self.agg_ns if i == 0 else f"{self.name}-agg{i}"

    def agg_ip_of(self, i: int) -> str:
        self._check_aggregator(i)
        return f"10.77.0.{1 + i}"

    def agg_mac_of(self, i: int) -> str:
        self._check_aggregator(i)
        return f"02:77:00:00:00:{1 + i:02x}"

    def agg_port_of(self, i: int) -> str:
        """The bridge's port to aggregator i."""
        self._check_aggregator(i)
        return "sw-agg" if i == 0 else f"sw-agg{i}"

    def _check_aggregator(self, i: int) -> None:
        if not 0 <= i < self.aggregators:
            raise IndexError(f"lab {self.name} has aggregators 0..{self.aggregators - 1}, not {i}")
    worker_ifname = WORKER_IFNAME
    bridge = BRIDGE

    def worker_ns(self, i: int) -> str:
        self._check_worker(i)
        return f"{self.name}-w{i}"

    def worker_ip(self, i: int) -> str:
        self._check_worker(i)
        return f"10.77.0.{10 + i}"

    def worker_mac(self, i: int) -> str:
        self._check_worker(i)
        return f"02:77:00:00:00:{10 + i:02x}"

    # racks (``racks`` > 0): rack r has workers rack_workers(r), aggregator r and bridge rack_bridge(r);
    # the spine aggregator is the last one
    def rack_of(self, worker: int) -> int:
        self._check_worker(worker)
        return worker * self.racks // self.workers

    def rack_workers(self, r: int) -> list[int]:
        return [w for w in range(self.workers) if self.rack_of(w) == r]

    @staticmethod
    def rack_bridge(r: int) -> str:
        return f"rack{r}"

    @property
    def spine_aggregator(self) -> int:
        return self.aggregators - 1

    def _bridge_of(self, aggregator: int | None = None, worker: int | None = None) -> str:
        if not self.racks:
            return BRIDGE
        if worker is not None:
            return self.rack_bridge(self.rack_of(worker))
        return self.rack_bridge(aggregator) if aggregator < self.racks else BRIDGE

    @property
    def worker_namespaces(self) -> list[str]:
        return [self.worker_ns(i) for i in range(self.workers)]

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_ns, *(self.agg_ns_of(i) for i in range(self.aggregators)), *self.worker_namespaces]

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"lab-{self.name}.json"

    def _check_worker(self, i: int) -> None:
        if not 0 <= i < self.workers:
            raise IndexError(f"lab {self.name} has workers 0..{self.workers - 1}, not {i}")

    # life cycle
    def __enter__(self) -> "Lab":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "Lab":
        """Build the lab. Refuses if any of its namespaces exist; cleans up after itself on error."""
        leftovers = _lab_namespaces(self.name)
        if leftovers:
            raise LabError(
                f"lab {self.name} already exists ({', '.join(leftovers)}); "
                f"run `aggctl lab down --name {self.name}` first"
            )
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        for ns in self.namespaces:
            pr_netns.create(ns)
            with in_netns(ns):
                # No IPv6: its DAD/MLD/RS chatter would reach the aggregator's XDP program.
                _write_sysctl("net.ipv6.conf.all.disable_ipv6", "1")
                _write_sysctl("net.ipv6.conf.default.disable_ipv6", "1")
                if ns == self.switch_ns and Path("/proc/sys/net/bridge").exists():
                    # br_netfilter (loaded for other uses on the host) would send every bridged
                    # frame through the IP hooks too; the loss rules live in the bridge family
                    for family in ("iptables", "ip6tables", "arptables"):
                        _write_sysctl(f"net.bridge.bridge-nf-call-{family}", "0")
        endpoints = [(self.agg_port_of(i), self.agg_ns_of(i), AGG_IFNAME, self.agg_ip_of(i), self.agg_mac_of(i),
                      self._bridge_of(aggregator=i)) for i in range(self.aggregators)] + [
            (f"sw-w{i}", self.worker_ns(i), WORKER_IFNAME, self.worker_ip(i), self.worker_mac(i),
             self._bridge_of(worker=i)) for i in range(self.workers)
        ]
        with IPRoute(netns=self.switch_ns, flags=0) as ipr:
            ipr.link("set", ifname="lo", state="up")
            bridges = [BRIDGE, *(self.rack_bridge(r) for r in range(self.racks))]
            for name in bridges:
                ipr.link("add", ifname=name, kind="bridge", br_mcast_snooping=0)
            index = {name: ipr.link_lookup(ifname=name)[0] for name in bridges}
            for r in range(self.racks):     # the rack's uplink to the spine
                ipr.link("add", ifname=f"up-r{r}", kind="veth", peer={"ifname": f"sp-r{r}", "mtu": self.mtu})
                ipr.link("set", ifname=f"up-r{r}", master=index[self.rack_bridge(r)], mtu=self.mtu, state="up")
                ipr.link("set", ifname=f"sp-r{r}", master=index[BRIDGE], mtu=self.mtu, state="up")
            for port, ns, ifname, _, mac, bridge in endpoints:
                # The peer is born in its namespace: nothing ever appears in the root namespace.
                ipr.link(
                    "add",
                    ifname=port,
                    kind="veth",
                    peer={"ifname": ifname, "net_ns_fd": ns, "address": mac, "mtu": self.mtu},
                )
                ipr.link("set", ifname=port, master=index[bridge], mtu=self.mtu, state="up")
            for name in bridges:
                ipr.link("set", index=index[name], mtu=self.mtu, state="up")
        for _, ns, ifname, ip, _, _ in endpoints:
            with IPRoute(netns=ns, flags=0) as ipr:
                ipr.link("set", ifname="lo", state="up")
                idx = ipr.link_lookup(ifname=ifname)[0]
                ipr.addr("add", index=idx, address=ip, prefixlen=SUBNET_PREFIX)
                ipr.link("set", index=idx, state="up")
                ipr.route("add", dst=MULTICAST_NET, oif=idx)
            disable_tx_checksum(ns, ifname)
        if self.gro:
            self._apply_gro(True)
        if self.mtu <= NATIVE_MAX_MTU:  # (a generic-mode aggregator's XDP_TX needs no peer program)
            for i in range(self.aggregators):
                attach_xdp_pass(self.switch_ns, self.agg_port_of(i), frags=self.mtu > PAGE_MTU)
        for i in range(self.aggregators):
            self._set_port_queue(i)
        raise_host_backlog()
        if self.loss_percent:
            self._apply_loss(self.loss_percent)
        self._save()

    def down(self) -> None:
        """Remove the lab: its processes, namespaces (and with them every link) and state file.

        Idempotent; works after a partial up() or a crashed run because it goes by name.
        """
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._procs.clear()
        for ns in _lab_namespaces(self.name):
            # A process left in a namespace would keep it (and its veths) alive after unmount.
            _kill_pids(_ns_pids(ns))
            _remove_netns(ns)
        try:
            self.state_file.unlink()
        except FileNotFoundError:
            pass

    @classmethod
    def load(cls, name: str) -> "Lab":
        """Describe a lab that is already running (e.g. left by `aggctl lab up`)."""
        if not _NAME_RE.match(name):
            raise ValueError(f"lab name {name!r}: use 1-12 letters, digits or underscores")
        state = STATE_DIR / f"lab-{name}.json"
        try:
            data = json.loads(state.read_text())
            return cls(data["name"], data["workers"], data["loss_percent"], data["mtu"],
                       data.get("aggregators", 1), data.get("racks", 0), data.get("gro", False))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        # No usable state file (removed, or a crash mid-write): infer it from the namespaces.
        workers = [n for n in _lab_namespaces(name) if re.fullmatch(rf"{name}-w\d+", n)]
        if not workers:
            raise LabError(f"no lab named {name} (no {state} and no {name}-w* namespaces)")
        aggs = [n for n in _lab_namespaces(name) if re.fullmatch(rf"{name}-agg\d*", n)]
        return cls(name, len(workers), aggregators=max(1, len(aggs)))

    @staticmethod
    def exists(name: str) -> bool:
        return bool(_lab_namespaces(name))

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        data = {"name": self.name, "workers": self.workers,
                "loss_percent": self.loss_percent, "mtu": self.mtu, "aggregators": self.aggregators,
                "racks": self.racks, "gro": self.gro}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.state_file)

    # the workers' receive path
    def set_gro(self, on: bool) -> None:
        """Workers receive as a NIC does (``on``: GRO and NAPI; TCP cut to the MTU at their bridge
        ports, as on a wire) or through the host's backlog, with TCP passed in 64 KiB segments."""
        self._apply_gro(on)
        self.gro = bool(on)
        self._save()

    def _apply_gro(self, on: bool) -> None:
        for i in range(self.workers):
            set_gro(self.worker_ns(i), WORKER_IFNAME, on)
            set_tso(self.switch_ns, f"sw-w{i}", not on)

    # loss
    def set_loss(self, percent: float) -> None:
        """Drop ``percent`` % of IPv4 packets crossing the bridge (each way), 0 to stop."""
        self._apply_loss(_check_percent(percent))
        self.loss_percent = float(percent)
        self._save()

    def _apply_loss(self, percent: float) -> None:
        self.check_output(self.switch_ns, ["nft", "-f", "-"], input=_loss_ruleset(percent))

    def set_aggregator_link(self, i: int, up: bool) -> None:
        """Take the bridge's link to aggregator ``i`` down (the host is gone) or up again."""
        self.check_output(self.switch_ns, ["ip", "link", "set", self.agg_port_of(i), "up" if up else "down"])

    def set_aggregator_rate(self, i: int, mbit: float | None) -> None:
        """Limit the bridge's link to aggregator ``i`` to ``mbit`` Mbit/s towards it (a token bucket;
        None: no limit): an aggregator host behind a slower link."""
        port = self.agg_port_of(i)
        if mbit is None:
            self._set_port_queue(i)
            return
        if not mbit > 0:
            raise ValueError(f"rate must be above 0 Mbit/s, not {mbit}")
        self.check_output(self.switch_ns, ["tc", "qdisc", "replace", "dev", port, "root", "tbf", "rate",
                                           f"{mbit}mbit", "burst", "256kb", "latency", "200ms"])

    def _set_port_queue(self, i: int) -> None:
        """The bridge's port to aggregator ``i`` gets its queue (``PORT_QUEUE_PACKETS``)."""
        self.check_output(self.switch_ns, ["tc", "qdisc", "replace", "dev", self.agg_port_of(i), "root", "pfifo",
                                           "limit", str(PORT_QUEUE_PACKETS)])

    def keep_multicast_from_aggregators(self, keep: bool = True) -> None:
        """Stop (or, ``keep=False``, restore) the bridge flooding IPv4 multicast to the aggregators'
        ports, as a switch with IGMP snooping would: the lab's bridge floods every job's results to
        every port, which on a rate-limited aggregator link takes its bandwidth from its own job
        (``aggctl bench shards``). Not for a spine lab, whose racks listen on the upper group."""
        script = f"table bridge {MCAST_TABLE} {{}}\ndelete table bridge {MCAST_TABLE}\n"
        if keep:
            ports = ", ".join(f'"{self.agg_port_of(i)}"' for i in range(self.aggregators))
            script += (f"table bridge {MCAST_TABLE} {{\n"
                       f"  chain forward {{\n"
                       f"    type filter hook forward priority 0; policy accept;\n"
                       f"    oifname {{ {ports} }} ether type ip ip daddr {MULTICAST_NET} drop\n"
                       f"  }}\n"
                       f"}}\n")
        self.check_output(self.switch_ns, ["nft", "-f", "-"], input=script)

    # processes
    def run(self, ns: str, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``ns``; down() kills it if it is still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **popen_kwargs)
        self._procs.append(proc)
        return proc

    def check_output(self, ns: str, argv: list[str], **kwargs) -> str:
        kwargs.setdefault("text", True)
        return subprocess.check_output(["ip", "netns", "exec", ns, *argv], **kwargs)

    def ping(self, ns: str, dst: str, timeout: float = 1.0) -> bool:
        """One ICMP echo from namespace ``ns`` to ``dst`` (raw socket: the host has no ping)."""
        return icmp_ping(ns, dst, timeout)

    # inspection
    def status(self) -> dict:
        """What exists right now: one Node per namespace, the loss setting and the XDP_PASS id."""
        nodes = [self._node("switch", self.switch_ns, BRIDGE, None)]
        for i in range(self.aggregators):
            node = self._node(("aggregator" if i == 0 else f"aggregator {i}") + self._place(aggregator=i),
                              self.agg_ns_of(i), AGG_IFNAME, self.agg_ip_of(i))
            if netns_exists(self.switch_ns):
                node.port_state, node.rate_mbit = self._port(i)
            nodes.append(node)
        for i in range(self.workers):
            nodes.append(self._node(f"worker {i}" + self._place(worker=i), self.worker_ns(i), WORKER_IFNAME,
                                    self.worker_ip(i)))
        xdp = xdp_prog_id(self.switch_ns, "sw-agg") if netns_exists(self.switch_ns) else None
        return {
            "name": self.name,
            "workers": self.workers,
            "loss_percent": self.loss_percent,
            "mtu": self.mtu,
            "aggregators": self.aggregators,
            "racks": self.racks,
            "sw_agg_xdp_prog_id": xdp,
            "nodes": [asdict(n) for n in nodes],
        }

    def _place(self, aggregator: int | None = None, worker: int | None = None) -> str:
        """Where a node sits in a lab with racks, as its role says it: " (rack R)" or " (spine)"."""
        if not self.racks:
            return ""
        if worker is not None:
            return f" (rack {self.rack_of(worker)})"
        return f" (rack {aggregator})" if aggregator < self.racks else " (spine)"

    def _port(self, i: int) -> tuple[str, float | None]:
        """The bridge's port to aggregator ``i``: its state and its token-bucket rate (Mbit/s)."""
        with IPRoute(netns=self.switch_ns, flags=0) as ipr:
            links = ipr.get_links(ifname=self.agg_port_of(i))
        if not links:
            return "missing", None
        qdiscs = json.loads(self.check_output(self.switch_ns, ["tc", "-j", "qdisc", "show", "dev",
                                                               self.agg_port_of(i)]) or "[]")
        rates = [q["options"]["rate"] for q in qdiscs if q.get("kind") == "tbf" and q.get("root")]
        # tc gives bytes per second
        return "up" if links[0]["flags"] & 1 else "down", (rates[0] * 8 / 1e6 if rates else None)

    def _node(self, role: str, ns: str, ifname: str, address: str | None) -> Node:
        if not netns_exists(ns):
            return Node(role, ns, ifname, address, None, "missing")
        with IPRoute(netns=ns, flags=0) as ipr:
            links = ipr.get_links(ifname=ifname)
            if not links:
                return Node(role, ns, ifname, address, None, "missing")
            link = links[0]
            addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=link["index"])]
        state = "up" if link["flags"] & 1 else "down"  # IFF_UP
        addr = f"{addrs[0]}/{SUBNET_PREFIX}" if addrs else None
        return Node(role, ns, ifname, addr, link.get_attr("IFLA_ADDRESS"), state)

    def __repr__(self) -> str:
        return (f"Lab({self.name!r}, workers={self.workers}, loss_percent={self.loss_percent}, "
                f"mtu={self.mtu}, aggregators={self.aggregators}, racks={self.racks})")


def _lab_namespaces(name: str) -> list[str]:
    """Namespaces that belong to lab ``name`` (exact role suffixes, so lab `a` never matches `a_b`)."""
    pattern = re.compile(rf"^{re.escape(name)}-(sw|agg\d*|w\d+)$")
    try:
        entries = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in entries if pattern.match(n))


def icmp_ping(ns: str, dst: str, timeout: float = 1.0, attempts: int = 3) -> bool:
    """ICMP echo requests from namespace ``ns`` to ``dst``, up to ``attempts`` of them, each given
    ``timeout`` seconds; True as soon as a reply arrives. More than one, as ping does: the first
    echo into a lab made a moment ago can be lost while the neighbour entry is still being resolved
    on a busy host."""
    with in_netns(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    with sock:
        ident = os.getpid() & 0xFFFF
        payload = b"aggd-lab"
        for seq in range(1, attempts + 1):
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            csum = _inet_checksum(header + payload)
            sock.sendto(struct.pack("!BBHHH", 8, 0, csum, ident, seq) + payload, (dst, 0))
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([sock], [], [], left)[0]:
                    break
                data, (src, _) = sock.recvfrom(2048)
                ihl = (data[0] & 0x0F) * 4
                typ, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
                if typ == 0 and src == dst and rid == ident and 1 <= rseq <= seq:
                    return True
    return False


def _inet_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF
