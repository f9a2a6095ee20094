"""A training script run again on a job that already ran: the README's worker, every client
default, on a real daemon and its XDP program (or its user-space path) in a lab.

Its ranks rejoin one by one and the first sends at once. Each must start at the round the first
got (the JOIN answer's, docs/protocol.md "Members declared gone"), or each round waits for
members that never send it; and the members that have not rejoined yet are starting, not silent,
however long since the last run, or the rounds go on without them and every survivor's sum is
partial (n_contrib 1 or 2 of 4, with no error), as a user running the README's code twice saw."""
from __future__ import annotations

import re
import time

import pytest

from tests.harness import readme_worker

pytestmark = pytest.mark.root

WORLD, ROUNDS = 4, 30
#: two DDP-like buckets: a run ends with the small one and the next starts with the large one, which
#: has chunks the last rounds left out (their slots' newest rounds are older)
SIZES = (2048, 362)
SILENT_AFTER = 5.0             #: the shipped default: the last rank rejoins later than that


def run(lab, job, delays):
    """Every rank of ``job`` after its delay (seconds from the first); each must finish with
    every round summed over the whole world."""
    procs, t0 = {}, time.monotonic()
    try:
        for w, delay in sorted(enumerate(delays), key=lambda wd: wd[1]):
            time.sleep(max(0.0, t0 + delay - time.monotonic()))
            procs[w] = readme_worker.start(lab, w, job["name"], job["token"], ROUNDS, SIZES, check_world=WORLD)
        for w, p in procs.items():
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, (w, stderr[-3000:])
            assert len(stdout.splitlines()) == ROUNDS, (w, stdout[-500:])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("path", ["kernel", "user"])
def test_a_script_run_again_lines_up_however_its_ranks_start(lab_daemon, path):
    lab, d = lab_daemon(WORLD)
    job = d.call("jobs.create", name="again", world=WORLD, kernel_slots=None if path == "kernel" else 0)
    run(lab, job, [0.0] * WORLD)
    time.sleep(1.0)
    # again: rank 0 at once, the others later, the last past the silence limit
    run(lab, job, [0.0, 1.0, 2.5, SILENT_AFTER + 2.5])
    log = d.log()
    assert "declared gone" not in log, log[-3000:]
    workers = d.call("workers", job="again")["workers"]
    assert all(not w["gone"] for w in workers), workers
    # and once more, every rank at once: a restart ended by the last is no part of the next one
    run(lab, job, [0.0] * WORLD)
    assert "declared gone" not in d.log()


def test_rounds_go_on_past_a_restart_that_lost_the_kernel_rounds(lab_daemon):
    """The daemon stops, and starts with its kernel rounds gone (a reboot empties bpffs; a new
    kernel_memory needs --reset-kernel-state): the members' next run goes on past the rounds the
    job had run, so the strategy table's versions stay ahead of nothing and a new one can be set;
    status shows the version in force, and the newer one waiting."""
    lab, d = lab_daemon(WORLD)
    job = d.call("jobs.create", name="resume", world=WORLD)
    run(lab, job, [0.0] * WORLD)
    first = d.call("strategy.set", job="resume", strategy="ssp:2")["versions"][-1]["from_round"]
    later = d.call("strategy.set", job="resume", strategy="sync", from_round=first + 500)["versions"][-1]
    shown = d.call("jobs.show", job="resume")
    assert (shown["strategy"], shown["strategy_version"]) == ("sync", 0), shown   # the newest waits
    assert [(p["strategy"], p["version"]) for p in shown["pending"]] == [("ssp:2", 1), ("sync", 2)]
    assert [j["strategy"] for j in d.call("status")["jobs"]] == ["sync"]
    d.stop()
    d.start("--reset-kernel-state")
    assert "kernel slots installed empty" in d.log()
    run(lab, job, [0.0] * WORLD)
    gone_on = int(re.findall(r"job resume: every member restarted; .* goes on from round (\d+)", d.log())[-1])
    assert gone_on >= later["from_round"] > ROUNDS
    assert d.call("strategy.show", job="resume")["in_force"]["strategy"] == "sync"
    # a new version goes in (it used to be refused "table full" until the rounds got back to the old ones)
    shown = d.call("strategy.set", job="resume", strategy="ssp:1")
    assert shown["versions"][-1]["from_round"] > gone_on + ROUNDS - 1 and shown["versions"][-1]["version"] == 3
