"""Two levels of aggregation through real daemons (docs/hierarchy.md): two rack daemons, each with
a job of two lab workers, forward every complete round to a third daemon's job, whose members are
the racks, and relay its results; every worker checks that each result is the sum of all four
workers' tensors. Every level runs in its daemon's XDP program: the racks forward and relay in the
kernel, and a rack job with slots in user space too does the same there."""
from __future__ import annotations

import json
import threading
import time

import pytest

from aggd.lab.runner import LabJob, run_workers
from aggd_client.protocol import DEFAULT_PORT

from tests.harness.lab_runs import assert_all_right

pytestmark = pytest.mark.root

SIZES = [1, 256, 257, 9_000, 70_001]
SILENT_AFTER = 2.0     #: [policy] silent_after where a test waits past it


def tree(make_lab, make_daemon, loss: float = 0.0, per_rack: int = 4, top_strategy: str = "sync", policy=None):
    """Two racks of ``per_rack`` lab workers behind a spine bridge (``Lab(racks=2)``): the upper job
    "top" on the spine's daemon (under ``top_strategy``), rack jobs "rack0" and "rack1" (made
    through aggctl) on the racks' daemons; rack 1's job has 4 of its 16 slots in the kernel, the
    rest in user space."""
    lab = make_lab(2 * per_rack, aggregators=3, racks=2, loss_percent=loss)
    daemons = [make_daemon(lab, dataplane={"netns": lab.agg_ns_of(i)}, jobs={"group_base": f"239.77.{i}.0"},
                           **({"policy": policy} if policy else {}))
               for i in range(3)]
    top = daemons[lab.spine_aggregator].call("jobs.create", name="top", world=2, strategy=top_strategy)
    racks = []
    for r in range(2):
        made = daemons[r].aggctl("jobs", "create", f"rack{r}", "--world", str(per_rack), "--json",
                                 "--upstream", f"{lab.agg_ip_of(lab.spine_aggregator)}:{DEFAULT_PORT}/top",
                                 "--upstream-token", top["token"], "--upstream-rank", str(r),
                                 "--span", str(2 * per_rack),
                                 *(["--slots", "16", "--kernel-slots", "4"] if r == 1 else []))
        assert made.exit_code == 0, made.output
        racks.append(json.loads(made.output))
    return lab, daemons, top, racks


def run_racks(lab, racks, extra, timeout=300, delays=(0.0, 0.0)):
    """Each rack's workers join their rack's job (rack r's ``delays[r]`` seconds after the start)
    and check every sum against all workers' tensors."""
    runs: dict[int, list] = {}

    def rack(r):
        time.sleep(delays[r])
        workers = lab.rack_workers(r)
        runs[r] = run_workers(lab, LabJob(job=racks[r]["id"], workers=workers, name=f"rack{r}",
                                          token=racks[r]["token"], aggregator=r, tensor_rank_base=workers[0]),
                              timeout=timeout, extra=extra)

    threads = [threading.Thread(target=rack, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [run for r in range(2) for run in runs[r]]


def counted(paths: dict, *names: str) -> dict:
    """Counters of both paths added."""
    return {k: paths["kernel"]["counters"][k] + paths["userspace"]["counters"][k] for k in names}


def test_two_racks_sum_through_a_spine_aggregator(make_lab, make_daemon):
    """Every sum right, and each rack sends the spine one contribution a chunk."""
    lab, daemons, top, racks = tree(make_lab, make_daemon)
    runs = run_racks(lab, racks, ["--sizes", ",".join(map(str, SIZES)), "--rounds", "2", "--interleave"])
    assert_all_right(runs, 2 * len(SIZES))
    chunks = 2 * sum(-(-n // 256) for n in SIZES)
    for r in range(2):
        shown = daemons[r].call("jobs.show", job=f"rack{r}")
        assert shown["upstream"]["link"]["state"] == "linked"
        assert shown["upstream"]["link"]["upper_job_id"] == top["id"]
        assert "token" not in shown["upstream"]
        paths = shown["paths"]
        c = counted(paths, "released", "forwarded", "relayed", "retransmits")
        # once each, and again only for a worker's retransmission (a start-up wait can cause one)
        assert c["released"] == chunks and chunks <= c["forwarded"] <= chunks + c["retransmits"], paths
        assert c["relayed"] >= chunks, paths
        assert paths["kernel"]["counters"]["forwarded"] > 0
        if r == 1:                         # 4 kernel slots of 16: the rest forwarded from user space
            assert paths["userspace"]["counters"]["forwarded"] > 0
        assert daemons[r].aggctl("jobs", "show", f"rack{r}").output.count("link linked") == 1
    spine = daemons[lab.spine_aggregator]
    upper = spine.call("jobs.show", job="top")
    assert upper["joined"] == 2
    assert upper["paths"]["kernel"]["counters"]["released"] == chunks       # the racks' sums, in XDP
    sent = upper["paths"]["kernel"]["counters"]
    assert sent["rx_packets"] - sent["retransmits"] == 2 * chunks    # one a chunk a rack, re-sends aside


def test_racks_run_again_on_jobs_that_ran_wait_for_each_other(make_lab, make_daemon):
    """The workers of both racks run again on the rack jobs that ran, rack 1's first and rack 0's
    past the daemons' silence limit later. Each rack's workers restarting make it join the upper
    job again as a restarted member, so the upper job waits for the other rack as restarting,
    instead of declaring it gone and releasing rounds with one rack's sum (every sum right, and
    nobody declared gone at either level)."""
    # a silence limit of 2 s whatever the job's step: rack 0 comes back 3 s after it
    lab, daemons, top, racks = tree(make_lab, make_daemon, policy={"silent_after": SILENT_AFTER, "silent_steps": 0})
    args = ["--sizes", "362,2048", "--rounds", "3", "--interleave", "--give-up-after", "30"]
    assert_all_right(run_racks(lab, racks, args))
    assert_all_right(run_racks(lab, racks, args, delays=(SILENT_AFTER + 3.0, 0.0)))
    spine = daemons[lab.spine_aggregator]
    assert "declared gone" not in spine.log() + daemons[0].log() + daemons[1].log()
    assert all(not w["gone"] for w in spine.call("workers", job="top")["workers"])
    for r in range(2):
        assert "joining its upper job again" in daemons[r].log()
        assert daemons[r].call("jobs.show", job=f"rack{r}")["upstream"]["link"]["state"] == "linked"


def test_racks_join_an_upper_job_created_again_while_they_run(make_lab, make_daemon):
    """The upper job is deleted and created again (its token given again) while the racks' workers
    run: the racks' links still hold the old job's tag, and the upper daemon refuses their sums as
    from strangers (NACK unknown job, then not a member). The XDP program passes a linked upper aggregator's NACK
    up, the rack daemons join again, and every sum is right (the workers' retransmissions send
    the rounds in flight up again)."""
    lab, daemons, top, racks = tree(make_lab, make_daemon)
    spine = daemons[lab.spine_aggregator]
    runs = []
    t = threading.Thread(target=lambda: runs.extend(run_racks(
        lab, racks, ["--sizes", "362,2048", "--rounds", "60", "--interleave", "--give-up-after", "30"])))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and \
                spine.call("jobs.show", job="top")["paths"]["kernel"]["counters"]["released"] < 20:
            time.sleep(0.05)
        spine.call("jobs.delete", job="top")
        spine.call("jobs.create", name="top", world=2, token=top["token"])
    finally:
        t.join()
    assert_all_right(runs)
    for r in range(2):
        assert "the upper aggregator refused its sums (" in daemons[r].log(), daemons[r].log()[-2000:]
        assert daemons[r].call("jobs.show", job=f"rack{r}")["upstream"]["link"]["state"] == "linked"
    assert spine.call("jobs.show", job="top")["joined"] == 2


def test_loss_on_every_link_is_recovered_at_both_levels(make_lab, make_daemon):
    """2% of packets lost on every bridge (a worker's contribution, a rack's forwarded sum, the
    upper result, the relayed one; crossing the spine is two bridges). Every sum still right."""
    lab, daemons, top, racks = tree(make_lab, make_daemon, loss=2.0)
    runs = run_racks(lab, racks, ["--sizes", "256,9000,70001", "--rounds", "4", "--interleave",
                                  "--give-up-after", "30"])
    assert_all_right(runs)
    for r in range(2):
        c = counted(daemons[r].call("jobs.show", job=f"rack{r}")["paths"], "forwarded", "released", "retransmits")
        assert c["forwarded"] > c["released"] and c["retransmits"] > 0, c    # re-sent upwards


@pytest.mark.parametrize("strategy,check", [("async", "partial"), ("ssp:1", "all"), ("quorum:1:20ms", "none")])
def test_racks_under_an_upper_job_of_another_strategy(make_lab, make_daemon, strategy, check):
    """The upper job runs another strategy among the racks (rack jobs are sync). ``async``: a rack's
    forwarded sum is answered at once with the upper round's running sum, which the rack relays:
    each chunk a worker gets is the sum of as many workers' tensors as its n_contrib says (its own
    rack's, or both racks'), within the bound. ``ssp:1``: racks a round apart, every sum whole.
    ``quorum:1``: the first rack's sum releases the upper round; the other's, late, is carried into
    the next one (every call answered: what a quorum's straggler gets)."""
    lab, daemons, top, racks = tree(make_lab, make_daemon, top_strategy=strategy)
    runs = run_racks(lab, racks, ["--sizes", "256,9000,70001", "--rounds", "6", "--interleave",
                                  "--check", check, "--give-up-after", "30"])
    for run in runs:
        # a worker exits 1 when a sum is out of its bound: show the records that were
        outside = [rec for rec in run.records if not rec.get("within_bound", True)][:3]
        assert run.returncode == 0, (outside, run.stderr[-3000:])
        assert len(run.records) == 18 and all(rec["shape_ok"] for rec in run.records)
        if check != "none":
            assert all(rec["within_bound"] for rec in run.records), \
                [rec for rec in run.records if not rec["within_bound"]][:3]
    upper = daemons[lab.spine_aggregator].call("jobs.show", job="top")
    assert upper["strategy"].startswith(strategy.split(":")[0]), upper["strategy"]
    counters = upper["paths"]["kernel"]["counters"]
    if strategy == "async":
        assert counters["partials"] > 0, counters     # some racks got the running sum before the other's
    if strategy.startswith("quorum"):
        assert counters["carried"] + counters["uncarried"] > 0, counters   # the later rack's sums


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
    assert shown["upstream"]["link"]["state"] == "joining"


def test_a_rack_daemon_killed_and_restarted_while_the_racks_run(make_lab, make_daemon):
    """Rack 0's daemon is SIGKILLed mid-run and started again: its XDP program goes on forwarding
    and relaying from the pinned maps meanwhile, the restarted daemon links to the upper job again
    (as a restarted member), and every worker's every sum is still right."""
    import signal
    import time

    lab, daemons, top, racks = tree(make_lab, make_daemon)
    restarted = {}

    def restart():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and \
                counted(daemons[0].call("jobs.show", job="rack0")["paths"], "released")["released"] < 400:
            time.sleep(0.05)
        restarted["at"] = counted(daemons[0].call("jobs.show", job="rack0")["paths"], "released")["released"]
        daemons[0].stop(signal.SIGKILL, 10)
        time.sleep(0.5)
        daemons[0].start()
        restarted["link"] = daemons[0].call("jobs.show", job="rack0")["upstream"]["link"]

    t = threading.Thread(target=restart, daemon=True)
    t.start()
    runs = run_racks(lab, racks, ["--sizes", "256,9000,70001", "--rounds", "12", "--interleave",
                                  "--give-up-after", "30"])
    t.join(60)
    assert_all_right(runs)
    assert "link" in restarted, "the daemon was not restarted"
    assert restarted["at"] < 12 * sum(-(-n // 256) for n in (256, 9000, 70001)) / 2, restarted   # mid-run
    deadline = time.monotonic() + 10
    while daemons[0].call("jobs.show", job="rack0")["upstream"]["link"]["state"] != "linked":
        assert time.monotonic() < deadline, daemons[0].call("jobs.show", job="rack0")["upstream"]
        time.sleep(0.1)
