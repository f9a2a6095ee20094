"""The whole host's CPU time by kind, from /proc/stat's first line: what a benchmark's rounds cost
the machine. In the lab the workers, the aggregator and the "network" (veths, bridge, XDP) share
the same cores, so a worker's own CPU time misses most of it: the packet path runs in softirq,
often on behalf of another process."""
from __future__ import annotations

import os
from pathlib import Path

_STAT = Path("/proc/stat")
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_TICK = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[str, int]:
    """Ticks spent in each kind since boot, summed over CPUs."""
    first = _STAT.read_text().split("\n", 1)[0].split()
    if first[0] != "cpu":
        raise RuntimeError(f"{_STAT} does not start with the cpu line")
    return dict(zip(_FIELDS, map(int, first[1:1 + len(_FIELDS)])))


def between(a: dict[str, int], b: dict[str, int]) -> dict:
    """Seconds of each kind between two snapshots: user (with nice), system, softirq, idle (with
    iowait), other (irq, steal), and busy (all but idle)."""
    d = {k: (b[k] - a[k]) / _TICK for k in _FIELDS}
    out = {"user": d["user"] + d["nice"], "system": d["system"], "softirq": d["softirq"],
           "idle": d["idle"] + d["iowait"], "other": d["irq"] + d["steal"]}
    out["busy"] = out["user"] + out["system"] + out["softirq"] + out["other"]
    return out
