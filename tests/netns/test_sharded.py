"""One job sharded over several aggregator hosts (aggd_client.shards) in a lab: every aggregator a
namespace of its own with the XDP program on its interface, then real daemons joined with one
token. Sums are checked by the lab workers (aggd.lab.worker) against the documented bound."""
from __future__ import annotations

import contextlib

import pytest

from aggd.lab.runner import LabJob, run_workers, xdp_aggregator
from aggd_client.shards import ShardMap

from tests.harness.lab_runs import assert_all_right

pytestmark = pytest.mark.root

E = 256
SIZES = [1, E, E + 1, 37 * E + 5, 3, 262_147]   # shrink and grow, one value to many packets


@pytest.mark.parametrize("weights, loss", [((1, 1), 0.0), ((1, 3, 2), 0.0), ((2, 1), 2.0)])
def test_sums_through_several_xdp_aggregators(make_lab, weights, loss):
    k = len(weights)
    lab = make_lab(4, aggregators=k, loss_percent=loss)
    with contextlib.ExitStack() as stack:
        planes = [stack.enter_context(xdp_aggregator(lab, aggregator=i, total_slots=256)) for i in range(k)]
        job = LabJob(job=1, workers=list(range(4)), slots=64, weights=weights)
        for i, dp in enumerate(planes):
            dp.install_job(job.config(lab, aggregator=i))
        runs = run_workers(lab, job, timeout=300,
                           extra=["--sizes", ",".join(map(str, SIZES)), "--rounds", "2", "--interleave",
                                  "--give-up-after", "30"])
        assert_all_right(runs, 2 * len(SIZES))
        m = ShardMap(weights)
        for i, dp in enumerate(planes):
            stats = dp.job_stats(1)
            chunks = sum(-(-(m.cuts(n, E)[i + 1] - m.cuts(n, E)[i]) // E) for n in SIZES)
            # every chunk the map gives aggregator i, in each of 2 rounds, released there (in the kernel)
            assert stats.counters["released"] == 2 * chunks, (i, stats.counters)
            assert stats.counters["to_userspace"] == 0


def test_partitions_move_away_from_an_aggregator_behind_a_slow_link(make_lab):
    """Two XDP aggregators, the bridge's link to the second limited to 40 Mbit/s; 4 workers reduce
    1 MiB tensors with rebalancing every 4 calls (agreed through torch's TCPStore): the map moves
    most of each tensor to the first aggregator, every call of every member is cut by the same map,
    and every sum is right."""
    lab = make_lab(4, aggregators=2)
    lab.set_aggregator_rate(1, 40)
    with contextlib.ExitStack() as stack:
        planes = [stack.enter_context(xdp_aggregator(lab, aggregator=i, total_slots=256)) for i in range(2)]
        job = LabJob(job=1, workers=list(range(4)), slots=64, weights=(1, 1), rebalance_every=4)
        for i, dp in enumerate(planes):
            dp.install_job(job.config(lab, aggregator=i))
        runs = run_workers(lab, job, timeout=300,
                           extra=["--sizes", str(1 << 18), "--rounds", "16", "--give-up-after", "30"])
        assert_all_right(runs, 16)
    per_call = [[(rec["shard_version"], tuple(rec["shard_weights"])) for rec in r.records] for r in runs]
    assert all(calls == per_call[0] for calls in per_call), per_call
    versions = [v for v, _ in per_call[0]]
    assert versions[:4] == [0] * 4 and versions[-1] >= 1, per_call[0]
    first_moved = versions.index(1)
    assert first_moved % 4 == 0, per_call[0]
    w = per_call[0][-1][1]
    assert w[0] > 3 * w[1], per_call[0]


def test_the_job_goes_on_when_an_aggregator_dies(make_lab):
    """Two XDP aggregators, 4 workers reducing 256 Ki values 30 times with failover after 1 s
    (agreed through torch's TCPStore); the bridge's link to the second aggregator goes down while
    they run. Every sum is right, and every member drops that aggregator from the same call on."""
    import threading
    import time

    lab = make_lab(4, aggregators=2)
    with contextlib.ExitStack() as stack:
        planes = [stack.enter_context(xdp_aggregator(lab, aggregator=i, total_slots=256)) for i in range(2)]
        job = LabJob(job=1, workers=list(range(4)), slots=64, weights=(1, 1), failover_after=1.0)
        for i, dp in enumerate(planes):
            dp.install_job(job.config(lab, aggregator=i))
        cut = {}

        def kill_second():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and planes[1].job_stats(1).counters["released"] < 5 * 512:
                time.sleep(0.01)   # about 5 calls in (512 chunks a call on each)
            lab.set_aggregator_link(1, up=False)
            cut["released"] = planes[1].job_stats(1).counters["released"]

        killer = threading.Thread(target=kill_second)
        killer.start()
        runs = run_workers(lab, job, timeout=300,
                           extra=["--sizes", str(1 << 18), "--rounds", "30", "--give-up-after", "30"])
        killer.join()
        assert_all_right(runs, 30)
    per_call = [[tuple(rec["shard_weights"]) for rec in r.records] for r in runs]
    assert all(calls == per_call[0] for calls in per_call), per_call
    assert per_call[0][0] == (1, 1) and per_call[0][-1] == (1, 0), (per_call[0], cut)
