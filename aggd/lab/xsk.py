"""An AF_XDP socket, through ctypes and numpy: its UMEM and its four rings; and the small XDP programs
and frame header of the lab's packet-path measurements.

For the lab's AF_XDP measurements (``aggd.lab.xsk_client``, ``aggctl bench transport``), not for the
client distribution: on the lab's veths AF_XDP did not beat the client's UDP sockets in an allreduce
(docs/benchmarks.md, "AF_XDP workers"). Python's socket module cannot bind an AF_XDP socket, so the
socket calls go through libc. The UMEM is split in two: transmit frames first, then receive frames,
each ``frame`` bytes of whole chunks; a frame longer than a chunk (MTU 9000 in 4 KiB chunks) is
several descriptors, all but the last marked ``XDP_PKT_CONTD`` (AF_XDP multi-buffer, ``XDP_USE_SG``).
The kernel binds in zero-copy mode where the driver offers it and in copy mode elsewhere (veth:
always copy); ``zero_copy`` says which. The ring code is the same in both.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import socket
import struct

import numpy as np

AF_XDP, SOL_XDP = 44, 283
XDP_MMAP_OFFSETS, XDP_RX_RING, XDP_TX_RING, XDP_UMEM_REG = 1, 2, 3, 4
XDP_UMEM_FILL_RING, XDP_UMEM_COMPLETION_RING, XDP_OPTIONS = 5, 6, 8
XDP_USE_SG = 1 << 4
XDP_OPTIONS_ZEROCOPY = 1
XDP_PKT_CONTD = 1
#: mmap offsets of the rings (include/uapi/linux/if_xdp.h)
_PGOFF = {"rx": 0, "tx": 0x80000000, "fill": 0x100000000, "completion": 0x180000000}
DESC = np.dtype([("addr", np.uint64), ("len", np.uint32), ("options", np.uint32)])
CHUNK = 4096
#: Ethernet, IPv4 (no options) and UDP headers in front of a frame's payload.
FRAME_HEADER = 42

#: C for XDP programs: the lab's headers and ``udp_of``, the UDP header of an IPv4 frame without
#: options (its Ethernet and IP headers through ``e`` and ``i``), or NULL.
UDP_OF_C = rb"""
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/in.h>
#include <uapi/linux/udp.h>
static __always_inline struct udphdr *udp_of(struct xdp_md *ctx, struct ethhdr **e, struct iphdr **i) {
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > end || eth->h_proto != htons(ETH_P_IP)) return 0;
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_UDP || ip->ihl != 5) return 0;
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > end) return 0;
    *e = eth;
    *i = ip;
    return udp;
}
"""

#: The XDP program that hands the UDP datagrams to ``MEMBER_PORT`` and ``GROUP_PORT`` (cflags) to
#: the socket in entry 0 of ``xsks`` and passes everything else up the stack.
REDIRECT_PROGRAM = UDP_OF_C + rb"""
BPF_XSKMAP(xsks, 1);
int to_xsk(struct xdp_md *ctx) {
    struct ethhdr *eth;
    struct iphdr *ip;
    struct udphdr *udp = udp_of(ctx, &eth, &ip);
    if (!udp || (udp->dest != htons(MEMBER_PORT) && udp->dest != htons(GROUP_PORT))) return XDP_PASS;
    return xsks.redirect_map(0, XDP_PASS);
}
"""

#: An XDP program that sends each UDP datagram to ``PORT`` (cflags) back where it came from, MACs,
#: addresses and ports swapped (both checksums stay valid: one's-complement sums commute), by
#: XDP_TX: an aggregator's answer without the arithmetic (``bench transport``, tests/netns).
TURN_ROUND_PROGRAM = UDP_OF_C + rb"""
int turn_round(struct xdp_md *ctx) {
    struct ethhdr *eth;
    struct iphdr *ip;
    struct udphdr *udp = udp_of(ctx, &eth, &ip);
    if (!udp || udp->dest != htons(PORT)) return XDP_PASS;
    unsigned char mac[ETH_ALEN];
    __builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
    __builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
    __builtin_memcpy(eth->h_source, mac, ETH_ALEN);
    __be32 addr = ip->saddr; ip->saddr = ip->daddr; ip->daddr = addr;
    __be16 port = udp->source; udp->source = udp->dest; udp->dest = port;
    return XDP_TX;
}
"""


_libc = ctypes.CDLL(None, use_errno=True)
_libc.socket.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
_libc.bind.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint]
_libc.setsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint]
_libc.getsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_libc.sendto.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                         ctypes.c_uint]


def udp_frame_header(dst_mac: bytes, src_mac: bytes, src: tuple[str, int], dst: tuple[str, int],
                     payload: int) -> bytes:
    """The ``FRAME_HEADER`` bytes of a UDP datagram of ``payload`` bytes from ``src`` to ``dst``
    ((ip, port) each): IPv4 without options, don't-fragment, UDP checksum 0 (which IPv4 allows)."""
    udp_len = 8 + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0x4000, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
    s = sum(struct.unpack("!10H", ip))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    ip = ip[:10] + struct.pack("!H", ~s & 0xFFFF) + ip[12:]
    return dst_mac + src_mac + b"\x08\x00" + ip + struct.pack("!HHHH", src[1], dst[1], udp_len, 0)


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


class _Ring:
    """One ring mapped from the socket: ``prod`` and ``cons`` are the shared indices (uint32 views),
    ``ring`` its entries."""

    def __init__(self, fd: int, offsets: tuple[int, int, int, int], pgoff: int, size: int, dtype: np.dtype):
        prod, cons, desc, _flags = offsets
        self._map = mmap.mmap(fd, desc + size * dtype.itemsize, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                              mmap.PROT_READ | mmap.PROT_WRITE, offset=pgoff)
        raw = np.frombuffer(self._map, np.uint8)
        self.prod = raw[prod:prod + 4].view(np.uint32)
        self.cons = raw[cons:cons + 4].view(np.uint32)
        self.ring = raw[desc:desc + size * dtype.itemsize].view(dtype)
        self.mask = size - 1

    def slots(self, start: int, n: int) -> np.ndarray:
        return np.arange(start, start + n, dtype=np.int64) & self.mask


class XdpSocket:
    """An AF_XDP socket bound to queue ``queue`` of ``ifindex``, with ``tx_frames``
    transmit and ``rx_frames`` receive frames of ``frame_bytes`` (rounded up to whole chunks)."""

    def __init__(self, ifindex: int, frame_bytes: int, tx_frames: int, rx_frames: int, queue: int = 0):
        self.parts = -(-frame_bytes // CHUNK)             # descriptors a frame
        self.frame = self.parts * CHUNK
        self.tx_frames, self.rx_frames = tx_frames, rx_frames
        ring = 1 << (max(tx_frames, rx_frames) * self.parts - 1).bit_length()   # a power of two
        self.fd = _check(_libc.socket(AF_XDP, socket.SOCK_RAW, 0), "socket(AF_XDP)")
        try:
            size = (tx_frames + rx_frames) * self.frame
            self._umem = mmap.mmap(-1, size, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
            self.umem = np.frombuffer(self._umem, np.uint8)
            self._setsockopt(XDP_UMEM_REG, struct.pack("QQIIII", self.umem.ctypes.data, size, CHUNK, 0, 0, 0))
            for opt in (XDP_UMEM_FILL_RING, XDP_UMEM_COMPLETION_RING, XDP_RX_RING, XDP_TX_RING):
                self._setsockopt(opt, struct.pack("I", ring))
            buf = ctypes.create_string_buffer(128)
            length = ctypes.c_uint(128)
            _check(_libc.getsockopt(self.fd, SOL_XDP, XDP_MMAP_OFFSETS, buf, ctypes.byref(length)),
                   "getsockopt(XDP_MMAP_OFFSETS)")
            offs = struct.unpack("16Q", buf.raw)
            off = {k: offs[4 * i:4 * i + 4] for i, k in enumerate(("rx", "tx", "fill", "completion"))}
            u64 = np.dtype(np.uint64)
            self.rx = _Ring(self.fd, off["rx"], _PGOFF["rx"], ring, DESC)
            self.tx = _Ring(self.fd, off["tx"], _PGOFF["tx"], ring, DESC)
            self.fill = _Ring(self.fd, off["fill"], _PGOFF["fill"], ring, u64)
            self.completion = _Ring(self.fd, off["completion"], _PGOFF["completion"], ring, u64)
            addr = struct.pack("HHIII", AF_XDP, XDP_USE_SG if self.parts > 1 else 0, ifindex, queue, 0)
            _check(_libc.bind(self.fd, ctypes.create_string_buffer(addr, len(addr)), len(addr)), "bind(AF_XDP)")
            options = ctypes.c_uint32(0)
            length = ctypes.c_uint(4)
            _check(_libc.getsockopt(self.fd, SOL_XDP, XDP_OPTIONS, ctypes.byref(options), ctypes.byref(length)),
                   "getsockopt(XDP_OPTIONS)")
            self.zero_copy = bool(options.value & XDP_OPTIONS_ZEROCOPY)
        except BaseException:
            os.close(self.fd)
            raise
        # every receive chunk goes to the fill ring at once
        rx_chunks = (tx_frames * self.parts + np.arange(rx_frames * self.parts, dtype=np.uint64)) * np.uint64(CHUNK)
        self.give_back(rx_chunks)
        self.tx_frames_view = self.umem[:tx_frames * self.frame].reshape(tx_frames, self.frame)
        part = np.arange(self.parts, dtype=np.uint64) * np.uint64(CHUNK)
        self._tx_addrs = (np.arange(tx_frames, dtype=np.uint64)[:, None] * np.uint64(self.frame) + part).reshape(-1)
        self._tx_prod = self._rx_cons = self._completed = 0
        self.in_flight = 0                                   # transmit frames not yet completed
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def _setsockopt(self, opt: int, value: bytes) -> None:
        _check(_libc.setsockopt(self.fd, SOL_XDP, opt, ctypes.create_string_buffer(value, len(value)), len(value)),
               f"setsockopt(SOL_XDP, {opt})")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- transmit -----------------------------------------------------------------------------
    def send(self, first: int, count: int, frame_len: int) -> None:
        """Send transmit frames ``first .. first+count-1`` (``frame_len`` bytes each, already
        written in ``tx_frames_view``) and wake the kernel to copy them out."""
        n = count * self.parts
        lens = np.full(self.parts, CHUNK, np.uint32)
        lens[-1] = frame_len - (self.parts - 1) * CHUNK
        opts = np.zeros(self.parts, np.uint32)
        opts[:-1] = XDP_PKT_CONTD
        slots = self.tx.slots(self._tx_prod, n)
        self.tx.ring["addr"][slots] = self._tx_addrs[first * self.parts:(first + count) * self.parts]
        self.tx.ring["len"][slots] = np.tile(lens, count)
        self.tx.ring["options"][slots] = np.tile(opts, count)
        self._tx_prod = (self._tx_prod + n) & 0xFFFFFFFF
        self.tx.prod[0] = self._tx_prod                     # x86 keeps stores in order
        self.in_flight += count
        self.kick()

    def kick(self) -> None:
        """sendto(2) copies out what the transmit ring holds, a batch a call (EAGAIN: more left)."""
        while True:
            if _libc.sendto(self.fd, None, 0, socket.MSG_DONTWAIT, None, 0) >= 0:
                return
            err = ctypes.get_errno()
            if err == errno.EAGAIN and int(self.tx.cons[0]) != self._tx_prod:
                continue
            if err in (errno.EAGAIN, errno.EBUSY, errno.ENOBUFS):
                return
            raise OSError(err, f"sendto(AF_XDP): {os.strerror(err)}")

    def reap(self) -> int:
        """Take the completed transmit chunks off the completion ring; frames still in flight."""
        prod = int(self.completion.prod[0])
        done = (prod - self._completed) & 0xFFFFFFFF
        if done:
            self._completed = prod
            self.completion.cons[0] = prod
            self.in_flight -= done // self.parts
        return self.in_flight

    # -- receive ------------------------------------------------------------------------------
    def receive(self, timeout: float) -> np.ndarray | None:
        """The descriptors received (waiting up to ``timeout`` s for the first), or None; their
        chunks go back with ``give_back``."""
        prod = int(self.rx.prod[0])
        if prod == self._rx_cons and timeout > 0 and self._poll.poll(max(1, int(timeout * 1000))):
            prod = int(self.rx.prod[0])
        n = (prod - self._rx_cons) & 0xFFFFFFFF
        if not n:
            return None
        descs = self.rx.ring[self.rx.slots(self._rx_cons, n)]
        self._rx_cons = prod
        self.rx.cons[0] = prod
        return descs

    def give_back(self, addrs: np.ndarray) -> None:
        """Return receive chunks to the kernel through the fill ring."""
        prod = int(self.fill.prod[0])
        self.fill.ring[self.fill.slots(prod, len(addrs))] = addrs
        self.fill.prod[0] = (prod + len(addrs)) & 0xFFFFFFFF
