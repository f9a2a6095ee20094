"""aggd.lab.hostcpu: the host's CPU time by kind between two /proc/stat snapshots."""
from __future__ import annotations

import time

from aggd.lab import hostcpu


def test_a_busy_loop_shows_as_busy_user_time():
    a = hostcpu.snapshot()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # 0.3 s of this process's own CPU, nearly all user
        sum(range(200_000))
    d = hostcpu.between(a, hostcpu.snapshot())
    assert d["busy"] >= 0.2 and d["user"] >= 0.2
    assert abs(d["busy"] - (d["user"] + d["system"] + d["softirq"] + d["other"])) < 1e-9
    assert all(v >= 0 for v in d.values())
