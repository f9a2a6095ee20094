"""Joining with a token (aggd_client.join) against the registry behind a user-space aggregator on
loopback: the same JOIN handling the daemon runs, without namespaces."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from aggd.core.model import JobConfig
from aggd.core.registry import Limits, Registry, answer_join
from aggd.dataplane.userspace.server import UserspaceAggregator
from aggd_client import BadTokenError, NoAnswerError, NotMemberError, UnknownJobError, join
from aggd_client.protocol import MsgType, NackCode

E = 16


@pytest.fixture
def daemon():
    """A registry and a user-space aggregator answering JOINs the way aggd.daemon.service does."""
    reg = Registry(Limits(kernel_budget=0, elements=E, port=0, userspace_port=1, result_port=47001))
    holder = {}

    def on_join(data, src):
        reply, outcome = answer_join(reg, data, src)
        if outcome is not None and outcome.code == NackCode.NONE and outcome.changed:
            rank = int.from_bytes(bytes(data[6:8]), "big")
            holder["agg"].set_member(outcome.job.id, rank, src, outcome.job.members[rank].tag)
        return reply

    with UserspaceAggregator(("127.0.0.1", 0), elements=E, handlers={int(MsgType.JOIN): on_join}) as agg:
        holder["agg"] = agg
        job = reg.create("toy", 2, slots=4)
        job.port = agg.address[1]  # the test's aggregator listens on an ephemeral port
        job.group = None  # no multicast on loopback: results go to each member (fan-out)
        agg.add_job(JobConfig(job=job.id, world=2, slots=4, max_chunks=1 << 20, members={}, elements=E))
        yield reg, agg, job


def test_join_then_allreduce(daemon):
    reg, agg, job = daemon

    out = {}

    def worker(rank):
        with join(agg.address, "toy", rank, job.token, bind=("127.0.0.1", 0), give_up_after=5) as c:
            assert c.job_info.world == 2 and c.job_info.elements == E and c.job_info.slots == 4
            out[rank] = c.allreduce(np.full(40, rank + 1, np.float32))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(out) == {0, 1}
    for r in range(2):
        np.testing.assert_array_equal(out[r], np.full(40, 3, np.float32))
    assert sorted(reg.get("toy").members) == [0, 1]


def test_wrong_token_is_refused_clearly(daemon):
    _, agg, job = daemon
    with pytest.raises(BadTokenError) as info:
        join(agg.address, "toy", 0, "not-the-token", bind=("127.0.0.1", 0), timeout=3)
    assert "token was refused" in str(info.value) and info.value.code == NackCode.BAD_TOKEN


def test_unknown_job_and_bad_rank(daemon):
    _, agg, job = daemon
    with pytest.raises(UnknownJobError, match="no job 'other'"):
        join(agg.address, "other", 0, job.token, bind=("127.0.0.1", 0), timeout=3)
    with pytest.raises(NotMemberError, match="rank 7 is not a member"):
        join(agg.address, job.id, 7, job.token, bind=("127.0.0.1", 0), timeout=3)


def test_no_daemon_no_answer():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))  # a port nobody answers on
    try:
        with pytest.raises(NoAnswerError, match="JOIN"):
            join(s.getsockname(), "toy", 0, "t", bind=("127.0.0.1", 0), timeout=0.5)
    finally:
        s.close()
