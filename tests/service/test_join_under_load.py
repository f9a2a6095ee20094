"""JOINs are answered while the control socket and the policy runner are busy.

The user-space thread answers JOINs; the daemon's other threads (control commands, the policy
runner) hold the daemon's lock while they read the data planes. A JOIN once waited for that lock
while holding the user-space path's own, and the daemon's data path stopped for good (seen as a
torchrun rank whose JOIN went unanswered for 60 s). Here JOINs arrive while two threads keep the
daemon's lock busy with commands that read every plane.
"""
from __future__ import annotations

import json
import sys
import textwrap
import threading

import pytest

pytestmark = pytest.mark.root

JOINS = 300

WORKER = textwrap.dedent("""
    import json, sys, time
    from aggd_client.membership import request_join
    server, job, token, ip, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    slowest = 0.0
    for i in range(n):
        t = time.monotonic()
        request_join((server, 47000), job, i % 2, token, bind=(ip, 41000 + i % 2), timeout=10)
        slowest = max(slowest, time.monotonic() - t)
    print(json.dumps({"joins": n, "slowest": slowest}))
""")


def test_joins_answered_while_control_and_policy_read_the_planes(make_lab, make_daemon):
    lab = make_lab(1)
    d = make_daemon(lab, policy={"interval_ms": 20})
    job = d.call("jobs.create", name="busy", world=2, slots=8, kernel_slots=4)
    stop = threading.Event()
    calls, failed = [0, 0], []

    def hammer(k: int) -> None:
        while not stop.is_set():
            try:
                d.call("jobs.show" if k else "status", **({"job": "busy"} if k else {}))
            except Exception as exc:   # the daemon stopped answering: said by the assert below
                failed.append(repr(exc))
                return
            calls[k] += 1

    threads = [threading.Thread(target=hammer, args=(k,), daemon=True) for k in (0, 1)]
    for t in threads:
        t.start()
    try:
        out = lab.check_output(lab.worker_ns(0), [sys.executable, "-c", WORKER, lab.agg_ip, job["name"],
                                                  job["token"], lab.worker_ip(0), str(JOINS)], timeout=240)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not failed, failed
    got = json.loads(out.strip().splitlines()[-1])
    assert got["joins"] == JOINS and got["slowest"] < 10, got
    assert min(calls) > 10, calls                       # the commands really ran alongside
    assert d.call("jobs.show", job="busy")["joined"] == 2
    assert "Traceback" not in d.log()
