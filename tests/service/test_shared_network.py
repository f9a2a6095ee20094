"""Two aggregator hosts on one network, each daemon with the default settings: both number their
jobs alike and give them the same result group (one `group_base`), so each job's results reach the
other's workers too, with the same job id. Every worker must take only its own aggregator's: a
user who ran racks under an upper aggregator this way got the other rack's sums as its own."""
from __future__ import annotations

import pytest

from tests.harness import readme_worker

pytestmark = pytest.mark.root

ROUNDS = 60


@pytest.mark.parametrize("path", ["kernel", "user"])
def test_jobs_of_two_aggregators_sharing_a_result_group_keep_their_own_sums(make_lab, make_daemon, path):
    lab = make_lab(4, aggregators=2)
    daemons = [make_daemon(lab, dataplane={"netns": lab.agg_ns_of(i)}) for i in range(2)]
    jobs = [d.call("jobs.create", name=f"j{i}", world=2, kernel_slots=None if path == "kernel" else 0)
            for i, d in enumerate(daemons)]
    shown = [d.call("jobs.show", job=j["name"]) for d, j in zip(daemons, jobs)]
    assert jobs[0]["id"] == jobs[1]["id"] and shown[0]["group"] == shown[1]["group"], shown
    # job 0: workers 0 and 1 sending 1 and 2; job 1: workers 2 and 3 sending 101 and 102
    procs = [readme_worker.start(lab, w, f"j{w // 2}", jobs[w // 2]["token"], ROUNDS, (362, 2048), check_world=2,
                                 rank=w % 2, aggregator=w // 2, offset=100.0 * (w // 2))
             for w in range(4)]
    try:
        for w, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, (w, stderr[-3000:])
            assert len(stdout.splitlines()) == ROUNDS
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
