"""The overflow path: what the kernel cannot hold is served in user space, and a worker gets the same
sums whichever path served it. Workers join with tokens (aggd.lab.worker --token)."""
from __future__ import annotations

import pytest

from aggd.lab.runner import LabJob, run_workers

pytestmark = pytest.mark.root

SIZES = "1,256,257,8192"  # one element, one packet, one packet + 1, 32 chunks (2 uses of each slot)
ROUNDS = 2


def run(d, lab, name, workers=(0, 1), extra=()):
    """Run a job's workers once (fresh worker processes start at round 0, so each run uses a job
    of its own); return their runs and the job as the daemon shows it afterwards."""
    job = d.call("jobs.show", job=name)
    runs = run_workers(lab, LabJob(job=job["id"], workers=list(workers), name=name, token=job["token"]),
                       timeout=180, extra=["--sizes", SIZES, "--rounds", str(ROUNDS), *extra])
    for r in runs:
        assert r.returncode == 0 and len(r.records) == 4 * ROUNDS, \
            "\n".join(f"rank {x.rank} ({x.returncode}):\n{x.stderr[-2000:]}" for x in runs) + \
            f"\n{d.call('jobs.show', job=name)['paths']}\n{d.log()[-3000:]}"
        assert all(rec["within_bound"] for rec in r.records), r.records
    return runs


def digests(runs):
    """Every result of every rank, bit for bit."""
    return [[rec["sha256"] for rec in r.records] for r in runs]


def test_half_and_zero_kernel_budget_give_the_all_kernel_sums(make_lab, make_daemon, slot_bytes):
    lab = make_lab(2)
    exact = ["--pattern", "integers", "--digest"]
    # budget 24 slots: job "full" takes 16 (all its slots), job "half" gets the 8 left of its 16
    d = make_daemon(lab, dataplane={"kernel_memory": 24 * slot_bytes})
    full = d.call("jobs.create", name="full", world=2, slots=16)
    half = d.call("jobs.create", name="half", world=2, slots=16)
    big = d.call("jobs.create", name="big", world=2, slots=16, elements=512)  # larger packets
    assert (full["kernel_slots"], half["kernel_slots"], half["userspace_slots"]) == (16, 8, 8)
    assert half["placement"]["kernel"]["slots"] == [0, 8] and half["placement"]["userspace"]["slots"] == [8, 16]
    assert big["kernel_slots"] == 0 and big["port"] == d.settings["dataplane"].get("userspace_port", 47002)

    reference = digests(run(d, lab, "full", extra=exact))
    assert digests(run(d, lab, "half", extra=exact)) == reference
    # 512 values a packet: the tensors differ (the pattern follows the packet size), the sums are exact
    assert all(rec["max_abs_error"] == 0 for r in run(d, lab, "big", extra=exact) for rec in r.records)

    f = d.call("jobs.show", job="full")["paths"]
    assert f["userspace"]["counters"]["released"] == 0 and f["kernel"]["counters"]["to_userspace"] == 0
    h = d.call("jobs.show", job="half")["paths"]
    k, u = h["kernel"]["counters"], h["userspace"]["counters"]
    # one release per chunk and round: chunks 0..7 and 16..23 of the 8192-element tensor use kernel
    # slots 0..7, chunks 8..15 and 24..31 user-space slots 8..15; the small tensors (1 + 1 + 2
    # chunks) use slots 0 and 1
    assert k["released"] == ROUNDS * (1 + 1 + 2 + 16)
    assert u["released"] == ROUNDS * 16
    assert k["to_userspace"] == u["rx_packets"]  # what the kernel passed up is what user space got
    b = d.call("jobs.show", job="big")["paths"]
    assert b["userspace"]["counters"]["released"] == ROUNDS * (1 + 1 + 1 + 16)
    assert b["kernel"]["counters"]["rx_packets"] == 0  # sent to the user-space port, past the XDP program

    # gradient-like values through a half-kernel job: within the documented error bound
    d.call("jobs.delete", job="half")
    assert d.call("jobs.create", name="half2", world=2, slots=16)["kernel_slots"] == 8
    run(d, lab, "half2", extra=["--seed", "7"])

    d.stop()
    # A budget of zero: every job is served in user space, with the same sums.
    z = make_daemon(lab, dataplane={"kernel_memory": 0})
    zero = z.call("jobs.create", name="full", world=2, slots=16)
    assert zero["kernel_slots"] == 0 and z.call("status")["kernel"]["budget_slots"] == 0
    assert digests(run(z, lab, "full", extra=exact)) == reference
    p = z.call("jobs.show", job="full")["paths"]
    assert p["kernel"]["counters"]["released"] == 0 and p["kernel"]["counters"]["contributions"] == 0
    assert p["userspace"]["counters"]["released"] == ROUNDS * (1 + 1 + 2 + 32)
    assert p["kernel"]["counters"]["to_userspace"] == p["userspace"]["counters"]["rx_packets"]
