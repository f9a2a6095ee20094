"""Failover of a sharded job (aggd_client.shards, ``failover_after``): an aggregator that stops
answering is dropped by agreement through the shared store, its parts are sent again to a
surviving aggregator and the members' results stay right and identical. Two members (threads) over
two real user-space aggregators on loopback; the lab test with XDP aggregators:
tests/netns/test_sharded.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.harness.ranks import DictStore, run_and_close, sharded_members, userspace_aggregators

pytest.importorskip("aggd.dataplane.userspace.server")

E, JOB, WORLD, CALLS = 256, 6, 2, 10


@pytest.fixture
def aggs():
    with userspace_aggregators(2, E) as started:
        yield started


def sharded(aggs, slots=16):
    return sharded_members(aggs, JOB, WORLD, E, slots=slots, give_up_after=20.0, store=DictStore(timeout=60),
                           failover_after=0.5)


def tensor(rank, call):
    return (np.arange(37 * E + 11, dtype=np.float32) % 97) * (rank + 1) + call


def check(out, clients, failed_call, behind=False):
    for call in range(CALLS):
        want = tensor(0, call) + tensor(1, call)
        for r in range(WORLD):
            np.testing.assert_allclose(out[r][0][call], want, rtol=1e-6, err_msg=f"rank {r} call {call}")
        np.testing.assert_array_equal(out[0][0][call], out[1][0][call])   # replicas identical
    h0, h1 = out[0][1], out[1][1]
    assert [(c, m) for c, m, _ in h0] == [(c, m) for c, m, _ in h1]
    assert [(c, m.weights) for c, m, _ in h0][1:] == [(failed_call + 1, (1, 0))], h0
    assert "aggregator 1 stopped answering" in h0[1][2]
    assert f"in call {failed_call - 1 if behind else failed_call}" in h0[1][2]
    assert all(c.dead == {1} for c in clients)


def test_an_aggregator_dies_between_calls(aggs):
    clients = sharded(aggs)
    barrier = threading.Barrier(WORLD, action=lambda: aggs[1].close())

    def work(r, c):
        got = []
        for call in range(CALLS):
            if call == 4:
                barrier.wait(30)   # aggregator 1 dies with every member between calls 3 and 4
            got.append(c.allreduce(tensor(r, call)).copy())
        return got, c.history
    check(run_and_close(clients, work), clients, failed_call=4)


def test_an_aggregator_dies_with_one_member_a_call_behind(aggs):
    """Rank 1 never gets aggregator 1's result of call 3 (its receive is cut), and rank 0 kills
    aggregator 1 right after it got that result: rank 0 stalls in call 4, rank 1 in call 3; rank 1
    takes the part from rank 0, both send aggregator 1's part of call 4 to aggregator 0. (Slots for
    every chunk: rank 1 sends all of call 3 without the answers.)"""
    clients = sharded(aggs, slots=64)

    def work(r, c):
        got = []
        for call in range(CALLS):
            if r == 1 and call == 3:
                c.clients[1]._receive = lambda timeout: 0   # nothing from aggregator 1 from here
            got.append(c.allreduce(tensor(r, call)).copy())
            if r == 0 and call == 3:
                aggs[1].close()
        return got, c.history
    check(run_and_close(clients, work), clients, failed_call=4, behind=True)
