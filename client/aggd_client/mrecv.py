"""Batched receives: one ``recvmmsg(2)`` fills many records of the client's staging array.

Python's socket module has no recvmmsg; ctypes calls libc's with a ``mmsghdr`` array prepared once,
whose iovecs point at the staging records (``rec`` bytes each), so a batch of results costs one
system call and no Python object per datagram. ``MultiReceiver.drain`` has the contract of the
client's one-datagram-at-a-time loop (it is the fallback where libc has no recvmmsg, or with
``AGGD_CLIENT_RECVMMSG=0``): a datagram longer than ``rec`` is cut to ``rec`` bytes (the checks by
size then refuse it), ICMP errors queued on the socket are skipped. With ``names`` (the aggregator's
user-space path) each datagram's sender is kept too, as the ``struct sockaddr_in`` the kernel wrote.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct

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


class MultiReceiver:
    """Receives into ``stage`` (``n`` records of ``rec`` bytes, C-contiguous), recording each
    datagram's length in ``sizes`` and, given ``names`` (uint8[n, SOCKADDR_IN], C-contiguous), its
    sender's address."""

    def __init__(self, stage: np.ndarray, rec: int, sizes: np.ndarray, batched: bool = AVAILABLE,
                 names: np.ndarray | None = None):
        self.n, self.rec, self.sizes = len(stage), rec, sizes
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

    def drain(self, sock: socket.socket, m: int) -> int:
        """Receive from ``sock`` into records ``m ..`` until it is empty or the stage is full;
        returns the new ``m``."""
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
