"""The straggler detector through the real daemon and its XDP program, as DDP uses aggd: a step of
several calls (buckets), each of many chunks. Rank 3's steps take three times the others'
compute. The detector must see it about that slow, and see the others even: it took the mean lag
of every contribution, and a late member's later chunks (and calls) come in step with the others',
which wait for it, so a 3x slow member of 3 calls of 30 chunks a step looked 1.1x slow."""
from __future__ import annotations

import threading
import time

import pytest

from aggd.lab.runner import LabJob, run_workers

from tests.harness.lab_runs import assert_all_right

pytestmark = pytest.mark.root

STEPS, CALLS, COMPUTE = 60, 3, 0.03
SIZE = 30 * 256                  #: 30 chunks a call


@pytest.mark.parametrize("path", ["kernel", "user"])
def test_a_slow_member_of_steps_of_several_calls_is_seen_as_slow_as_it_is(make_lab, make_daemon, path):
    lab = make_lab(4)
    d = make_daemon(lab, policy={"auto_switch": False})     # detection only: the job stays sync
    job = d.call("jobs.create", name="ddp", world=4, kernel_slots=None if path == "kernel" else 0)
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(d.call("workers", job="ddp")["workers"])
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        runs = run_workers(lab, LabJob(job=job["id"], workers=list(range(4)), name="ddp", token=job["token"]),
                           extra=["--sizes", str(SIZE), "--rounds", str(STEPS * CALLS), "--check", "all",
                                  "--compute", str(COMPUTE), "--slow", f"3:{2 * COMPUTE}",
                                  "--step-calls", str(CALLS), "--give-up-after", "30"])
    finally:
        stop.set()
        t.join(5)
    assert_all_right(runs)
    late = [w for w in seen[len(seen) // 2:] if w[3].get("slowdown") is not None]   # once the EWMA settled
    assert late, seen[-3:]
    slow = [w[3]["slowdown"] for w in late]
    assert max(slow) >= 2.0 and all(w[3]["straggler"] for w in late[-3:]), slow
    assert all(w[r]["slowdown"] < 1.5 for w in late for r in range(3)), [[w[r]["slowdown"] for r in range(3)] for w in late]
