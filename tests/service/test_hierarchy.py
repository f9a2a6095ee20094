"""Two levels of aggregation through real daemons (docs/hierarchy.md): two rack daemons, each with
a job of two lab workers, forward every complete round to a third daemon's job, whose members are
the racks, and relay its results; every worker checks that each result is the sum of all four
workers' tensors. The racks serve their jobs in user space, the upper daemon in its XDP program."""
from __future__ import annotations

import json
import threading

import pytest

from aggd.lab.runner import LabJob, run_workers
from aggd_client.protocol import DEFAULT_PORT

pytestmark = pytest.mark.root

SIZES = [1, 256, 257, 9_000, 70_001]


def tree(make_lab, make_daemon, loss: float = 0.0):
    """A lab of 4 workers and 3 aggregators: the upper job "top" on the third daemon, rack jobs
    "rack0" and "rack1" (made through aggctl) on the first two."""
    lab = make_lab(4, aggregators=3, loss_percent=loss)
    daemons = [make_daemon(lab, dataplane={"netns": lab.agg_ns_of(i)}, jobs={"group_base": f"239.77.{i}.0"})
               for i in range(3)]
    top = daemons[2].call("jobs.create", name="top", world=2)
    racks = []
    for r in range(2):
        made = daemons[r].aggctl("jobs", "create", f"rack{r}", "--world", "2", "--json",
                                 "--upstream", f"{lab.agg_ip_of(2)}:{DEFAULT_PORT}/top",
                                 "--upstream-token", top["token"], "--upstream-rank", str(r), "--span", "4")
        assert made.exit_code == 0, made.output
        racks.append(json.loads(made.output))
    return lab, daemons, top, racks


def run_racks(lab, racks, extra, timeout=300):
    runs: dict[int, list] = {}

    def rack(r):
        runs[r] = run_workers(lab, LabJob(job=racks[r]["id"], workers=[2 * r, 2 * r + 1], name=f"rack{r}",
                                          token=racks[r]["token"], aggregator=r, tensor_rank_base=2 * r),
                              timeout=timeout, extra=extra)

    threads = [threading.Thread(target=rack, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [run for r in range(2) for run in runs[r]]


def test_two_racks_sum_through_an_upper_aggregator(make_lab, make_daemon):
    lab, daemons, top, racks = tree(make_lab, make_daemon)
    runs = run_racks(lab, racks, ["--sizes", ",".join(map(str, SIZES)), "--rounds", "2", "--interleave"])
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        assert len(run.records) == 2 * len(SIZES)
        assert all(rec["within_bound"] and rec["shape_ok"] for rec in run.records), run.records
    chunks = 2 * sum(-(-n // 256) for n in SIZES)
    for r in range(2):
        shown = daemons[r].call("jobs.show", job=f"rack{r}")
        assert shown["upstream"]["link"]["state"] == "linked"
        assert shown["upstream"]["link"]["upper_job_id"] == top["id"]
        assert "token" not in shown["upstream"]
        us = shown["paths"]["userspace"]["counters"]
        assert us["released"] == chunks and us["forwarded"] == chunks and us["relayed"] == chunks, us
        assert daemons[r].aggctl("jobs", "show", f"rack{r}").output.count("link linked") == 1
    upper = daemons[2].call("jobs.show", job="top")
    assert upper["joined"] == 2
    assert upper["paths"]["kernel"]["counters"]["released"] == chunks    # the racks' sums, in XDP


def test_loss_is_recovered_at_both_levels(make_lab, make_daemon):
    """3% of packets lost on every lab link: a worker's contribution, a rack's forwarded sum, the
    upper result and the relayed one. Every worker's every sum is still right."""
    lab, daemons, top, racks = tree(make_lab, make_daemon, loss=3.0)
    runs = run_racks(lab, racks, ["--sizes", "256,9000,70001", "--rounds", "4", "--interleave",
                                  "--give-up-after", "30"])
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        assert all(rec["within_bound"] and rec["shape_ok"] for rec in run.records), run.records
    for r in range(2):
        us = daemons[r].call("jobs.show", job=f"rack{r}")["paths"]["userspace"]["counters"]
        assert us["forwarded"] > us["released"] and us["retransmits"] > 0, us    # re-sent upwards


def test_a_rack_job_refuses_what_it_cannot_serve(make_lab, make_daemon):
    lab = make_lab(1)
    d = make_daemon(lab)
    up = {"server": "10.1.1.1:47000", "job": "top", "token": "t" * 32, "rank": 0, "span": 4}
    bad = d.aggctl("jobs", "create", "r", "--world", "2", "--upstream", "10.1.1.1:47000/top")
    assert bad.exit_code != 0 and "--upstream needs --upstream-token, --upstream-rank, --span" in bad.output
    for key, value, says in (("span", 1, "upstream.span"), ("server", "nowhere", "upstream.server"),
                             ("rank", 64, "upstream.rank")):
        with pytest.raises(Exception, match=says):
            d.call("jobs.create", name="r", world=2, upstream={**up, key: value})
    with pytest.raises(Exception, match="sync only"):
        d.call("jobs.create", name="r", world=2, strategy="quorum:1", upstream=up)
    d.call("jobs.create", name="r", world=2, upstream=up)
    with pytest.raises(Exception, match="sync only"):
        d.call("strategy.set", job="r", strategy="ssp:1")
    shown = d.call("jobs.show", job="r")
    assert shown["kernel_slots"] == 0 and shown["upstream"]["link"]["state"] == "joining"
