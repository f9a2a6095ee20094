"""Failover of a sharded job (aggd_client.shards, ``failover_after``): an aggregator that stops
answering is dropped by agreement through the shared store, its parts are sent again to a
surviving aggregator and the members' results stay right and identical. Two members (threads) over
two real user-space aggregators on loopback; the lab test with XDP aggregators:
tests/netns/test_sharded.py."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.harness.ranks import DictStore, run_and_close, sharded_members, userspace_aggregators

pytest.importorskip("aggd.dataplane.userspace.server")

E, JOB, WORLD, CALLS = 256, 6, 2, 10


@pytest.fixture
def aggs():
    with userspace_aggregators(2, E) as started:
        yield started


def sharded(aggs, slots=16, strategy="sync"):
    return sharded_members(aggs, JOB, WORLD, E, slots=slots, give_up_after=20.0, store=DictStore(timeout=60),
                           failover_after=0.5, strategy=strategy)


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


@pytest.mark.parametrize("strategy,kill_after", [("async", 3), ("quorum:1:50ms", 5)])
def test_an_aggregator_dies_with_the_members_calls_apart(aggs, strategy, kill_after):
    """Under async and quorum a member is not held within a call of the others: rank 0 runs ahead
    (async: three rounds, the aggregator's window; quorum:1 as far as it likes) while rank 1 waits
    after its first call, kills aggregator 1 once it has its result of call ``kill_after`` and lets
    rank 1 go on. Both stall on aggregator 1, calls apart. Rank 1 takes aggregator 1's parts of its
    calls before rank 0's from rank 0's copies (a quorum straggler behind the copies kept: the
    newest one, as a quorum answers a straggler); both send its part of rank 0's call again to
    aggregator 0, and drop it from the call after."""
    clients = sharded(aggs, slots=64, strategy=strategy)
    killed = threading.Event()

    def work(r, c):
        got = []
        for call in range(CALLS):
            if r == 1 and call == 1:
                assert killed.wait(30)
            h = c.allreduce_async(tensor(r, call))
            out = h.wait().copy()
            taken = [(lo, hi) for j, (_, lo, hi, _) in enumerate(h._parts) if j in h._settled]   # another's
            got.append((out, np.asarray(h.n_contrib).copy(), taken))
            if r == 0 and call == kill_after:
                aggs[1].close()
                killed.set()
        return got, c.history

    out = run_and_close(clients, work)
    h0, h1 = out[0][1], out[1][1]
    assert [(c, m) for c, m, _ in h0] == [(c, m) for c, m, _ in h1]
    assert [(c, m.weights) for c, m, _ in h0][1:] == [(kill_after + 2, (1, 0))], h0
    assert f"aggregator 1 stopped answering (every member stalled on it in calls 1 to {kill_after + 1})" in h0[1][2]
    assert all(c.dead == {1} for c in clients)
    got0, got1 = out[0][0], out[1][0]
    # rank 1 took aggregator 1's part of calls 1 .. kill_after from rank 0 (quorum: of those it kept)
    taken = {call: t for call, (_, _, t) in enumerate(got1) if t}
    assert sorted(taken) == list(range(1, kill_after + 1)) and not any(t for _, _, t in got0), taken
    kept = range(kill_after - 3, kill_after + 1)     # the copies a member keeps: KEEP_CALLS calls
    for call, ((lo, hi),) in taken.items():
        np.testing.assert_array_equal(got1[call][0][lo:hi], got0[call if call in kept else kill_after][0][lo:hi])
    if strategy == "async":
        # every chunk a running sum: its own member's alone, the other's alone (a part taken from
        # it), or both (chunks of E values; the tensor's last chunk holds the tail)
        for call in range(CALLS):
            for r, got in enumerate((got0, got1)):
                values, counts, _ = got[call]
                for k, n in enumerate(counts):
                    v = values[k * E:(k + 1) * E]
                    t0, t1 = tensor(0, call)[k * E:(k + 1) * E], tensor(1, call)[k * E:(k + 1) * E]
                    options = [t0 + t1] if n == 2 else [t0, t1]
                    assert any(np.allclose(v, o, rtol=1e-5, atol=1e-3) for o in options), (r, call, k, n)
