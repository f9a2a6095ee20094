"""Batched sends: one ``sendmmsg(2)`` for the answers the fast path built in a batch's records.

Python's socket module has no sendmmsg; ctypes calls libc's with an ``mmsghdr`` array prepared once
(as ``aggd_client.mrecv`` does for recvmmsg). Each message is one record of ``out`` (its start and
length) to one ``struct sockaddr_in``; ``MultiSender.send`` fills those in with numpy and sends them
all, in order, with as few calls as the kernel allows.
"""
from __future__ import annotations

import errno
import socket

import numpy as np

from aggd_client.mrecv import SOCKADDR_IN
from aggd_client.msend import MessageArray, libc_sendmmsg

#: Errors a send may meet under load or from a firewall rule; the message is lost, serving goes on
#: (the client retransmits), as with ``sendto``.
TRANSIENT = (errno.EAGAIN, errno.ENOBUFS, errno.EPERM, errno.ECONNREFUSED)


_SENDMMSG = libc_sendmmsg()
AVAILABLE = _SENDMMSG is not None


class MultiSender:
    """Sends up to ``n`` messages a call from the records of ``out`` (``rec`` bytes each)."""

    def __init__(self, out: np.ndarray, rec: int, n: int) -> None:
        self._out, self.rec, self.n = out, rec, n   # out kept alive: the iovecs point into it
        self.dests = np.zeros((n, SOCKADDR_IN), np.uint8)
        self._msgs = MessageArray(n, self.dests.ctypes.data, SOCKADDR_IN)
        self._out_base = out.ctypes.data

    def send(self, sock: socket.socket, records: np.ndarray, lengths: np.ndarray, dests: np.ndarray) -> int:
        """Send record ``records[k]`` (``lengths[k]`` bytes) to ``dests[k]`` (a sockaddr_in), for
        every k, in order; return how many were lost to a transient error."""
        m = len(records)
        if m > self.n:
            raise ValueError(f"{m} messages, room for {self.n}")
        self._msgs.base[:m] = self._out_base + records.astype(np.uint64) * self.rec
        self._msgs.length[:m] = lengths
        self.dests[:m] = dests
        lost = 0

        def refused(e: OSError) -> None:
            nonlocal lost
            if e.errno not in TRANSIENT:
                raise e
            lost += 1  # that message; the others go on

        self._msgs.send(_SENDMMSG, sock.fileno(), m, refused)
        return lost
