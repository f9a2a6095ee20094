"""``XskClient``: the client with its packets sent and received through an AF_XDP socket (zero-copy where
the driver offers it, copy mode on the lab's veths) instead of UDP sockets, for the lab's measurement
of issue 20's optional transport (``aggctl bench allreduce --systems aggd-xsk``; docs/benchmarks.md,
"AF_XDP workers: measured, not kept").

It replaces the two methods of the client's transport (``_send``, ``_receive``) and keeps the rest:
rounds, retransmission and result handling see the same staging records. Contributions leave as
whole Ethernet frames built from one header written once into every transmit frame (every packet of
a job has one size; UDP checksum 0, which IPv4 allows). A small XDP program on the worker's interface
(bcc) hands the frames to the member's and the group's ports to the socket and passes the rest.
Lab only: it needs bcc and CAP_NET_ADMIN, which workers of the client distribution never have.
"""
from __future__ import annotations

import ctypes
import socket
import time

import numba
import numpy as np

from aggd_client import AggClient

from .namespaces import PAGE_MTU
from .xsk import FRAME_HEADER, REDIRECT_PROGRAM, XDP_PKT_CONTD, XdpSocket, udp_frame_header

TX_FRAMES, RX_FRAMES = 2048, 4096


@numba.njit(cache=True, nogil=True)
def gather_frames(umem, addrs, lens, opts, i, n, stage, sizes, m, m_end, header):
    """Copy the UDP payloads of the frames in descriptors ``i..n-1`` into staging records ``m..``
    (a frame of several descriptors continues while ``XDP_PKT_CONTD``), each cut to a record as recvmmsg
    cuts; their lengths into ``sizes``. Returns (next descriptor, next record)."""
    rec = stage.shape[1]
    while i < n and m < m_end:
        last = i
        while last < n and opts[last] & XDP_PKT_CONTD:
            last += 1
        if last >= n:
            break
        pos = 0
        for t in range(i, last + 1):
            skip = header if t == i else 0
            a = addrs[t] + skip
            cnt = lens[t] - skip
            take = min(cnt, rec - pos)
            if take > 0:
                stage[m, pos:pos + take] = umem[a:a + take]
            pos += cnt
        sizes[m] = min(pos, rec)
        m += 1
        i = last + 1
    return i, m


def _neighbour_mac(ip: str, timeout: float = 2.0) -> bytes:
    """The MAC address the kernel resolved for ``ip`` (a datagram to the discard port asks)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        while True:
            probe.sendto(b"", (ip, 9))
            with open("/proc/net/arp") as f:
                for line in f.read().splitlines()[1:]:
                    fields = line.split()
                    if fields[0] == ip and fields[3] != "00:00:00:00:00:00":
                        return bytes.fromhex(fields[3].replace(":", ""))
            if time.monotonic() > deadline:
                raise OSError(f"no neighbour entry for {ip}")
            time.sleep(0.01)


class XskClient(AggClient):
    """``AggClient`` whose packets go through an AF_XDP socket on ``ifname`` (see the module)."""

    def __init__(self, *args, ifname: str, **kwargs):
        super().__init__(*args, **kwargs)
        try:
            self._open_xsk(ifname)
        except BaseException:
            super().close()
            raise

    def _open_xsk(self, ifname: str) -> None:
        from bcc import BPF  # the lab's, as every lab program

        from aggd.dataplane.xdp.loader import load_xdp_function
        (src_ip, src_port), (dst_ip, dst_port) = self._address, self._server
        self._frame_len = FRAME_HEADER + self._rec
        self._xsk = XdpSocket(socket.if_nametoindex(ifname), self._frame_len, TX_FRAMES, RX_FRAMES)
        group_port = self._group[1] if self._group is not None else src_port
        self._bpf = BPF(text=REDIRECT_PROGRAM, cflags=[f"-DMEMBER_PORT={src_port}", f"-DGROUP_PORT={group_port}"])
        with open(f"/sys/class/net/{ifname}/mtu") as f:
            frags = int(f.read()) > PAGE_MTU
        self._ifname = ifname
        BPF.attach_xdp(ifname.encode(), load_xdp_function(self._bpf, "to_xsk", frags=frags), BPF.XDP_FLAGS_DRV_MODE)
        self._bpf["xsks"][ctypes.c_int(0)] = ctypes.c_int(self._xsk.fd)
        with open(f"/sys/class/net/{ifname}/address") as f:
            own_mac = bytes.fromhex(f.read().strip().replace(":", ""))
        header = udp_frame_header(_neighbour_mac(dst_ip), own_mac, (src_ip, src_port), (dst_ip, dst_port), self._rec)
        self._xsk.tx_frames_view[:, :FRAME_HEADER] = np.frombuffer(header, np.uint8)
        self._tx_next = 0
        # compiled (or loaded from numba's cache) now, not in the first round
        empty = np.zeros(0, np.uint64)
        gather_frames(self._xsk.umem, empty, empty.view(np.uint32)[:0], empty.view(np.uint32)[:0], 0, 0,
                      self._stage_u8, self._sizes, 0, 0, FRAME_HEADER)
        self._pending: np.ndarray | None = None   # received descriptors the stage had no room for
        self._pending_at = 0
        self._receiver.full_at = len(self._sizes)

    def close(self) -> None:
        xsk = getattr(self, "_xsk", None)
        if xsk is not None:
            from bcc import BPF
            try:
                BPF.remove_xdp(self._ifname.encode(), BPF.XDP_FLAGS_DRV_MODE)
            finally:
                xsk.close()
                self._xsk = None
        super().close()

    def _send(self, buf: memoryview, npk: int) -> None:
        xsk, rec = self._xsk, self._rec
        records = np.frombuffer(buf, np.uint8, count=npk * rec).reshape(npk, rec)
        i = 0
        while i < npk:
            free = TX_FRAMES - xsk.reap()
            if free == 0:
                xsk.kick()
                continue
            k = min(npk - i, free, TX_FRAMES - self._tx_next)   # a run of frames, to the area's end
            xsk.tx_frames_view[self._tx_next:self._tx_next + k, FRAME_HEADER:self._frame_len] = records[i:i + k]
            xsk.send(self._tx_next, k, self._frame_len)
            self._tx_next = (self._tx_next + k) % TX_FRAMES
            i += k
        self.stats["packets_sent"] += npk

    def _receive(self, timeout: float) -> int:
        new = self._xsk.receive(timeout if self._pending is None else 0.0)
        if new is not None:
            self._pending = new if self._pending is None else np.concatenate([self._pending[self._pending_at:], new])
            self._pending_at = 0
        if self._pending is None:
            return 0
        d = self._pending
        i, m = gather_frames(self._xsk.umem, d["addr"], d["len"], d["options"], self._pending_at, len(d),
                             self._stage_u8, self._sizes, 0, len(self._sizes), FRAME_HEADER)
        self._xsk.give_back(d["addr"][self._pending_at:i])
        self._pending_at = i
        if i >= len(d):
            self._pending = None
        if m:
            self._process(m)
        return m

