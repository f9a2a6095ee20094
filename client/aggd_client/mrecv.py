"""Batched receives: one ``recvmmsg(2)`` fills many records of the client's staging array.

Python's socket module has no recvmmsg; ctypes calls libc's with a ``mmsghdr`` array prepared once,
whose iovecs point at the staging records (``rec`` bytes each), so a batch of results costs one
system call and no Python object per datagram. ``MultiReceiver.drain`` has the contract of the
client's one-datagram-at-a-time loop (it is the fallback where libc has no recvmmsg, or with
``AGGD_CLIENT_RECVMMSG=0``): a datagram longer than ``rec`` is cut to ``rec`` bytes (the checks by
size then refuse it), ICMP errors queued on the socket are skipped. With ``names`` (the aggregator's
user-space path) each datagram's sender is kept too, as the ``struct sockaddr_in`` the kernel wrote.

After ``use_gro`` (``UDP_GRO`` set on the sockets) the kernel may hand over a train of datagrams of one
sender as one message: up to 64 datagrams of ``gso_size`` bytes back to back (the last may be
shorter), ``gso_size`` in a control message. One ``recvmsg`` then reads the whole train into the
records from ``m`` on: where ``gso_size`` is the record size the datagrams land in place, one a
record; otherwise they are moved apart. A read is made only while the stage has room for the largest
train (65,535 bytes). Where nothing is coalesced (``LONE_LIMIT`` datagrams read alone, no train yet)
the receiver turns UDP_GRO off again and goes back to recvmmsg. ``AGGD_CLIENT_GRO=0`` never asks.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import sys

import numpy as np

MSG_DONTWAIT = socket.MSG_DONTWAIT
#: Bytes of a ``struct sockaddr_in``: family (host order), port and address (network order), zeros.
SOCKADDR_IN = 16


def sockaddr_in(addr: tuple[str, int]) -> bytes:
    """``struct sockaddr_in`` of an IPv4 (host, port), as recvmmsg writes it."""
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H4s", addr[1], socket.inet_aton(addr[0])) + bytes(8)


def sockaddr_addr(name: np.ndarray | bytes) -> tuple[str, int]:
    """The (host, port) of a ``struct sockaddr_in``, as ``socket.recvfrom`` gives it."""
    name = bytes(name)
    return socket.inet_ntoa(name[4:8]), int.from_bytes(name[2:4], "big")


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(_Iovec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


#: The structures, for the aggregator's sendmmsg (aggd.dataplane.userspace.msend).
Iovec, Mmsghdr = _Iovec, _Mmsghdr


#: Linux: the UDP_GRO socket option and control message (the segment size, an int).
SOL_UDP, UDP_GRO = 17, 104
#: The largest message a UDP_GRO socket is handed: a train of at most 64 KiB of datagrams.
GRO_MAX_BYTES = 65535
_CMSG_SPACE = 64
#: Datagrams read one by one, none ever coalesced, after which reads go back to recvmmsg.
LONE_LIMIT = 1024


class _Cmsghdr(ctypes.Structure):
    _fields_ = [("cmsg_len", ctypes.c_size_t), ("cmsg_level", ctypes.c_int), ("cmsg_type", ctypes.c_int)]


def _disable_gro(sock: socket.socket) -> None:
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 0)
    except OSError:
        pass


def enable_gro(sock: socket.socket) -> bool:
    """Ask the kernel to coalesce trains of datagrams for ``sock`` (UDP_GRO); whether it accepted."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
        return True
    except OSError:
        return False


def _libc_recvmmsg():
    if os.environ.get("AGGD_CLIENT_RECVMMSG", "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).recvmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_RECVMMSG = _libc_recvmmsg()
AVAILABLE = _RECVMMSG is not None


def _libc_recvmsg():
    try:
        fn = ctypes.CDLL(None, use_errno=True).recvmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_ssize_t
    return fn


_RECVMSG = _libc_recvmsg()
GRO_AVAILABLE = _RECVMSG is not None and os.environ.get("AGGD_CLIENT_GRO", "1") != "0"


class MultiReceiver:
    """Receives into ``stage`` (``n`` records of ``rec`` bytes, C-contiguous), recording each
    datagram's length in ``sizes`` and, given ``names`` (uint8[n, SOCKADDR_IN], C-contiguous), its
    sender's address."""

    def __init__(self, stage: np.ndarray, rec: int, sizes: np.ndarray, batched: bool = AVAILABLE,
                 names: np.ndarray | None = None):
        self.n, self.rec, self.sizes = len(stage), rec, sizes
        self.gro = False
        self._gro_socks: list[socket.socket] = []
        self._lone = 0  # datagrams read alone since the last train
        self.trains = self.train_datagrams = 0  # coalesced reads, and the datagrams they held
        # a drain stops once this many records are filled: all of them, or with gro once the rest
        # could not take the largest train
        self.full_at = self.n
        self._stage = stage  # kept alive: the iovecs point into it
        if names is not None and (names.shape != (self.n, SOCKADDR_IN) or names.dtype != np.uint8
                                  or not names.flags.c_contiguous):
            raise ValueError(f"names must be C-contiguous uint8[{self.n}, {SOCKADDR_IN}]")
        self.names = names
        flat = memoryview(stage.view(np.uint8).reshape(-1))
        self._views = [flat[i * rec:(i + 1) * rec] for i in range(self.n)]
        self.batched = batched and AVAILABLE
        self._namelens = None
        if self.batched:
            base = stage.ctypes.data
            self._iov = (_Iovec * self.n)(*[_Iovec(base + i * rec, rec) for i in range(self.n)])
            self._msgs = (_Mmsghdr * self.n)()
            for i in range(self.n):
                self._msgs[i].msg_hdr.msg_iov = ctypes.pointer(self._iov[i])
                self._msgs[i].msg_hdr.msg_iovlen = 1
                if names is not None:
                    self._msgs[i].msg_hdr.msg_name = names.ctypes.data + i * SOCKADDR_IN
            self._addr = ctypes.addressof(self._msgs)
            self._stride = ctypes.sizeof(_Mmsghdr)
            raw = (ctypes.c_char * (self.n * self._stride)).from_address(self._addr)
            self._lens = np.frombuffer(raw, np.uint8).reshape(self.n, self._stride)
            self._len_at = _Mmsghdr.msg_len.offset
            # the kernel overwrites msg_namelen with the address's length: reset before each call
            namelen_at = _Mmsghdr.msg_hdr.offset + _Msghdr.msg_namelen.offset
            self._namelens = self._lens[:, namelen_at:namelen_at + 4].view(np.uint32) if names is not None else None
        if _RECVMSG is not None and names is None:
            self._base = stage.ctypes.data
            self._u8 = stage.view(np.uint8).reshape(-1)
            self._g_iov = _Iovec()
            self._g_ctl = ctypes.create_string_buffer(_CMSG_SPACE)
            self._g_msg = _Msghdr()
            self._g_msg.msg_iov = ctypes.pointer(self._g_iov)
            self._g_msg.msg_iovlen = 1
            self._g_msg.msg_control = ctypes.addressof(self._g_ctl)
            self._g_addr = ctypes.addressof(self._g_msg)

    def use_gro(self, socks: list[socket.socket]) -> bool:
        """Ask the kernel for trains of datagrams on ``socks`` (UDP_GRO): drains read trains from
        then on. False, and nothing changed, where the kernel, libc or the mode cannot."""
        if not GRO_AVAILABLE or self.names is not None or (self.n - 1) * self.rec < GRO_MAX_BYTES:
            return False
        for i, s in enumerate(socks):
            if not enable_gro(s):
                for t in socks[:i]:
                    _disable_gro(t)
                return False
        self._gro_socks = list(socks)
        self.gro = True
        self.full_at = max(1, self.n - -(-GRO_MAX_BYTES // self.rec) + 1)
        return True

    def _stop_gro(self) -> None:
        """Back to batched reads: nothing was coalesced (no GRO on the interface, or senders
        without UDP checksums), and a read a datagram costs more than recvmmsg's."""
        for s in self._gro_socks:
            _disable_gro(s)
        self._gro_socks = []
        self.gro = False
        self.full_at = self.n

    def drain(self, sock: socket.socket, m: int) -> int:
        """Receive from ``sock`` into records ``m ..`` until it is empty or the stage is full;
        returns the new ``m``."""
        if self.gro:
            return self._drain_trains(sock, m)
        if not self.batched:
            return self._drain_one_by_one(sock, m)
        fd = sock.fileno()
        if self._namelens is not None:
            self._namelens[m:] = SOCKADDR_IN
        while m < self.n:
            got = _RECVMMSG(fd, self._addr + m * self._stride, self.n - m, MSG_DONTWAIT, None)
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.ECONNREFUSED:  # a queued ICMP error; datagrams may follow it
                    continue
                if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                    break
                raise OSError(err, os.strerror(err))
            if got == 0:
                break
            lens = self._lens[m:m + got, self._len_at:self._len_at + 4].copy().view(np.uint32).reshape(-1)
            self.sizes[m:m + got] = lens
            m += got
        return m

    def _drain_one_by_one(self, sock: socket.socket, m: int) -> int:
        views, sizes, rec, names = self._views, self.sizes, self.rec, self.names
        while m < self.n:
            try:
                if names is None:
                    sizes[m] = sock.recv_into(views[m], rec, MSG_DONTWAIT)
                else:
                    sizes[m], src = sock.recvfrom_into(views[m], rec, MSG_DONTWAIT)
                    names[m] = np.frombuffer(sockaddr_in(src), np.uint8)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError:
                continue
            m += 1
        return m

    def _drain_trains(self, sock: socket.socket, m: int) -> int:
        """``drain`` for a UDP_GRO socket: one recvmsg a train of datagrams (see the module)."""
        fd, rec, msg, iov = sock.fileno(), self.rec, self._g_msg, self._g_iov
        while (self.n - m) * rec >= GRO_MAX_BYTES:
            iov.iov_base = self._base + m * rec
            iov.iov_len = (self.n - m) * rec
            msg.msg_controllen = _CMSG_SPACE
            got = _RECVMSG(fd, self._g_addr, MSG_DONTWAIT)
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.ECONNREFUSED:
                    continue
                if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                    break
                raise OSError(err, os.strerror(err))
            seg = self._segment_size(msg)
            if seg == 0 or got <= seg:  # one datagram
                self.sizes[m] = min(got, rec)
                m += 1
                self._lone += 1
                if self._lone >= LONE_LIMIT and not self.trains:
                    self._stop_gro()
                    return self.drain(sock, m)
                continue
            k = -(-got // seg)
            self._lone = 0
            self.trains += 1
            self.train_datagrams += k
            if seg != rec:  # move the datagrams apart, one a record (cut to a record)
                k = min(k, self.n - m)
                start = m * rec
                train = self._u8[start:start + got].copy()
                for i in range(k):
                    part = train[i * seg:(i + 1) * seg][:rec]
                    self._u8[start + i * rec:start + i * rec + part.size] = part
                    self.sizes[m + i] = part.size
            else:
                self.sizes[m:m + k] = rec
                self.sizes[m + k - 1] = got - (k - 1) * rec
            m += k
        return m

    def _segment_size(self, msg: "_Msghdr") -> int:
        """The UDP_GRO segment size in ``msg``'s control data; 0 if none (a lone datagram)."""
        n, off, ctl = msg.msg_controllen, 0, self._g_ctl
        head = ctypes.sizeof(_Cmsghdr)
        while off + head <= n:
            c = _Cmsghdr.from_buffer(ctl, off)
            if c.cmsg_len < head:
                break
            if c.cmsg_level == SOL_UDP and c.cmsg_type == UDP_GRO:
                return int.from_bytes(ctl.raw[off + head:off + head + 4], sys.byteorder)
            off += (c.cmsg_len + 7) & ~7
        return 0
