"""``aggctl bench transport``: a worker's packet path alone, UDP sockets against an AF_XDP socket.

Two namespaces joined by one veth pair (``veth``), or by two through a bridge in a third, as the
lab's switch (``bridge``): the worker's end sends full-size UDP frames to a peer whose
native XDP program turns each one round (addresses and ports swapped, ``XDP_TX``), as an aggregator
returns a result a contribution; the worker keeps ``window`` frames in flight until ``bytes`` have
come back. ``udp``: one socket, UDP GSO out (64 KiB a send) and UDP GRO in, as the client;
``xsk``: an AF_XDP socket (``aggd.lab.xsk``; copy mode, as on any veth) on the worker's end, frames written once
into its UMEM. A row gives the rate and the host's busy CPU seconds a GB (``/proc/stat``: both ends
run on the host's cores). No bridge and no aggregator arithmetic: this is where the transport's
own cost shows, not an allreduce (``bench allreduce --systems aggd-xdp,aggd-xsk`` is that).
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import select
import socket
import struct
import time
import uuid

import numpy as np

SYSTEMS = ("udp", "xsk")
PEER_PORT, WORKER_PORT = 47000, 40000
WORKER_IP, PEER_IP = "10.78.0.1", "10.78.0.2"
WORKER_MAC, PEER_MAC = "02:00:00:00:78:01", "02:00:00:00:78:02"
#: a frame not back after this long is taken as lost and sent again (counted)
LOST_AFTER = 0.05

def _busy_cpu_seconds() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")   # all but idle and iowait


def _frame(payload: int) -> bytes:
    from aggd.lab.xsk import udp_frame_header
    header = udp_frame_header(_mac(PEER_MAC), _mac(WORKER_MAC), (WORKER_IP, WORKER_PORT), (PEER_IP, PEER_PORT),
                              payload)
    return header + bytes(i % 251 for i in range(payload))


def _mac(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


@contextlib.contextmanager
def _path(mtu: int, bridge: bool):
    """The worker's and the peer's namespaces joined by a veth, or with ``bridge`` by two veths
    through a bridge in a third namespace, as the lab's switch; removed on exit."""
    from pyroute2 import IPRoute, netns

    from aggd.lab.namespaces import PAGE_MTU, attach_xdp_pass, disable_tx_checksum
    tag = uuid.uuid4().hex[:8]
    worker, peer, switch = f"aggd-tw-{tag}", f"aggd-tp-{tag}", f"aggd-ts-{tag}"
    names = [worker, peer] + ([switch] if bridge else [])
    try:
        for ns in names:
            netns.create(ns)
        for ns, ifname, ip, mac, port in ((worker, "w0", WORKER_IP, WORKER_MAC, "sw-w"),
                                          (peer, "p0", PEER_IP, PEER_MAC, "sw-p")):
            if bridge:
                with IPRoute(netns=switch, flags=0) as ipr:
                    ipr.link("add", ifname=port, kind="veth",
                             peer={"ifname": ifname, "net_ns_fd": ns, "address": mac, "mtu": mtu})
            elif ns == worker:
                with IPRoute(netns=worker, flags=0) as ipr:
                    ipr.link("add", ifname="w0", kind="veth",
                             peer={"ifname": "p0", "net_ns_fd": peer, "address": PEER_MAC, "mtu": mtu})
            with IPRoute(netns=ns, flags=0) as ipr:
                idx = ipr.link_lookup(ifname=ifname)[0]
                ipr.link("set", index=idx, address=mac, mtu=mtu, state="up")
                ipr.addr("add", index=idx, address=ip, prefixlen=24)
                other_ip, other_mac = (PEER_IP, PEER_MAC) if ns == worker else (WORKER_IP, WORKER_MAC)
                ipr.neigh("add", dst=other_ip, lladdr=other_mac, ifindex=idx, state="permanent")
        if bridge:
            with IPRoute(netns=switch, flags=0) as ipr:
                ipr.link("add", ifname="br0", kind="bridge", br_mcast_snooping=0)
                br = ipr.link_lookup(ifname="br0")[0]
                for port in ("sw-w", "sw-p"):
                    ipr.link("set", ifname=port, master=br, mtu=mtu, state="up")
                ipr.link("set", index=br, mtu=mtu, state="up")
            # as the lab: native XDP_TX from the peer reaches the bridge only through a program there
            attach_xdp_pass(switch, "sw-p", frags=mtu > PAGE_MTU)
        # as the lab: a frame turned round by XDP keeps no partial checksum to finish
        disable_tx_checksum(worker, "w0")
        yield worker, peer
    finally:
        for ns in names:
            with contextlib.suppress(Exception):
                netns.remove(ns)


def _udp(n: int, window: int, payload: int, lost: list[int]) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        from aggd_client.transport import SOL_UDP, UDP_SEGMENT, grow_buffers
        from aggd_client.mrecv import UDP_GRO
        grow_buffers(sock)
        sock.bind((WORKER_IP, WORKER_PORT))
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
        sock.setblocking(False)
        seg = min(64, 65507 // payload)
        out = memoryview(_frame(payload)[-payload:] * seg)
        gso = [(SOL_UDP, UDP_SEGMENT, struct.pack("H", payload))]
        buf = bytearray(65536)
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        sent = back = 0
        while back < n:
            while sent < n and sent - back + seg <= window:
                k = min(seg, n - sent)
                try:
                    sock.sendmsg([out[:k * payload]], gso if k > 1 else [], 0, (PEER_IP, PEER_PORT))
                except BlockingIOError:
                    break
                sent += k
            got = 0
            while True:
                try:
                    nbytes = sock.recvmsg_into([buf], 64)[0]
                except BlockingIOError:
                    break
                got += -(-nbytes // payload)
            back += got
            if not got and not poll.poll(int(LOST_AFTER * 1000)):
                lost.append(sent - back)
                sent = back
    finally:
        sock.close()


def _xsk(n: int, window: int, payload: int, ifindex: int, redirect, lost: list[int]) -> bool:
    """The AF_XDP run; whether the socket was bound in zero-copy mode."""
    from aggd.lab.xsk import XDP_PKT_CONTD, XdpSocket
    frame = np.frombuffer(_frame(payload), np.uint8)
    tx_frames = 2048
    xsk = XdpSocket(ifindex, len(frame), tx_frames, 2 * window)
    try:
        redirect["xsks"][ctypes.c_int(0)] = ctypes.c_int(xsk.fd)
        xsk.tx_frames_view[:, :len(frame)] = frame
        sent = back = 0
        batch = 64
        while back < n:
            while sent < n and sent - back < window:
                first = sent % tx_frames
                k = min(batch, n - sent, window - (sent - back), tx_frames - first, tx_frames - xsk.reap())
                if k <= 0:
                    xsk.kick()
                    break
                xsk.send(first, k, len(frame))
                sent += k
            xsk.reap()
            descs = xsk.receive(0.0)
            if descs is None:
                descs = xsk.receive(LOST_AFTER)
                if descs is None:
                    lost.append(sent - back)
                    sent = back
                    continue
            xsk.give_back(descs["addr"])
            back += int(np.count_nonzero((descs["options"] & XDP_PKT_CONTD) == 0))   # a frame's last descriptor
        return xsk.zero_copy
    finally:
        xsk.close()


def run(mtus=(1500, 9000), nbytes: int = 1 << 30, window: int = 512, reps: int = 2, systems=SYSTEMS,
        paths=("veth",), on_row=None) -> list[dict]:
    """Each path ("veth": one veth; "bridge": through a bridge, as the lab) and MTU, ``reps`` times
    each system in turn: rows of rate and host CPU a GB."""
    from bcc import BPF

    from aggd.dataplane.xdp.loader import load_xdp_function
    from aggd.lab.namespaces import PAGE_MTU, attach_xdp_pass, in_netns
    from aggd.lab.xsk import REDIRECT_PROGRAM, TURN_ROUND_PROGRAM
    rows = []
    for path, mtu in itertools.product(paths, mtus):
        payload = mtu - 28
        n = max(1, nbytes // payload)
        frags = mtu > PAGE_MTU
        with _path(mtu, path == "bridge") as (worker, peer):
            turn = BPF(text=TURN_ROUND_PROGRAM, cflags=[f"-DPORT={PEER_PORT}"])
            redirect = BPF(text=REDIRECT_PROGRAM, cflags=[f"-DMEMBER_PORT={WORKER_PORT}", f"-DGROUP_PORT={WORKER_PORT}"])
            with in_netns(peer):
                BPF.attach_xdp(b"p0", load_xdp_function(turn, "turn_round", frags=frags), BPF.XDP_FLAGS_DRV_MODE)
            for rep in range(reps):
                for system in systems:
                    lost: list[int] = []
                    zero_copy = None
                    # the worker's end runs a program either way: native XDP_TX on a veth reaches
                    # only a peer that has one
                    if system == "udp":
                        attach_xdp_pass(worker, "w0", frags=frags)
                    else:
                        with in_netns(worker):
                            BPF.attach_xdp(b"w0", load_xdp_function(redirect, "to_xsk", frags=frags),
                                           BPF.XDP_FLAGS_DRV_MODE)
                    with in_netns(worker):
                        cpu0, t0 = _busy_cpu_seconds(), time.perf_counter()
                        if system == "udp":
                            _udp(n, window, payload, lost)
                        else:
                            zero_copy = _xsk(n, window, payload, socket.if_nametoindex("w0"), redirect, lost)
                        cpu1, t1 = _busy_cpu_seconds(), time.perf_counter()
                        BPF.remove_xdp(b"w0", BPF.XDP_FLAGS_DRV_MODE)
                    gb = n * payload / 1e9
                    row = {"bench": "transport", "system": system, "path": path, "mtu": mtu, "rep": rep, "frames": n,
                           "zero_copy": zero_copy,
                           "payload_bytes": payload, "window": window, "seconds": t1 - t0,
                           "gbps": gb * 8 / (t1 - t0), "host_cpu_seconds_per_gb": (cpu1 - cpu0) / gb,
                           "resends": len(lost), "frames_resent": sum(lost)}
                    rows.append(row)
                    if on_row:
                        on_row(row)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Rate and host CPU a GB per path and MTU, a bar per system (the mean over reps)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.get("path", "veth"), r["mtu"]) for r in rows}, key=lambda g: (g[0] != "veth", g[1]))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 2.5 * len(groups), 4))
    for ax, field, label in ((axes[0], "gbps", "Gbit/s out and back"),
                             (axes[1], "host_cpu_seconds_per_gb", "host CPU seconds a GB")):
        for j, system in enumerate(systems):
            values = [np.mean([r[field] for r in rows
                               if (r.get("path", "veth"), r["mtu"]) == g and r["system"] == system]) for g in groups]
            ax.bar(np.arange(len(groups)) + 0.4 * j, values, 0.4, label=system)
        ax.set_xticks(np.arange(len(groups)) + 0.2 * (len(systems) - 1))
        ax.set_xticklabels([f"{p}, MTU {m}" for p, m in groups], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("a worker's packet path alone: UDP sockets and AF_XDP (copy mode)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
