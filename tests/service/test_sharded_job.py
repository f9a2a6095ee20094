"""A job sharded over two aggregator hosts, each a real daemon in its own lab namespace: the job is
created on the first (`aggctl jobs create`), on the second with the first's token
(`aggctl jobs create --token`), and the lab workers join both with that token and cut every tensor
between them by the shard map's weights (aggd_client.shards)."""
from __future__ import annotations

import json

import pytest

from aggd.lab.runner import LabJob, run_workers
from aggd_client.shards import ShardMap

pytestmark = pytest.mark.root

SIZES = [1, 256, 257, 70_001]


def test_a_job_on_two_daemons_joined_with_one_token(make_lab, make_daemon):
    lab = make_lab(4, aggregators=2)
    daemons = [make_daemon(lab, dataplane={"netns": lab.agg_ns_of(i)}, jobs={"group_base": f"239.77.{i}.0"})
               for i in range(2)]
    first = daemons[0].aggctl("jobs", "create", "big", "--world", "4", "--json")
    assert first.exit_code == 0, first.output
    job = json.loads(first.output)
    second = daemons[1].aggctl("jobs", "create", "big", "--world", "4", "--token", job["token"], "--json")
    assert second.exit_code == 0, second.output
    assert json.loads(second.output)["token"] == job["token"]
    bad = daemons[1].aggctl("jobs", "create", "other", "--world", "4", "--token", "short")
    assert bad.exit_code != 0 and "token must be 32 to 128" in bad.output

    weights = (1, 2)
    runs = run_workers(lab, LabJob(job=job["id"], workers=[0, 1, 2, 3], name="big", token=job["token"],
                                   weights=weights),
                       timeout=300, extra=["--sizes", ",".join(map(str, SIZES)), "--rounds", "2", "--interleave"])
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(r.records) == 2 * len(SIZES)
        assert all(rec["within_bound"] and rec["shape_ok"] for rec in r.records), r.records
    m = ShardMap(weights)
    for i, d in enumerate(daemons):
        shown = d.call("jobs.show", job="big")
        assert shown["joined"] == 4
        released = shown["paths"]["kernel"]["counters"]["released"]
        chunks = sum(-(-(m.cuts(n, 256)[i + 1] - m.cuts(n, 256)[i]) // 256) for n in SIZES)
        assert released == 2 * chunks, (i, shown["paths"]["kernel"]["counters"])
