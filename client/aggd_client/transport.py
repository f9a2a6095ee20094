"""The client's sockets: contributions out (UDP GSO, else ``sendmmsg`` runs, else one ``sendto`` a
packet), results and NACKs in, a batch at a time, into one preallocated staging array.

``UdpTransport`` is a mixin of ``AggClient``: the sockets and the staging array are the client's
own attributes, which the rounds (``rounds``) send from and the result handling (``results``)
reads. It knows nothing of rounds or chunks: it moves runs of back-to-back records.
"""
from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
import selectors
import socket
import struct

import numpy as np

from . import msend
from .mrecv import MultiReceiver
from .protocol import HEADER_DTYPE, HEADER_SIZE
from .rounds import ADMIT_MAX

log = logging.getLogger("aggd_client")  # one logger for the whole client, whatever the module

#: Linux socket options Python does not name on every version.
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)
SOL_UDP = getattr(socket, "SOL_UDP", 17)
#: The kernel takes at most 64 segments in one GSO send (UDP_MAX_SEGMENTS on older kernels) and a
#: UDP datagram carries at most 65507 bytes of payload.
GSO_MAX_SEGMENTS = 64
UDP_MAX_PAYLOAD = 65507
#: errnos that mean "this kernel/path cannot do UDP GSO".
#: EMSGSIZE: GSO segments must fit the MTU; a job with larger packets (served by the daemon in user
#: space) needs plain sends, which IP fragments.
_GSO_REFUSED = {errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EMSGSIZE}
#: errnos that lose the packet but leave the socket usable: loss recovery takes care of them.
_TRANSIENT = {errno.ENOBUFS, errno.EAGAIN, errno.EPERM, errno.ECONNREFUSED, errno.EHOSTUNREACH,
              errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}
#: Largest receive batch handled at once: at most STAGE_BYTES of packets (256 of 832 values, 31 of
#: 8,192).
STAGE = 256
STAGE_BYTES = 1 << 20
SOCKET_BUFFER = 16 << 20


def _local_ip_towards(server: tuple[str, int]) -> str:
    """The local address the kernel would send from to reach ``server`` (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(server)
        return probe.getsockname()[0]
    finally:
        probe.close()


def staging_dtype(elements: int, lanes) -> np.dtype:
    """A receive staging record: a header and ``elements`` values of the job's result type
    (``lanes.result``), as long as the longest result of ``elements`` values (int32), so that a
    result of another precision is received whole and refused by its ``code``."""
    return np.dtype({"names": ["hdr", "payload"], "formats": [HEADER_DTYPE, (np.dtype(lanes.result), (elements,))],
                     "offsets": [0, HEADER_SIZE], "itemsize": HEADER_SIZE + 4 * elements})


def grow_buffers(sock: socket.socket, size: int = SOCKET_BUFFER) -> None:
    """Receive and send buffers of ``size`` bytes: forced where allowed, else what the system's
    maximum allows (the daemon's user-space path uses it too)."""
    for opt, force in ((socket.SO_RCVBUF, getattr(socket, "SO_RCVBUFFORCE", 33)),
                       (socket.SO_SNDBUF, getattr(socket, "SO_SNDBUFFORCE", 32))):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, size)  # needs CAP_NET_ADMIN
        except OSError:
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)  # capped by [rw]mem_max
            except OSError:
                pass


#: SO_ATTACH_FILTER, and classic BPF's offset of the network header (linux/filter.h).
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
SKF_NET_OFF = -0x100000


def accept_only_from(sock: socket.socket, source_ip: str) -> None:
    """Have the kernel drop every datagram to ``sock`` whose IPv4 source is not ``source_ip`` (a
    classic BPF socket filter: no cost on the receive path). A result group is only an address and
    port: another aggregator on the same network that gives one of its jobs the same group and
    result port (each daemon numbers its jobs from its own `group_base`, the same by default)
    reaches this socket too, with results of the same job id, and its sums would be taken for
    this job's. Every data plane answers from the address its workers send to."""
    ip = struct.unpack("!I", socket.inet_aton(source_ip))[0]

    def insn(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)

    prog = b"".join((insn(0x20, 0, 0, SKF_NET_OFF + 12),   # ld [network header + 12]: the source
                     insn(0x15, 0, 1, ip),                  # jeq #source_ip
                     insn(0x06, 0, 0, 0xFFFFFFFF),          # ret: the whole datagram
                     insn(0x06, 0, 0, 0)))                  # ret 0: dropped
    code = ctypes.create_string_buffer(prog, len(prog))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                    struct.pack("HP", len(prog) // 8, ctypes.addressof(code)))   # struct sock_fprog


class UdpTransport:
    """Sockets, sends and batched receives of ``AggClient`` (see the module's docstring)."""

    # -- set-up -------------------------------------------------------------------------------
    def _open_sockets(self, bind: tuple[str, int], group: tuple[str, int] | None) -> None:
        """Bind the member socket (``bind``) and join ``group``; the client is closed if that
        fails."""
        self._gso_segments = max(1, min(GSO_MAX_SEGMENTS, UDP_MAX_PAYLOAD // self._rec))
        self._run_sender = msend.RunSender(ADMIT_MAX, self._rec, self._server) if msend.AVAILABLE else None
        self._gso_cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("H", self._rec))]

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._group_sock: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        try:
            self._sock.bind((bind[0], int(bind[1])))
            accept_only_from(self._sock, self._server[0])
            grow_buffers(self._sock)
            host, port = self._sock.getsockname()[:2]
            if host == "0.0.0.0":
                host = _local_ip_towards(self._server)
            self._address = (host, port)
            self._selector.register(self._sock, selectors.EVENT_READ)
            if group is not None:
                self._group_sock = self._join(group)
                self._selector.register(self._group_sock, selectors.EVENT_READ)
        except BaseException:
            self.close()
            raise
        self._group = None if group is None else (group[0], int(group[1]))

    def _init_staging(self) -> None:
        """The receive staging array: a batch of messages lands in its records (``staging_dtype``),
        their sizes in ``_sizes``."""
        dtype = staging_dtype(self._elements, self._lanes)
        self._stage_rec = rec = dtype.itemsize
        stage = max(16, min(STAGE, STAGE_BYTES // rec))
        self._stage = np.zeros(stage, dtype)  # receive staging
        # written once now: the client's fixed buffers are resident from the start, so an
        # allreduce's memory is what it adds (its ring of packets), whatever it is the first of
        self._stage.view(np.uint8).fill(0)
        self._stage_u8 = self._stage.view(np.uint8).reshape(stage, rec)
        self._stage_pay = self._stage["payload"]  # the numba scatter's: values of the job's result type
        self._sizes = np.zeros(stage, np.int64)
        self._receiver = MultiReceiver(self._stage, rec, self._sizes)
        if self._gro_wanted:  # trains of results as one read where the interface coalesces them
            self._receiver.use_gro([self._sock] + ([self._group_sock] if self._group_sock is not None else []))

    def _close_sockets(self) -> None:
        """Release the sockets (``close`` does, after its last progress)."""
        try:
            self._selector.close()
        finally:
            self._sock.close()
            if self._group_sock is not None:
                self._group_sock.close()

    def _join(self, group: tuple[str, int]) -> socket.socket:
        ip = ipaddress.IPv4Address(group[0])
        if not ip.is_multicast:
            raise ValueError(f"group {group[0]} is not an IPv4 multicast address")
        local = _local_ip_towards(self._server)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            # bound to the group's address, not 0.0.0.0: two jobs' workers on one host share the
            # result port, and with both sockets on the wildcard address one of them got none of
            # its results in about half the runs (every chunk then came back by re-read)
            s.bind((str(ip), int(group[1])))
            mreq = struct.pack("4s4s", socket.inet_aton(str(ip)), socket.inet_aton(local))
            s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
            s.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
            accept_only_from(s, self._server[0])
            grow_buffers(s)
        except BaseException:
            s.close()
            raise
        return s

    # -- sending ------------------------------------------------------------------------------
    def _send(self, buf: memoryview, npk: int) -> None:
        """Send ``npk`` back-to-back packets held in ``buf``."""
        rec, i = self._rec, 0
        while i < npk:
            if self._gso and npk - i > 1:
                j = min(npk, i + self._gso_segments)
                try:
                    self._sock.sendmsg([buf[i * rec:j * rec]], self._gso_cmsg, 0, self._server)
                except OSError as e:
                    if e.errno in _GSO_REFUSED:
                        self._gso = False
                        self.stats["gso_fallbacks"] += 1
                        log.warning("UDP GSO refused by the kernel (%s); sending packets one by one",
                                    e)
                        continue  # the same packets again, plainly
                    self._send_failed(e)
                self.stats["packets_sent"] += j - i
                i = j
            elif self._run_sender is not None and npk - i > 1:
                # no GSO (XDP in generic mode): one sendmmsg for the rest of the run
                self._run_sender.send(self._sock, buf[i * rec:npk * rec], npk - i, self._send_failed)
                self.stats["packets_sent"] += npk - i
                i = npk
            else:
                try:
                    self._sock.sendto(buf[i * rec:(i + 1) * rec], self._server)
                except OSError as e:
                    self._send_failed(e)
                self.stats["packets_sent"] += 1
                i += 1

    def _send_failed(self, e: OSError) -> None:
        if e.errno not in _TRANSIENT:
            raise e
        self._last_send_error = e  # the packets are lost; loss recovery sends them again
        self.stats["send_errors"] += 1

    # -- receiving ----------------------------------------------------------------------------
    def _receive(self, timeout: float) -> int:
        """Receive and hand on one batch (at most the staging array) to ``_process``; how many
        messages."""
        m = 0
        if self._selector.select(timeout):
            m = self._drain(self._sock, m)
            if self._group_sock is not None:
                m = self._drain(self._group_sock, m)
        if m:
            self.stats["trains"] = self._receiver.trains
            self._process(m)
        return m

    def _drain(self, sock: socket.socket, m: int) -> int:
        """Receive into the staging array from position ``m`` until empty or full (one
        recvmmsg a batch: ``mrecv``); new ``m``."""
        return self._receiver.drain(sock, m)
