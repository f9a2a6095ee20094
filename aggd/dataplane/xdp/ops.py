"""What the daemon checks about the XDP program's maps before it loads or reuses them: the size of
a slot as compiled, and whether maps pinned by an earlier daemon have the same layout. (Jobs,
members, rounds and strategies go through the ``DataPlane`` interface of ``XdpDataPlane``.)
"""
from __future__ import annotations

import ctypes


def slot_size(dp) -> int:
    """Bytes of one kernel slot as loaded."""
    return ctypes.sizeof(dp.slots.Leaf)


def probe_value_sizes(elements: int) -> dict[str, int]:
    """Value size of each map (per CPU for per-CPU maps) with ``elements`` values a packet, from the
    maps header compiled alone (~0.5 s, no program loaded), or as kept in the program cache from
    the last time for the same sources, bcc and kernel. The daemon sizes the kernel's slot array
    from it and checks maps pinned by an earlier daemon against it before reusing them."""
    from bcc import BPF

    from aggd.dataplane.xdp import loader as xdp
    from aggd.dataplane.xdp import program_cache

    cflags = [f"-I{xdp.XDP_DIR}", f"-DELEMS={elements}", "-DTOTAL_SLOTS=1", "-Wno-unused-function"]
    cache = program_cache.ProgramCache.configured()
    key = program_cache.program_key(xdp.XDP_DIR, ["--value-sizes", *cflags])
    sizes = cache.get_value(key)
    if isinstance(sizes, dict) and set(sizes) == set(xdp.MAP_NAMES):
        return {name: int(size) for name, size in sizes.items()}
    b = BPF(text=b'#include "aggd_maps.h"\n', cflags=cflags)
    try:
        sizes = {}
        for name in xdp.MAP_NAMES:
            table = b[name.encode()]
            leaf = getattr(table, "sLeaf", None) or table.Leaf  # per-CPU maps: one CPU's value
            sizes[name] = ctypes.sizeof(leaf)
    finally:
        b.cleanup()
    cache.put_value(key, sizes)
    return sizes


def pinned_value_sizes(pin_dir: str) -> dict[str, int]:
    """Value size of each map pinned in ``pin_dir`` (bpftool), for the names probe_value_sizes knows."""
    import json
    import subprocess
    from pathlib import Path

    from aggd.dataplane.xdp import loader as xdp

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
