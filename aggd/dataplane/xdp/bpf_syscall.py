"""The two bpf(2) commands bcc does not offer, through the raw syscall (ctypes): BPF_PROG_LOAD with
program flags (bcc 0.26 passes none, and XDP multi-buffer needs BPF_F_XDP_HAS_FRAGS) or with the
verifier's statistics, and BPF_PROG_TEST_RUN, so the production XDP program can be run on fixture
packets and timed without any network link."""
from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

_SYS_BPF = 321  # x86_64
_BPF_PROG_LOAD = 5
_BPF_PROG_TEST_RUN = 10
BPF_PROG_TYPE_XDP = 6
BPF_F_XDP_HAS_FRAGS = 1 << 5

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


class _ProgLoadAttr(ctypes.Structure):
    # The leading fields of bpf_attr's BPF_PROG_LOAD member (include/uapi/linux/bpf.h); the kernel
    # takes a shorter attr as zeros for the rest.
    _fields_ = [
        ("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64), ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32), ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16), ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
    ]


def _load(insns: bytes, prog_type: int, flags: int, name: str, license: bytes, log_level: int = 0,
          log_buf=None) -> int:
    """One BPF_PROG_LOAD: the program fd, or -1 with errno set; ``log_buf`` takes the verifier's log
    at ``log_level``."""
    code = ctypes.create_string_buffer(bytes(insns), len(insns))
    lic = ctypes.create_string_buffer(license)
    attr = _ProgLoadAttr(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ctypes.addressof(code),
                         license=ctypes.addressof(lic), prog_flags=flags, prog_name=name.encode()[:15])
    if log_buf is not None:
        attr.log_level, attr.log_size, attr.log_buf = log_level, len(log_buf), ctypes.addressof(log_buf)
    return _libc.syscall(_SYS_BPF, _BPF_PROG_LOAD, ctypes.byref(attr), ctypes.sizeof(attr))


def prog_load(insns: bytes, *, prog_type: int = BPF_PROG_TYPE_XDP, flags: int = 0, name: str = "",
              license: bytes = b"GPL") -> int:
    """Load already-relocated BPF instructions (bcc's, map fds in place); returns the program fd.
    On a verifier refusal the error carries the end of the verifier's log."""
    fd = _load(insns, prog_type, flags, name, license)
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    log = ctypes.create_string_buffer(1 << 24)
    fd = _load(insns, prog_type, flags, name, license, 1, log)  # again, for the verifier's reasons
    if fd >= 0:
        return int(fd)
    tail = log.value.decode(errors="replace").strip().splitlines()[-12:]
    raise OSError(err, f"BPF_PROG_LOAD failed: {os.strerror(err)}\n" + "\n".join(tail))


def verified_insns(insns: bytes, *, prog_type: int = BPF_PROG_TYPE_XDP, flags: int = 0,
                   license: bytes = b"GPL") -> int:
    """How many instructions the verifier walks to accept ``insns`` (its budget is a million): a load
    with the verifier's statistics (log level 4), the program closed at once."""
    log = ctypes.create_string_buffer(1 << 16)
    fd = _load(insns, prog_type, flags, "", license, 4, log)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"BPF_PROG_LOAD failed: {os.strerror(err)}")
    os.close(fd)
    found = re.search(r"processed (\d+) insns", log.value.decode(errors="replace"))
    if found is None:
        raise OSError(0, "the verifier's statistics are missing from its log")
    return int(found.group(1))


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
