"""Batched sends: one ``sendmmsg(2)`` for a run of back-to-back packets to the aggregator.

Where UDP GSO cannot be used (XDP in generic mode sees a GSO super-packet once, unsegmented) a
window of packets would otherwise cost one ``sendto`` each, a system call and a few Python objects
per packet. ``RunSender`` keeps an ``mmsghdr`` array (prepared once, as ``mrecv`` does for
recvmmsg) whose messages all go to one address; a send points their iovecs at consecutive records
of a buffer with one numpy write and hands the kernel up to ``n`` packets a call.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket

import numpy as np

from .mrecv import SOCKADDR_IN, Iovec, Mmsghdr, sockaddr_in


def libc_sendmmsg():
    """libc's ``sendmmsg`` through ctypes, or None where there is none (the daemon's user-space
    path uses it too: ``aggd.dataplane.userspace.msend``)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sendmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class MessageArray:
    """``n`` messages of one iovec each for sendmmsg, prepared once (as ``mrecv`` does for
    recvmmsg): message ``i`` goes to the ``struct sockaddr_in`` at ``names + i * name_stride``
    (stride 0: one address for all); ``base`` and ``length`` are numpy views of the iovecs, set
    before each send."""

    def __init__(self, n: int, names: int, name_stride: int) -> None:
        self.n = n
        self._iov = (Iovec * n)()
        self._msgs = (Mmsghdr * n)()
        for i in range(n):
            self._msgs[i].msg_hdr.msg_iov = ctypes.pointer(self._iov[i])
            self._msgs[i].msg_hdr.msg_iovlen = 1
            self._msgs[i].msg_hdr.msg_name = names + i * name_stride
            self._msgs[i].msg_hdr.msg_namelen = SOCKADDR_IN
        iov = np.frombuffer((ctypes.c_char * ctypes.sizeof(self._iov)).from_address(ctypes.addressof(self._iov)),
                            np.uint64).reshape(n, 2)
        self.base, self.length = iov[:, 0], iov[:, 1]
        self._addr = ctypes.addressof(self._msgs)
        self._stride = ctypes.sizeof(Mmsghdr)

    def send(self, sendmmsg, fd: int, m: int, on_error) -> int:
        """Send the first ``m`` messages, in order, with as few calls as the kernel allows. A
        message it refuses is passed to ``on_error(OSError)`` (which raises to stop) and skipped.
        Returns how many left."""
        k = sent_total = 0
        while k < m:
            sent = sendmmsg(fd, self._addr + k * self._stride, m - k, 0)
            if sent < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                on_error(OSError(err, os.strerror(err)))
                k += 1  # that message is lost; loss recovery sends it again
                continue
            k += sent
            sent_total += sent
        return sent_total


_SENDMMSG = None if os.environ.get("AGGD_CLIENT_SENDMMSG", "1") == "0" else libc_sendmmsg()
AVAILABLE = _SENDMMSG is not None


class RunSender:
    """Sends runs of up to ``n`` records of ``rec`` bytes, each a datagram to ``dest``."""

    def __init__(self, n: int, rec: int, dest: tuple[str, int]) -> None:
        self.n, self.rec = n, rec
        self._name = np.frombuffer(sockaddr_in(dest), np.uint8).copy()  # kept alive: pointed at
        self._msgs = MessageArray(n, self._name.ctypes.data, 0)
        self._msgs.length[:] = rec
        self._offsets = np.arange(n, dtype=np.uint64) * np.uint64(rec)

    def send(self, sock: socket.socket, buf, count: int, on_error) -> int:
        """Send records ``0 .. count-1`` of ``buf`` (a buffer of at least ``count * rec`` bytes),
        in order. A message the kernel refuses is passed to ``on_error(OSError)`` (which raises
        for what is not transient) and skipped; returns how many messages left."""
        data = np.frombuffer(buf, np.uint8)  # kept alive until the call returns
        if data.size < count * self.rec:
            raise ValueError(f"{count} records of {self.rec} bytes, buffer of {data.size}")
        fd, addr, done, sent_total = sock.fileno(), data.ctypes.data, 0, 0
        while done < count:
            m = min(self.n, count - done)
            self._msgs.base[:m] = self._offsets[:m] + np.uint64(addr + done * self.rec)
            sent_total += self._msgs.send(_SENDMMSG, fd, m, on_error)
            done += m
        return sent_total
