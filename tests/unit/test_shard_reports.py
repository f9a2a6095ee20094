"""The daemon's record of sharded jobs' maps (aggd.daemon.shard_reports): taken from members only,
checked, changes kept with their reasons."""
from __future__ import annotations

import json

import pytest

from aggd.core.registry import Limits, Registry
from aggd.daemon.shard_reports import ShardReports
from aggd_client.protocol import Header, MsgType


@pytest.fixture
def registry():
    reg = Registry(Limits(kernel_budget=0, elements=256, port=47000, userspace_port=47002, result_port=47001),
                   tag_factory=lambda: 0xABC)
    job = reg.create("big", 2)
    job_id = job.id
    from aggd.core.registry import Member
    job.members[0] = Member(0, ("10.0.0.10", 4000), 0.0, 0xABC)
    return reg, job_id


def message(job: int, body: dict, rank: int = 0, tag: int = 0xABC) -> bytes:
    return Header(type=MsgType.SHARDS, job=job, rank=rank, contributors=tag).pack() + json.dumps(body).encode()


BODY = {"version": 1, "call": 8, "weights": [1, 3], "index": 1, "rates": [1e6, None], "reason": "rates moved"}


def test_a_members_report_is_kept_and_a_new_version_is_a_change(registry):
    reg, job = registry
    r = ShardReports()
    assert r.take(message(job, BODY), ("10.0.0.10", 4000), reg, now=5.0) == (job, 1, 8, [1, 3], "rates moved")
    assert r.take(message(job, {**BODY, "call": 12}), ("10.0.0.10", 4000), reg) is None   # same version
    d = r.describe(job)
    assert d["share"] == 0.75 and d["call"] == 12 and d["from_rank"] == 0 and d["changes_total"] == 1
    assert [c["version"] for c in d["changes"]] == [1]
    r.take(message(job, {**BODY, "version": 2, "weights": [1, 1]}), ("10.0.0.10", 4000), reg)
    assert r.describe(job)["changes_total"] == 2 and r.describe(job)["share"] == 0.5
    r.forget(job)
    assert r.describe(job) is None


@pytest.mark.parametrize("why,data,src", [
    ("another address", lambda j: message(j, BODY), ("10.0.0.11", 4000)),
    ("another tag", lambda j: message(j, BODY, tag=1), ("10.0.0.10", 4000)),
    ("not a member", lambda j: message(j, BODY, rank=1), ("10.0.0.10", 4000)),
    ("unknown job", lambda j: message(j + 1, BODY), ("10.0.0.10", 4000)),
    ("not JSON", lambda j: message(j, BODY)[:-3], ("10.0.0.10", 4000)),
    ("all weights 0", lambda j: message(j, {**BODY, "weights": [0, 0]}), ("10.0.0.10", 4000)),
    ("rates short", lambda j: message(j, {**BODY, "rates": [1.0]}), ("10.0.0.10", 4000)),
    ("index out of range", lambda j: message(j, {**BODY, "index": 2}), ("10.0.0.10", 4000)),
    ("a NaN weight", lambda j: message(j, BODY).replace(b"[1, 3]", b"[NaN, 3]"), ("10.0.0.10", 4000)),
    ("too long", lambda j: message(j, {**BODY, "reason": "x" * 5000}), ("10.0.0.10", 4000)),
])
def test_anything_but_a_well_formed_members_report_is_ignored(registry, why, data, src):
    reg, job = registry
    r = ShardReports()
    assert r.take(data(job), src, reg) is None, why
    assert r.describe(job) is None and r.ignored == 1
