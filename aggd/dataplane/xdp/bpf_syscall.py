"""BPF_PROG_TEST_RUN through the raw bpf(2) syscall (ctypes), so the production XDP program can be
run on fixture packets and timed without any network link."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

_SYS_BPF = 321  # x86_64
_BPF_PROG_TEST_RUN = 10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _TestAttr(ctypes.Structure):
    # Layout of bpf_attr.test in include/uapi/linux/bpf.h.
    _fields_ = [
        ("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32),
        ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
        ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
        ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32),
        ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
        ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32),
    ]


XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)
VERDICT_NAMES = {XDP_ABORTED: "aborted", XDP_DROP: "drop", XDP_PASS: "pass", XDP_TX: "tx",
                 XDP_REDIRECT: "redirect"}


@dataclass
class TestRunResult:
    verdict: int
    packet: bytes      #: the packet after the program (as transmitted for XDP_TX)
    duration_ns: int   #: mean per repetition, as the kernel measured it

    @property
    def verdict_name(self) -> str:
        return VERDICT_NAMES.get(self.verdict, str(self.verdict))


def prog_test_run(prog_fd: int, packet: bytes, repeat: int = 1) -> TestRunResult:
    """Run an XDP program once (or ``repeat`` times) on ``packet``.

    The kernel reuses the same buffer across repeats, so a program that rewrites the packet sees
    its own output on later runs.
    """
    inbuf = ctypes.create_string_buffer(bytes(packet), len(packet))
    out_cap = len(packet) + 4096
    outbuf = ctypes.create_string_buffer(out_cap)
    attr = _TestAttr(prog_fd=prog_fd, data_size_in=len(packet), data_size_out=out_cap,
                     data_in=ctypes.addressof(inbuf), data_out=ctypes.addressof(outbuf),
                     repeat=max(1, repeat))
    rc = _libc.syscall(_SYS_BPF, _BPF_PROG_TEST_RUN, ctypes.byref(attr), ctypes.sizeof(attr))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"BPF_PROG_TEST_RUN failed: {os.strerror(err)}")
    return TestRunResult(attr.retval, outbuf.raw[:attr.data_size_out], attr.duration)
