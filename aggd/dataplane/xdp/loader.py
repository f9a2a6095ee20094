"""The XDP data plane: compile ``xdp/aggd_xdp.c`` with bcc, attach it, and manage its maps.

Map layouts come from bcc (ctypes types generated from ``xdp/aggd_maps.h``), so userspace holds no
hand-written copy of them. :data:`MAP_NAMES` is checked right after loading: a program built
without one of them fails at start-up, not at the first job.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import ipaddress
import json
import logging
import socket
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from aggd_client import protocol as proto

from aggd.core.model import check_awaited, check_tag
from aggd.core.strategy import SYNC, TableEntry, to_entry
from aggd.dataplane import DataPlane, DataPlaneError, JobStats, checked_job, rounds_by_member
from aggd.dataplane.xdp import bpf_syscall, program_cache

log = logging.getLogger(__name__)

XDP_DIR = Path(__file__).resolve().parents[3] / "xdp"
PROGRAM = XDP_DIR / "aggd_xdp.c"
FUNCTION = "aggd_xdp"
MAP_NAMES = ("jobs", "members", "slots", "stats", "clock", "member_stats", "self_addr", "upstreams")

# XDP attach flags (include/uapi/linux/if_link.h)
XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
MODES = {"native": XDP_FLAGS_DRV_MODE, "generic": XDP_FLAGS_SKB_MODE}

NO_JOB = proto.MAX_JOBS
LAYOUT_DIR = Path("/run/aggd")


class XdpError(DataPlaneError):
    pass


#: what each part of the pinned maps' layout record comes from
_LAYOUT_SOURCES = {"elements": "dataplane.elements_per_packet", "frags": "dataplane.elements_per_packet",
                   "total_slots": "dataplane.kernel_memory", "port": "dataplane.port",
                   "protocol_version": "the aggd version", "map_layout": "the aggd version"}


class PinnedLayoutError(XdpError):
    """The pinned maps were made with other settings: ``changed`` names them, with the pinned and the
    wanted value of each part of the layout."""

    def __init__(self, pin_dir, diff: dict):
        self.changed = sorted({_LAYOUT_SOURCES.get(k, k) for k in diff})
        parts = ", ".join(f"{k} {a} pinned, {b} now" for k, (a, b) in diff.items())
        super().__init__(f"the maps pinned in {pin_dir} were made with other settings ({parts}): "
                         f"{' and '.join(self.changed)} changed since")


def multicast_mac(group_ip: str) -> bytes:
    """01:00:5e plus the low 23 bits of the group address (RFC 1112)."""
    ip = int(ipaddress.IPv4Address(group_ip))
    return bytes([0x01, 0x00, 0x5E, (ip >> 16) & 0x7F, (ip >> 8) & 0xFF, ip & 0xFF])


def _be32_of(ip: str) -> int:
    # The map stores network-order bytes; ctypes writes the integer in host (little-endian) order.
    return int.from_bytes(ipaddress.IPv4Address(ip).packed, "little")


def _be16_of(port: int) -> int:
    return int.from_bytes(port.to_bytes(2, "big"), "little")


def _mac_of(text: str) -> bytes:
    """``aa:bb:..`` (a link's or a neighbour's address as the kernel gives it) as 6 bytes."""
    return bytes.fromhex(text.replace(":", ""))


#: where a message's ``code`` byte (its precision) is
_CODE_OFFSET = proto.HEADER_DTYPE.fields["code"][1]


class Serves(NamedTuple):
    """What the XDP program built for ``elements`` values a packet serves in the kernel (aggd_xdp.c:
    AGGD_RELAYS, AGGD_NARROW, AGGD_BOUNDS); the daemon gives other jobs no kernel slots."""
    relays: bool     #: a rack job's forwarding and relaying (not in a jumbo build)
    narrow: bool     #: int8 and int16 contributions (not in a jumbo build)
    bounds: bool     #: per-member bounds (not in a jumbo build)

    @classmethod
    def of(cls, elements: int) -> "Serves":
        native = elements <= proto.NATIVE_MAX_ELEMENTS
        return cls(native, native, native)


def layout_file(pin_dir: Path) -> Path:
    # bpffs holds only BPF objects; /run is as volatile as bpffs, so the two stay in step.
    return LAYOUT_DIR / (str(pin_dir).strip("/").replace("/", "_") + ".layout.json")


def remove_pinned(pin_dir: str | Path) -> None:
    """Remove maps pinned in ``pin_dir`` and their layout record: the next load starts empty."""
    pin_dir = Path(pin_dir)
    if pin_dir.exists():
        for f in pin_dir.iterdir():
            f.unlink()
        pin_dir.rmdir()
    layout_file(pin_dir).unlink(missing_ok=True)


def bank_sums(bank, precision: int = proto.Precision.INT32) -> np.ndarray:
    """A bank's exact sums (int64): its biased u64 lanes (xdp/aggd_maps.h, struct bank), or a narrow
    job's packed lanes, their fields kept biased by ``bias`` (xdp/aggd_lanes.h, "Packed lanes"): an
    8-bit job's four 16-bit fields a lane (exact up to INT8_MAX_CONTRIBUTIONS contributions), 2E values
    for E lanes; a 16-bit job's two 32-bit fields, E values."""
    lanes = np.ctypeslib.as_array(bank.values)
    if precision == proto.Precision.INT32:
        return (lanes + np.uint64(bank.bias)).view(np.int64)
    field, value, per_lane = ((np.uint16, np.int16, 2) if precision == proto.Precision.INT8
                              else (np.uint32, np.int32, 1))
    fields = lanes[:(len(lanes) + 1) // 2].view(field)                  # little-endian fields
    bias = np.array([bank.bias], np.uint64).view(field)
    return (fields.reshape(-1, len(bias)) - bias).view(value).reshape(-1)[:per_lane * len(lanes)].astype(np.int64)


def load_xdp_function(bpf, name: str, *, frags: bool = False):
    """bcc's ``load_func(name, BPF.XDP)``, or with ``frags`` the same instructions loaded with
    BPF_F_XDP_HAS_FRAGS (bcc 0.26 passes no program flags), wrapped as bcc's function object so
    ``BPF.attach_xdp`` and ``bpf.cleanup`` treat it as their own."""
    from bcc import BPF
    if not frags:
        return bpf.load_func(name.encode(), BPF.XDP)
    insns = program_cache.function_insns(bpf, name)
    if insns is None:
        raise XdpError(f"no function {name} in the program")
    return load_xdp_insns(bpf, name, insns, program_cache.license_of(bpf), frags=True)


def load_xdp_insns(bpf, name: str, insns: bytes, license: bytes, *, frags: bool):
    """Instructions with their map fds in place loaded as XDP program ``name`` (with
    BPF_F_XDP_HAS_FRAGS for ``frags``), wrapped as a function object of bcc's ``bpf``."""
    from bcc import BPF
    fd = bpf_syscall.prog_load(insns, flags=bpf_syscall.BPF_F_XDP_HAS_FRAGS if frags else 0, name=name,
                               license=license)
    fn = BPF.Function(bpf, name.encode(), fd)
    bpf.funcs[name.encode()] = fn
    return fn


class SlotAllocator:
    """First-fit allocation of contiguous slot ranges in the kernel's slot array."""

    def __init__(self, total: int):
        self.total = total
        self._used: dict[int, tuple[int, int]] = {}  # job -> (base, count)

    def allocate(self, job: int, count: int) -> int:
        self.free(job)
        base = 0
        for b, n in sorted(self._used.values()):
            if b - base >= count:
                break
            base = max(base, b + n)
        if base + count > self.total:
            raise XdpError(f"job {job}: {count} kernel slots do not fit "
                           f"({self.free_slots()} of {self.total} free)")
        self._used[job] = (base, count)
        return base

    def free(self, job: int) -> tuple[int, int] | None:
        return self._used.pop(job, None)

    def free_slots(self) -> int:
        return self.total - sum(n for _, n in self._used.values())


class XdpDataPlane(DataPlane):
    """Compiles, loads and (optionally) attaches the aggregator program.

    ``ifname=None`` loads without attaching: the program can then only be run through
    BPF_PROG_TEST_RUN (tests, ``aggctl bench xdp``).
    """

    def __init__(self, ifname: str | None = None, *, mode: str = "native", port: int = proto.DEFAULT_PORT,
                 elements: int = proto.DEFAULT_ELEMENTS, total_slots: int = 4096, netns: str | None = None,
                 pin_dir: str | None = None, frags: bool | None = None):
        if mode not in MODES:
            raise XdpError(f"mode must be one of {sorted(MODES)}, not {mode!r}")
        if not 1 <= elements <= proto.MAX_ELEMENTS:
            raise XdpError(f"elements per packet must be 1..{proto.MAX_ELEMENTS}, not {elements}")
        if ifname is not None and mode == "native" and elements > proto.NATIVE_MAX_ELEMENTS:
            # a larger frame does not fit native XDP's largest MTU (docs/protocol.md, Payload)
            raise XdpError(f"native XDP takes at most {proto.NATIVE_MAX_ELEMENTS} elements a packet "
                           f"(MTU {proto.NATIVE_MAX_MTU}), not {elements}: use mode generic for larger packets")
        if total_slots < 1:
            raise XdpError("total_slots must be at least 1")

        self.ifname, self.mode, self.port, self.elements = ifname, mode, port, elements
        # A native frame larger than a page arrives in several buffers (XDP multi-buffer).
        self.frags = (mode == "native" and elements > proto.PAGE_MAX_ELEMENTS) if frags is None else frags
        serves = Serves.of(elements)
        self.relays, self.narrow = serves.relays, serves.narrow
        self.netns = netns  # attach inside this network namespace (the lab's aggregator)
        self.total_slots = total_slots
        self.allocator = SlotAllocator(total_slots)
        self._attached = False
        self._prog_id: int | None = None   # our program's id on the link, read once attached
        self._own_mac: bytes | None = None
        cflags = [f"-I{XDP_DIR}", f"-DELEMS={elements}", f"-DTOTAL_SLOTS={total_slots}",
                  f"-DAGGD_PORT={port}", "-Wno-unused-function", "-Wno-compare-distinct-pointer-types"]
        if self.frags:
            cflags.append("-DAGGD_FRAGS")
        self.pin_dir = Path(pin_dir) if pin_dir else None
        #: this load pins the maps afresh (none were there): a start that then fails removes them
        self.pins_made = self.pin_dir is not None and not (self.pin_dir.is_dir() and any(self.pin_dir.iterdir()))
        if self.pin_dir is not None:
            self._check_pinned_layout()
            cflags.append(f'-DAGGD_PIN_DIR="{self.pin_dir}"')
        try:
            self.bpf, self.fn = self._load(cflags)
        except Exception as exc:
            raise XdpError(f"cannot load {PROGRAM}: {exc}") from exc
        self._check_maps()
        if self.pin_dir is not None:
            self._recover_allocations()
            self._layout_file.write_text(json.dumps(self._layout()))
        if ifname is not None:
            try:
                self.attach()
            except XdpError:
                if self.pins_made:      # nothing a later start needs: leave no kernel memory pinned
                    self.unpin()
                raise

    # -- the program: compiled, or its instructions from the cache ----------------------------
    def _load(self, cflags: list[str]):
        """bcc's module (the maps) and the loaded function. ``self.compiled`` says whether the
        program was compiled (False: its instructions came from ``program_cache``), ``self.insns``
        what was loaded (map fds in place)."""
        from bcc import BPF  # imported here so the rest of aggd works where bcc is absent
        build = "elements=%d, slots=%d, port=%d%s" % (self.elements, self.total_slots, self.port,
                                                      ", multi-buffer" if self.frags else "")
        cache = program_cache.ProgramCache.configured()
        key = program_cache.program_key(XDP_DIR, cflags)
        entry = cache.get(key)
        if entry is not None:
            bpf = BPF(src_file=str(PROGRAM).encode(), cflags=cflags + [program_cache.MAPS_ONLY])
            try:
                fds = program_cache.table_fds(bpf)
                missing = sorted(set(entry["maps"]) - set(fds))
                if missing:
                    raise XdpError(f"the maps build lacks {missing}")
                insns = program_cache.with_map_fds(entry["insns"], entry["loads"], fds)
                fn = load_xdp_insns(bpf, FUNCTION, insns, entry["license"], frags=self.frags)
                self.insns = insns
            except (OSError, XdpError) as exc:
                log.warning("the cached %s (%s) does not load, compiling it: %s", PROGRAM.name, build, exc)
                bpf.cleanup()
                cache.drop(key)
            else:
                log.info("loaded %s (%s) compiled before", PROGRAM.name, build)
                self.compiled = False
                return bpf, fn
        log.info("compiling %s (%s)", PROGRAM.name, build)
        bpf = BPF(src_file=str(PROGRAM).encode(), cflags=cflags)
        fn = load_xdp_function(bpf, FUNCTION, frags=self.frags)
        self.compiled = True
        insns = self.insns = program_cache.function_insns(bpf, FUNCTION)
        loads = program_cache.map_loads(insns, {fd: name for name, fd in program_cache.table_fds(bpf).items()})
        if loads is not None:
            cache.put(key, insns, loads, program_cache.license_of(bpf))
        return bpf, fn

    # -- pinned maps (state that survives a restart) ------------------------------------------
    @property
    def _layout_file(self) -> Path:
        return layout_file(self.pin_dir)

    def _layout(self) -> dict:
        # the map layouts themselves: any change to the headers that define them changes this
        digest = hashlib.sha256(b"".join((XDP_DIR / f).read_bytes() for f in ("aggd_maps.h", "aggd_proto.h")))
        return {"elements": self.elements, "frags": self.frags, "total_slots": self.total_slots, "port": self.port,
                "protocol_version": proto.VERSION, "map_layout": digest.hexdigest()[:16]}

    def _check_pinned_layout(self) -> None:
        self.pin_dir.mkdir(parents=True, exist_ok=True)
        LAYOUT_DIR.mkdir(parents=True, exist_ok=True)
        if self._layout_file.exists():
            pinned = json.loads(self._layout_file.read_text())
            if pinned != self._layout():
                diff = {k: (pinned.get(k), v) for k, v in self._layout().items() if pinned.get(k) != v}
                raise PinnedLayoutError(self.pin_dir, diff)

    def _recover_allocations(self) -> None:
        for job in self.active_jobs():
            j = self.jobs[ctypes.c_uint32(job)]
            if j.kernel_slots:
                self.allocator._used[job] = (int(j.slot_base), int(j.kernel_slots))

    def active_jobs(self) -> list[int]:
        return [int(k.value) for k, v in self.jobs.items() if v.active]

    def unpin(self) -> None:
        """Remove the pinned maps: the next load starts empty."""
        if self.pin_dir is not None:
            remove_pinned(self.pin_dir)

    # -- lifecycle -------------------------------------------------------------------------
    def _check_maps(self) -> None:
        missing = []
        for name in MAP_NAMES:
            try:
                self.bpf.get_table(name.encode())
            except KeyError:
                missing.append(name)
        if missing:
            raise XdpError(f"XDP program lacks maps {missing}")
        self.jobs = self.bpf[b"jobs"]
        self.members = self.bpf[b"members"]
        self.slots = self.bpf[b"slots"]
        self.stats = self.bpf[b"stats"]
        self.clock = self.bpf[b"clock"]
        self.self_addr = self.bpf[b"self_addr"]
        self.upstreams = self.bpf[b"upstreams"]
        self._member_stats_map = self.bpf[b"member_stats"]

    @property
    def prog_fd(self) -> int:
        return self.fn.fd

    def _in_netns(self):
        if self.netns is None:
            return contextlib.nullcontext()
        from aggd.dataplane.netns import in_netns
        return in_netns(self.netns)

    def attach(self) -> None:
        from bcc import BPF
        try:
            with self._in_netns():
                BPF.attach_xdp(self.ifname.encode(), self.fn, MODES[self.mode])
        except Exception as exc:
            raise XdpError(f"cannot attach XDP ({self.mode}) to {self.ifname}: {exc}{self._attach_hint()}") from exc
        self.set_own_mac(self._interface_mac())
        self._attached = True
        self._prog_id = self._link_prog_id()
        log.info("attached %s to %s in %s mode", FUNCTION, self.ifname, self.mode)

    def _link_prog_id(self) -> int | None:
        """The id of the XDP program on the interface now (None: none, or no such interface)."""
        from pyroute2 import IPRoute
        try:
            with self._in_netns(), IPRoute() as ipr:
                links = ipr.get_links(ifname=self.ifname)
        except OSError:   # the namespace is gone
            return None
        xdp = links[0].get_attr("IFLA_XDP") if links else None
        return None if xdp is None else xdp.get_attr("IFLA_XDP_PROG_ID")

    def _attach_hint(self) -> str:
        """Why native attach fails on a link whose MTU a one-page program cannot take (the kernel
        says only ERANGE), and the settings that fix it; "" otherwise."""
        if self.mode != "native" or self.frags:
            return ""
        try:
            mtu = self._link().get_attr("IFLA_MTU")
        except (OSError, XdpError):
            return ""
        if mtu <= proto.PAGE_MAX_MTU:
            return ""
        return (f" ({self.ifname}'s MTU {mtu} is above what a program of {self.elements} values a packet, "
                f"built for one page a frame, takes natively (on veth {proto.PAGE_MAX_MTU}): set "
                f"dataplane.elements_per_packet above {proto.PAGE_MAX_ELEMENTS} (multi-buffer frames, up to "
                f"{proto.NATIVE_MAX_ELEMENTS} at MTU {proto.NATIVE_MAX_MTU}), lower the link's MTU, or set "
                f'dataplane.mode = "generic")')

    def _link(self):
        """The interface's link message (pyroute2), read in its namespace."""
        from pyroute2 import IPRoute
        with IPRoute(netns=self.netns, flags=0) if self.netns else IPRoute() as ipr:
            links = ipr.get_links(ifname=self.ifname)
        if not links:
            raise XdpError(f"no interface {self.ifname}")
        return links[0]

    def _interface_mac(self) -> bytes:
        return _mac_of(self._link().get_attr("IFLA_ADDRESS"))

    def set_own_mac(self, mac: bytes | None) -> None:
        """The MAC unicast frames must be sent to for the program to take them (None: any; the
        attached program's interface's own, set by ``attach``)."""
        self._own_mac = mac
        leaf = self.self_addr.Leaf()
        if mac is not None:
            for i, b in enumerate(mac):
                leaf.mac[i] = b
            leaf.set = 1
        self.self_addr[ctypes.c_uint32(0)] = leaf

    def rerun(self, data: bytes, src: tuple[str, int]):
        """Run the program on one aggd message from ``src`` the attached program passed up because
        its frame had no room to grow (a narrow job's result is wider than its contribution: on
        native veth a small frame can be a short buffer). BPF_PROG_TEST_RUN hands the program a
        page, so it decides with the same slots and maps as for any packet; the answer is the
        ``Verdict`` it came to (its message, and where the frame was addressed), sent by the daemon.
        A narrow contribution without room for its result gets it here (docs/protocol.md,
        "Precision": a multi-buffer build takes no other). The packet's receive counters are counted
        a second time."""
        from aggd.core.model import Verdict

        data = bytes(data) + bytes(self._room_for(data))
        udp_len = 8 + len(data)
        ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0, 64, 17, 0,
                                   socket.inet_aton(src[0]), socket.inet_aton("0.0.0.0")))
        frame = (self._own_mac or bytes(6)) + bytes(6) + b"\x08\x00" + bytes(ip) + \
            struct.pack("!HHHH", src[1], self.port, udp_len, 0) + bytes(data)
        res = bpf_syscall.prog_test_run(self.prog_fd, frame)
        if res.verdict != bpf_syscall.XDP_TX:
            return Verdict("drop")
        out = res.packet
        out_len = struct.unpack_from("!H", out, 38)[0] - 8
        dest = (socket.inet_ntoa(out[30:34]), struct.unpack_from("!H", out, 36)[0])
        to_group = ipaddress.IPv4Address(dest[0]).is_multicast
        return Verdict("tx", None, bytes(out[42:42 + out_len]), "group" if to_group else "sender", (dest,))

    def _room_for(self, data: bytes) -> int:
        """Bytes of room a narrow contribution or re-read of exactly a packet of values
        (``values_per_packet``: ``elements``, an 8-bit job's twice that) lacks."""
        if len(data) < proto.HEADER_SIZE:
            return 0
        code = data[_CODE_OFFSET]
        lanes = proto.LANES.get(code)
        if lanes is None:
            return 0
        values = proto.values_per_packet(self.elements, code)
        if len(data) - proto.HEADER_SIZE != values * lanes.contrib_bytes:
            return 0
        return values * (lanes.result_bytes - lanes.contrib_bytes)

    def detach(self) -> None:
        if self._attached:
            from bcc import BPF
            self._attached = False
            try:
                with self._in_netns():
                    BPF.remove_xdp(self.ifname.encode(), MODES[self.mode])
            except FileNotFoundError:
                # the namespace is gone, and its interfaces with their programs
                log.warning("network namespace %s is gone: nothing to detach from %s", self.netns, self.ifname)
                return
            log.info("detached from %s", self.ifname)

    def close(self) -> None:
        try:
            self.detach()
        finally:
            if getattr(self, "bpf", None) is not None:
                self.bpf.cleanup()
                self.bpf = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- jobs ------------------------------------------------------------------------------
    def install_job(self, cfg) -> None:
        """Install a job from a config object with ``job, world, slots, max_chunks, members,
        group`` (and optionally ``kernel_slots``)."""
        job, world, kernel_slots = checked_job(cfg, XdpError,
                                               "the XDP data plane needs a multicast group for results")
        self.remove_job(job)
        base = self.allocator.allocate(job, kernel_slots) if kernel_slots else 0
        self._clear_slots(base, kernel_slots)
        tags = getattr(cfg, "tags", None) or {}
        for rank in range(proto.MAX_MEMBERS):
            self.set_member(job, rank, cfg.members.get(rank), tags.get(rank, 0))
        j = self.jobs.Leaf()
        j.world = world
        j.precision = int(getattr(cfg, "precision", 0))
        bound = getattr(cfg, "bound", None)
        if bound is not None:
            j.bound_mant, j.bound_exp, j.bounded = int(bound.mant), int(bound.exp), 1
        norm = getattr(cfg, "norm_bound", None)
        if norm is not None:
            j.norm_mant, j.norm_exp, j.norm_bounded = int(norm.mant), int(norm.exp), 1
        j.slot_base = base
        j.n_slots = int(cfg.slots)
        j.kernel_slots = kernel_slots
        j.max_chunks = int(cfg.max_chunks)
        group_ip, group_port = cfg.group
        j.group_ip = _be32_of(group_ip)
        j.result_port = _be16_of(int(group_port))
        ctypes.memmove(ctypes.addressof(j) + type(j).group_mac.offset, multicast_mac(group_ip), 6)
        j.all_members = (1 << world) - 1
        j.upstream = 1 if getattr(cfg, "upstream", None) is not None else 0   # linked by set_upstream
        self._write_ring(j, [to_entry(getattr(cfg, "strategy", None) or SYNC, 0, 0)])
        j.active = 1
        self.jobs[ctypes.c_uint32(job)] = j
        self._reset_stats(job)
        zero = self._member_stats_map.Leaf(*([self._member_stats_map.sLeaf()] * self._member_stats_map.total_cpu))
        for rank in range(proto.MAX_MEMBERS):
            self._member_stats_map[ctypes.c_uint32(job * proto.MAX_MEMBERS + rank)] = zero
        log.info("installed job %d: world %d, %d slots (%d in kernel at %d)", job, world, cfg.slots,
                 kernel_slots, base)

    @staticmethod
    def _write_ring(j, entries) -> None:
        """Entry of version v lives at index v % ring size, so installing a version rewrites only
        its own entry and the data plane never sees the others move."""
        keep = {e.version % proto.STRATEGY_VERSIONS: e for e in entries}
        for i in range(proto.STRATEGY_VERSIONS):
            dst = j.strategy[i]
            e = keep.get(i)
            if e is None:
                dst.valid = 0
                continue
            dst.from_round, dst.version, dst.kind = e.from_round, e.version, e.kind
            dst.param, dst.timeout_us, dst.valid = e.param, e.timeout_us, 1

    def set_awaited(self, job: int, awaited: int) -> None:
        """The members a round of ``job`` waits for (the program's ``all_members``)."""
        key = ctypes.c_uint32(job)
        j = self.jobs[key]
        if not j.active:
            raise XdpError(f"job {job} is not installed")
        try:
            j.all_members = check_awaited(awaited, int(j.world))
        except ValueError as exc:
            raise XdpError(f"job {job}: {exc}") from None
        self.jobs[key] = j

    def set_upstream(self, job: int, upstream, via: tuple[str, bytes, bytes] | None = None) -> None:
        """A rack job's link (aggd.core.model.Upstream): its complete rounds go from this interface
        to the upper aggregator, whose results the program relays to the job's group. ``via``:
        (this host's address, its MAC, the next hop's MAC), found from the routing and neighbour
        tables when not given. XdpError if the upper aggregator is not reached through this
        interface, or its next hop is not known yet."""
        key = ctypes.c_uint32(job)
        j = self.jobs[key]
        if not j.active:
            raise XdpError(f"job {job} is not installed")
        self._unroute(j)
        if not self.relays and j.kernel_slots:
            raise XdpError(f"job {job}: a program built for {self.elements}-value packets does not serve a "
                           f"rack job's kernel slots (at most {proto.NATIVE_MAX_ELEMENTS})")
        if upstream is None or not upstream.linked:
            j.upstream = 1 if upstream is not None else 0
            self.jobs[key] = j
            return
        ip, port = upstream.addr
        self_ip, self_mac, hop_mac = via if via is not None else self._route_to(ip)
        j.up_job, j.up_rank, j.up_tag = int(upstream.job), int(upstream.rank), check_tag(upstream.tag)
        j.up_ip, j.up_port, j.self_ip = _be32_of(ip), _be16_of(int(port)), _be32_of(self_ip)
        for field, mac in (("up_mac", hop_mac), ("self_mac", self_mac)):
            ctypes.memmove(ctypes.addressof(j) + getattr(type(j), field).offset, bytes(mac), 6)
        j.upstream = 2
        self.jobs[key] = j
        self.upstreams[self._upstream_key(j)] = ctypes.c_uint32(job)

    def _upstream_key(self, j):
        """The ``upstreams`` key of a linked job's upper results: its upper aggregator and job."""
        k = self.upstreams.Key()
        k.ip, k.port, k.job = j.up_ip, j.up_port, j.up_job
        return k

    def _unroute(self, j) -> None:
        """Forget the upper results route of job entry ``j``, if it has one."""
        if j.upstream == 2:
            try:
                del self.upstreams[self._upstream_key(j)]
            except KeyError:
                pass

    def _route_to(self, ip: str) -> tuple[str, bytes, bytes]:
        """(this interface's address, its MAC, the next hop's MAC) towards ``ip``."""
        from pyroute2 import IPRoute
        with IPRoute(netns=self.netns, flags=0) if self.netns else IPRoute() as ipr:
            link = ipr.get_links(ifname=self.ifname)[0]
            try:
                route = ipr.route("get", dst=ip)[0]
            except Exception as exc:
                raise XdpError(f"no route to the upper aggregator {ip}: {exc}") from None
            if route.get_attr("RTA_OIF") != link["index"]:
                raise XdpError(f"the upper aggregator {ip} is reached through another interface than "
                               f"{self.ifname}, where the XDP program is")
            hop = route.get_attr("RTA_GATEWAY") or ip
            source = route.get_attr("RTA_PREFSRC")
            neighbours = [n for n in ipr.get_neighbours(ifindex=link["index"]) if n.get_attr("NDA_DST") == hop
                          and n.get_attr("NDA_LLADDR")]
        if not neighbours or not source:
            raise XdpError(f"the next hop to the upper aggregator {ip} ({hop}) is not known yet")
        return source, _mac_of(link.get_attr("IFLA_ADDRESS")), _mac_of(neighbours[0].get_attr("NDA_LLADDR"))

    def set_member(self, job: int, rank: int, addr: tuple[str, int] | None, tag: int = 0) -> None:
        """Register (None: clear) the member address and tag of ``rank``: from then on the program
        accepts that rank's packets only from ``addr`` and carrying ``tag``."""
        m = self.members.Leaf()
        if addr is not None:
            m.ip, m.port, m.valid = _be32_of(addr[0]), _be16_of(int(addr[1])), 1
            m.tag = check_tag(tag)
        self.members[ctypes.c_uint32(job * proto.MAX_MEMBERS + rank)] = m

    def allocation(self, job: int) -> tuple[int, int]:
        """(first slot in the kernel's array, kernel slots) of an installed job."""
        j = self.jobs[ctypes.c_uint32(job)]
        return (int(j.slot_base), int(j.kernel_slots)) if j.active else (0, 0)

    def installed(self, job: int) -> tuple[int, int, int, int] | None:
        j = self.jobs[ctypes.c_uint32(job)]
        return (int(j.world), int(j.n_slots), int(j.slot_base), int(j.kernel_slots)) if j.active else None

    def job_rounds(self, job: int) -> tuple[int | None, dict[int, int]]:
        """(highest round any kernel slot of ``job`` has seen, {rank: highest round it contributed
        to}), read from the slots' bank keys and bitmaps: one map lookup per kernel slot."""
        base, count = self.allocation(job)
        return rounds_by_member((int(bank.key) >> 32, int(bank.bitmap))
                                for i in range(base, base + count)
                                for bank in self.slots[ctypes.c_uint32(i)].bank
                                if bank.state != 0)  # BANK_EMPTY

    def open_rounds(self, job: int) -> list[tuple[int, int, int]]:
        base, count = self.allocation(job)
        return [(int(b.key) >> 32, int(b.bitmap), int(b.t_first))
                for i in range(base, base + count) for b in self.slots[ctypes.c_uint32(i)].bank
                if b.state == 1 and not b.holding and b.kind != proto.StrategyKind.QUORUM]  # BANK_OPEN

    def open_slots(self, job: int) -> int:
        base, count = self.allocation(job)
        return sum(any(b.state == 1 for b in self.slots[ctypes.c_uint32(i)].bank)  # BANK_OPEN
                   for i in range(base, base + count))

    @property
    def attached(self) -> bool:
        """Whether our program is on the interface: read from the link, so that one detached or
        replaced behind our back (``ip link set dev X xdp off``, another program) shows."""
        return self._attached and self._link_prog_id() == self._prog_id

    def describe(self) -> dict:
        return {"slot_bytes": ctypes.sizeof(self.slots.Leaf), "array_slots": self.total_slots}

    def stop(self, unpin: bool = False) -> None:
        try:
            self.close()
        finally:
            if unpin:
                log.info("removing pinned maps in %s", self.pin_dir)
                self.unpin()

    def set_strategy(self, job: int, entries) -> None:
        """Install a job's strategy table (``aggd.core.strategy.TableEntry`` rows, newest last)."""
        key = ctypes.c_uint32(job)
        j = self.jobs[key]
        if not j.active:
            raise XdpError(f"job {job} is not installed")
        self._write_ring(j, entries[-proto.STRATEGY_VERSIONS:])
        self.jobs[key] = j

    def strategy_entries(self, job: int) -> list:
        j = self.jobs[ctypes.c_uint32(job)]
        rows = [TableEntry(int(e.version), int(e.from_round), int(e.kind), int(e.param), int(e.timeout_us))
                for e in j.strategy if e.valid]
        return sorted(rows, key=lambda e: e.version)

    def member_stats(self, job: int, world: int) -> list[dict]:
        """Per rank: contributions, summed lag (ns), late contributions, last round and time."""
        rows = []
        for rank in range(world):
            per_cpu = self._member_stats_map[ctypes.c_uint32(job * proto.MAX_MEMBERS + rank)]
            top = max(int(c.last_round) for c in per_cpu)
            rows.append({"rank": rank, "contributions": sum(int(c.contributions) for c in per_cpu),
                         "lag_ns_sum": sum(int(c.lag_ns_sum) for c in per_cpu),
                         "late": sum(int(c.late) for c in per_cpu),
                         "offences": sum(int(c.offences) for c in per_cpu),
                         "last_round": top - 1 if top else None,
                         "last_ns": max(int(c.last_ns) for c in per_cpu)})
        return rows

    def pending_sum(self, job: int) -> float:
        """Sum of every value still held in the job's open (unreleased) banks, dequantised: what a
        conservation check adds to the released sums."""
        j = self.jobs[ctypes.c_uint32(job)]
        total = 0.0
        for i in range(int(j.slot_base), int(j.slot_base) + int(j.kernel_slots)):
            for bank in self.slots[ctypes.c_uint32(i)].bank:
                if bank.state == 1:  # BANK_OPEN
                    values = bank_sums(bank, int(j.precision)).astype(np.float64)
                    total += float(np.ldexp(values, -int(bank.exponent)).sum())
        return total

    def max_round(self, job: int) -> int | None:
        """The highest round any member of ``job`` has sent to the kernel, or None."""
        top = max(int(cpu.max_round) for cpu in self.stats[ctypes.c_uint32(job)])
        return top - 1 if top else None

    def set_clock(self, ns: int) -> None:
        """Freeze the data plane's clock at ``ns`` (tests); 0 returns to real time."""
        self.clock[ctypes.c_uint32(0)] = ctypes.c_uint64(ns)

    def remove_job(self, job: int) -> None:
        self._unroute(self.jobs[ctypes.c_uint32(job)])
        self.jobs[ctypes.c_uint32(job)] = self.jobs.Leaf()
        empty = self.members.Leaf()
        for rank in range(proto.MAX_MEMBERS):
            self.members[ctypes.c_uint32(job * proto.MAX_MEMBERS + rank)] = empty
        freed = self.allocator.free(job)
        if freed:
            self._clear_slots(*freed)

    def clear_rounds(self, job: int) -> None:
        self._clear_slots(*self.allocation(job))

    def _clear_slots(self, base: int, count: int) -> None:
        empty = self.slots.Leaf()
        for i in range(base, base + count):
            self.slots[ctypes.c_uint32(i)] = empty

    def _reset_stats(self, bucket: int) -> None:
        self.stats[ctypes.c_uint32(bucket)] = self.stats.Leaf(*([self.stats.sLeaf()] * self.stats.total_cpu))

    # -- counters --------------------------------------------------------------------------
    def job_stats(self, job: int | None) -> JobStats:
        bucket = NO_JOB if job is None else job
        per_cpu = self.stats[ctypes.c_uint32(bucket)]
        counters = {c.name.lower(): sum(int(cpu.counter[c]) for cpu in per_cpu) for c in proto.Counter}
        drops = {r.name.lower(): sum(int(cpu.drop[r]) for cpu in per_cpu) for r in proto.DropReason}
        return JobStats(counters, drops)

    def slot_bank(self, job_base_slot: int):
        """Raw slot (for tests and debugging)."""
        return self.slots[ctypes.c_uint32(job_base_slot)]
