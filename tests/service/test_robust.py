"""Robust jobs through a real daemon (docs/protocol.md, "Robust jobs"): workers in a lab join a
``median`` or ``trimmed:1`` job, one of them sends its tensors times -10, and every result is the
statistic of the four (times four) within the quantisation bound; every chunk is served in user
space, the policy scores the bad member below -0.5 and the others above, and what a robust job cannot
run is refused with the reason."""
from __future__ import annotations

import time

import pytest

from aggd.lab.runner import LabJob, run_workers

pytestmark = pytest.mark.root

SIZES = "1,300,4096,20000"


@pytest.mark.parametrize("combine,strategy", [("median", "sync"), ("trimmed:1", "ssp:1")])
def test_a_robust_job_releases_the_statistic_and_scores_the_bad_member(make_lab, make_daemon, combine, strategy):
    lab = make_lab(4)
    d = make_daemon(lab, policy={"interval_ms": 50})
    job = d.call("jobs.create", name="robust", world=4, slots=64, strategy=strategy, combine=combine)
    assert job["combine"] == combine and job["kernel_slots"] == 0
    runs = run_workers(lab, LabJob(job=job["id"], workers=[0, 1, 2, 3], name="robust", token=job["token"]),
                       timeout=180, extra=["--sizes", SIZES, "--rounds", "6", "--outlier", "2:-10"])
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(r.records) == 6 * len(SIZES.split(",")) and all(rec["within_bound"] for rec in r.records), \
            [rec for rec in r.records if not rec["within_bound"]][:3]
    shown = d.call("jobs.show", job="robust")
    assert shown["paths"]["userspace"]["counters"]["contributions"] >= 4 * 6 * len(SIZES.split(","))
    assert shown["paths"]["kernel"]["counters"]["contributions"] == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:       # the policy's window after the last release
        workers = {w["rank"]: w for w in d.call("workers", job="robust")["workers"]}
        if all(w.get("score") is not None for w in workers.values()):
            break
        time.sleep(0.1)
    scores = {r: w["score"] for r, w in workers.items()}
    print(combine, strategy, scores)
    assert scores[2] < 0 and all(s > 0 for r, s in scores.items() if r != 2), scores
    shown = d.aggctl("workers", "robust")
    assert shown.exit_code == 0 and "SCORE" in shown.output, shown.output


def test_a_zeno_job_gives_every_member_the_same_results(make_lab, make_daemon):
    """zeno's choice of rows is the aggregator's (the unit tests check it exactly, tests/train
    that it trains): every member gets the same bytes."""
    lab = make_lab(4)
    d = make_daemon(lab)
    job = d.call("jobs.create", name="z", world=4, slots=64, combine="zeno")
    assert job["combine"] == "zeno" and job["kernel_slots"] == 0
    runs = run_workers(lab, LabJob(job=job["id"], workers=[0, 1, 2, 3], name="z", token=job["token"]),
                       timeout=180, extra=["--sizes", SIZES, "--rounds", "4", "--outlier", "1:-10", "--digest",
                                           "--check", "none"])
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    digests = {(rec["size"], rec["round"]): set() for rec in runs[0].records}
    for r in runs:
        for rec in r.records:
            digests[(rec["size"], rec["round"])].add(rec["sha256"])
    assert len(digests) == 4 * len(SIZES.split(",")) and all(len(v) == 1 for v in digests.values()), digests


def test_what_a_robust_job_cannot_run_is_refused_and_a_norm_bound_is_taken(make_lab, make_daemon):
    lab = make_lab(2)
    d = make_daemon(lab)
    d.call("jobs.create", name="r", world=2, combine="median")
    for argv, says in ((["strategy", "set", "r", "wbsp"], "a median job runs quorum, ssp, sync, not wbsp"),
                       (["jobs", "create", "x", "--world", "2", "--combine", "mean"], "combine 'mean'"),
                       (["jobs", "create", "y", "--world", "2", "--combine", "median", "--kernel-slots", "8"],
                        "served in user space"),
                       (["jobs", "create", "z", "--world", "2", "--score-after", "3"], "needs a robust combine")):
        res = d.aggctl(*argv)
        assert res.exit_code != 0 and says in res.output, (argv, res.output)
    assert d.call("strategy.show", job="r")["current"] == "sync"
    # a bound on the L2 norm is the kernel's too (docs/protocol.md, "Bounds")
    res = d.aggctl("jobs", "create", "n", "--world", "2", "--max-norm", "3", "--quarantine-after", "2", "--json")
    assert res.exit_code == 0, res.output
    shown = d.call("jobs.show", job="n")
    assert (shown["max_norm"], shown["quarantine_after"]) == (3.0, 2) and shown["kernel_slots"] > 0
    text = d.aggctl("jobs", "show", "n").output
    assert "bounds:    max_norm 3 a member's contribution; quarantine after 2 offences" in text, text
    text = d.aggctl("jobs", "show", "r").output
    assert "combine:   median (one row a member" in text, text
