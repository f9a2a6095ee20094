"""XDP data-plane operations the daemon needs that ``XdpDataPlane`` does not offer (yet).

Each function uses the data plane's own method when it has one and otherwise works on its maps
directly, through the ctypes layouts bcc generates (no hand-written copy of a layout). They are
stopgaps: the requests to add them to ``aggd/dataplane/xdp.py`` are in the service issue's report,
and once a method exists there, the ``hasattr`` branch takes it and the map code here is dead.
"""
from __future__ import annotations

import ctypes
import types

from aggd_client import protocol as proto


def install_job(dp, cfg, kernel_slots: int) -> tuple[int, int]:
    """Install a job with ``kernel_slots`` of its slots in the kernel; return (base, count).

    ``XdpDataPlane.install_job`` reads ``kernel_slots=0`` as "all slots" (``kernel_slots or slots``),
    so a job served wholly in user space is written here: its config (kernel_slots 0, so the
    program passes every contribution up) and its members, with no kernel slot allocated."""
    if kernel_slots > 0:
        dp.install_job(types.SimpleNamespace(**{**vars(cfg), "kernel_slots": kernel_slots}))
        return allocation(dp, cfg.job)
    from aggd.dataplane.xdp import _be16_of, _be32_of, multicast_mac  # noqa: PLC0415 (bcc-free import)

    dp.remove_job(cfg.job)
    for rank in range(proto.MAX_MEMBERS):
        set_member(dp, cfg.job, rank, cfg.members.get(rank))
    j = dp.jobs.Leaf()
    j.world = int(cfg.world)
    j.slot_base = 0
    j.n_slots = int(cfg.slots)
    j.kernel_slots = 0
    j.max_chunks = int(cfg.max_chunks)
    group_ip, group_port = cfg.group
    j.group_ip = _be32_of(group_ip)
    j.result_port = _be16_of(int(group_port))
    ctypes.memmove(ctypes.addressof(j) + type(j).group_mac.offset, multicast_mac(group_ip), 6)
    j.all_members = (1 << int(cfg.world)) - 1
    entry = j.strategy[0]
    entry.from_round, entry.version, entry.kind, entry.valid = 0, 0, int(proto.StrategyKind.SYNC), 1
    j.active = 1
    dp.jobs[ctypes.c_uint32(cfg.job)] = j
    dp._reset_stats(cfg.job)
    return 0, 0


def set_member(dp, job: int, rank: int, addr: tuple[str, int] | None) -> None:
    """Register (or, with None, clear) the member address of ``rank``: from then on the program
    accepts that rank's packets only from ``addr``."""
    if hasattr(dp, "set_member"):
        dp.set_member(job, rank, addr)
        return
    from aggd.dataplane.xdp import _be16_of, _be32_of  # noqa: PLC0415

    m = dp.members.Leaf()
    if addr is not None:
        m.ip, m.port, m.valid = _be32_of(addr[0]), _be16_of(int(addr[1])), 1
    dp.members[ctypes.c_uint32(job * proto.MAX_MEMBERS + rank)] = m


def allocation(dp, job: int) -> tuple[int, int]:
    """(first slot in the kernel's array, kernel slots) of an installed job."""
    j = dp.jobs[ctypes.c_uint32(job)]
    return (int(j.slot_base), int(j.kernel_slots)) if j.active else (0, 0)


def job_rounds(dp, job: int) -> tuple[int | None, dict[int, int]]:
    """(highest round any kernel slot of ``job`` has seen, {rank: highest round it contributed
    to}), read from the slots' bank keys and bitmaps: one map lookup per kernel slot."""
    base, count = allocation(dp, job)
    top, per_rank = None, {}
    for i in range(base, base + count):
        slot = dp.slots[ctypes.c_uint32(i)]
        for bank in slot.bank:
            if bank.state == 0:  # BANK_EMPTY
                continue
            rnd = int(bank.key) >> 32
            top = rnd if top is None else max(top, rnd)
            bits, rank = int(bank.bitmap), 0
            while bits:
                if bits & 1:
                    per_rank[rank] = max(per_rank.get(rank, rnd), rnd)
                bits >>= 1
                rank += 1
    return top, per_rank


def slot_size(dp) -> int:
    """Bytes of one kernel slot as loaded."""
    return ctypes.sizeof(dp.slots.Leaf)


def probe_value_sizes(elements: int) -> dict[str, int]:
    """Value size of each map (per CPU for per-CPU maps) with ``elements`` values a packet, from the
    maps header compiled alone (~0.5 s, no program loaded). The daemon sizes the kernel's slot array
    from it and checks maps pinned by an earlier daemon against it before reusing them."""
    from bcc import BPF

    from aggd.dataplane import xdp

    b = BPF(text=b'#include "aggd_maps.h"\n',
            cflags=[f"-I{xdp.XDP_DIR}", f"-DELEMS={elements}", "-DTOTAL_SLOTS=1", "-Wno-unused-function"])
    try:
        sizes = {}
        for name in xdp.MAP_NAMES:
            table = b[name.encode()]
            leaf = getattr(table, "sLeaf", None) or table.Leaf  # per-CPU maps: one CPU's value
            sizes[name] = ctypes.sizeof(leaf)
        return sizes
    finally:
        b.cleanup()


def pinned_value_sizes(pin_dir: str) -> dict[str, int]:
    """Value size of each map pinned in ``pin_dir`` (bpftool), for the names probe_value_sizes knows."""
    import json
    import subprocess
    from pathlib import Path

    from aggd.dataplane import xdp

    sizes = {}
    for name in xdp.MAP_NAMES:
        path = Path(pin_dir) / name
        if not path.exists():
            continue
        out = subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(path)], capture_output=True,
                             text=True, check=True).stdout
        sizes[name] = int(json.loads(out)["bytes_value"])
    return sizes


def pinned_layout_problems(pin_dir: str, wanted: dict[str, int]) -> list[str]:
    """Maps pinned in ``pin_dir`` whose value size is not what the program about to load uses.

    bcc reuses a pinned map whatever its value size, and reading a larger value into a smaller
    buffer corrupts memory, so a daemon whose XDP program changed its slot layout must not reuse
    the old maps (the loader's layout record covers elements, slots and port, not struct sizes)."""
    return [f"{name}: pinned values are {have} bytes, this program's are {wanted[name]}"
            for name, have in pinned_value_sizes(pin_dir).items() if name in wanted and have != wanted[name]]
