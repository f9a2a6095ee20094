"""One job on several aggregators (aggd_client.shards): the shard map's cut, and ShardedClient
against real user-space aggregators (aggd.dataplane.userspace.server) on 127.0.0.1. The XDP path
and real daemons: tests/netns/test_sharded.py."""
from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd_client import AggClient
from aggd_client.shards import ShardedClient, ShardMap
from tests.harness.ranks import run_and_close, sharded_members, userspace_aggregators

E = 256


# -- the shard map -------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.integers(0, 50) | st.floats(0, 10, allow_nan=False), min_size=1, max_size=8)
       .filter(lambda w: sum(w) > 0),
       n=st.integers(0, 200_000), elements=st.integers(1, 3000))
def test_cuts_cover_the_tensor_on_packet_boundaries_in_proportion(weights, n, elements):
    m = ShardMap(tuple(weights))
    cuts = m.cuts(n, elements)
    assert cuts[0] == 0 and cuts[-1] == n and len(cuts) == len(weights) + 1
    assert all(a <= b for a, b in zip(cuts, cuts[1:]))
    assert all(c % elements == 0 for c in cuts[:-1] if c < n)   # whole chunks, the tail last
    chunks = -(-n // elements)
    counts = m.chunk_counts(chunks)
    assert sum(counts) == chunks
    total = sum(Fraction(w) for w in weights)
    for w, k in zip(weights, counts):
        assert abs(k - chunks * Fraction(w) / total) < 1   # largest remainder: within one chunk
        if w == 0:
            assert k == 0
    assert m.cuts(n, elements) == cuts  # the same on every member


def test_cut_examples():
    assert ShardMap((1, 1)).cuts(10 * E, E) == (0, 5 * E, 10 * E)
    assert ShardMap((1, 3)).cuts(8 * E + 1, E) == (0, 2 * E, 8 * E + 1)   # 9 chunks: 2.25 / 6.75
    assert ShardMap((1, 1)).cuts(1, E) == (0, 1, 1)    # one chunk: the first aggregator's
    assert ShardMap((0, 1)).cuts(E + 1, E) == (0, 0, E + 1)


@pytest.mark.parametrize("weights, text", [((), "at least one"), ((0, 0), "above 0"), ((1, -1), "weight 1"),
                                           ((1, float("nan")), "weight 1"), ((True,), "weight 0"),
                                           (("1",), "weight 0")])
def test_bad_shard_maps_are_refused(weights, text):
    with pytest.raises(ValueError, match=text):
        ShardMap(weights)


# -- through real user-space aggregators -----------------------------------------------------------

userspace = pytest.importorskip("aggd.dataplane.userspace.server")
model = pytest.importorskip("aggd.core.model")
JOB = 5


@pytest.fixture
def aggs():
    with userspace_aggregators(3, E) as started:
        yield started


def sharded_clients(aggs, world, weights):
    return sharded_members(aggs, JOB, world, E, shard_map=ShardMap(weights))


@pytest.mark.parametrize("weights", [(1, 1, 1), (1, 3, 0), (2, 1, 5)])
def test_sums_of_every_size_over_three_aggregators(aggs, weights):
    """Tensors that shrink and grow (one value, a packet, a packet and one, many packets) in one job:
    every member gets the sum; each aggregator saw the values its weight gives it."""
    world, sizes = 3, [1, E - 1, E, E + 1, 37 * E + 5, 3, 100_003]
    rng = np.random.default_rng(7)
    tensors = [[rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(world)]
    clients = sharded_clients(aggs, world, weights)
    results = run_and_close(clients, lambda r, c: [c.allreduce(t) for t in tensors[r]])
    for i, n in enumerate(sizes):
        exact = np.sum([tensors[r][i].astype(np.float64) for r in range(world)], axis=0)
        for r in range(world):
            assert results[r][i].shape == (n,)
            np.testing.assert_allclose(results[r][i], exact, atol=1e-4 * world)
    m = ShardMap(weights)
    for i, a in enumerate(aggs):
        want = sum(m.cuts(n, E)[i + 1] - m.cuts(n, E)[i] for n in sizes)
        got = a.job_stats(JOB).counters["elements"] // world
        # elements counts whole packets: a partition's tail chunk counts E
        chunks = sum(-(-(m.cuts(n, E)[i + 1] - m.cuts(n, E)[i]) // E) for n in sizes)
        assert want <= got <= chunks * E, (i, want, got)
        assert (got == 0) == (weights[i] == 0)


def test_async_calls_overlap_and_out_is_filled(aggs):
    world = 2
    x = [np.full(5 * E + 3, r + 1, np.float32) for r in range(world)]
    clients = sharded_clients(aggs[:2], world, (1, 1))

    def work(r, c):
        out = np.empty_like(x[r])
        h = c.allreduce_async(x[r], out=out)
        assert h.wait(30) is out
        assert list(h.n_contrib) == [world] * 6 and all(k is not None for k in h.rounds)
        return out
    results = run_and_close(clients, work)
    for r in range(world):
        np.testing.assert_array_equal(results[r], np.full(5 * E + 3, 3, np.float32))


def test_sharded_client_refuses_mismatched_aggregators(aggs):
    a = AggClient(aggs[0].address, JOB, 0, 2, bind=("127.0.0.1", 0))
    b = AggClient(aggs[1].address, JOB, 1, 2, bind=("127.0.0.1", 0))
    c = AggClient(aggs[0].address, JOB, 0, 2, bind=("127.0.0.1", 0))
    try:
        with pytest.raises(ValueError, match="same member"):
            ShardedClient([a, b])
        with pytest.raises(ValueError, match="appears twice"):
            ShardedClient([a, c])
        with pytest.raises(ValueError, match="2 weights for 1 aggregators"):
            ShardedClient([a], ShardMap((1, 1)))
    finally:
        for x in (a, b, c):
            x.close()


# -- every strategy -------------------------------------------------------------------------------

STRATEGIES = ["sync", "ssp:2", "wbsp", "quorum:6:50ms", "async"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_over_three_aggregators_loses_and_doubles_nothing(strategy):
    """8 members, three real user-space aggregators cut 1:2:1, tensors that shrink and grow, under
    each strategy. Small integer values, so quantisation is exact: every aggregator's released sums
    plus what it still holds (a quorum's carried contributions, async's rounds in progress) equal,
    exactly, the sum of every member's part of every tensor the map gave it, as one aggregator's
    would; and where every result holds every member (sync, ssp, wbsp) each is the exact sum. A
    quorum's late chunk that no bank can take is answered and dropped, counted ``uncarried``: with
    tensors of several sizes the slots keep each round for its stragglers (docs/protocol.md,
    "Tensors of different sizes"), so a straggler a slot's banks behind may find none free."""
    from aggd.core.model import BankState, JobConfig
    from aggd_client.protocol import Counter
    from aggd.core.strategy import parse, to_entry

    # 64 slots: more than any part has chunks (a quorum over more chunks than slots is docs/protocol.md's
    # known limit, not the cut's)
    world, weights, sizes = 8, (1, 2, 1), [1, E - 1, E, E + 1, 5 * E + 3, 3, 20_003]
    calls = [n for _ in range(3) for n in sizes]
    rng = np.random.default_rng(11)
    tensors = [[rng.integers(-8, 9, n).astype(np.float32) for n in calls] for _ in range(world)]
    with userspace_aggregators(3, E) as aggs:
        released = [0.0] * 3

        def observe(i):
            def on_release(job, bank, cause):
                released[i] += float(np.ldexp(bank.values.astype(np.float64), -bank.exponent).sum())
            return on_release

        per_rank = [[AggClient(a.address, JOB, r, world, bind=("127.0.0.1", 0), slots=64, give_up_after=20,
                               strategy=strategy, catch_up=False) for a in aggs] for r in range(world)]
        for i, a in enumerate(aggs):
            a.add_job(JobConfig(job=JOB, world=world, slots=64, max_chunks=1 << 20,
                                members={r: per_rank[r][i].address for r in range(world)}, elements=E,
                                strategy=parse(strategy)))
            a.model.on_release = observe(i)
        clients = [ShardedClient(cs, shard_map=ShardMap(weights)) for cs in per_rank]
        results = run_and_close(clients, lambda r, c: [c.allreduce(t) for t in tensors[r]], timeout=300)
        deadline = time.monotonic() + 5.0   # the last contributions may still be on their way
        m = ShardMap(weights)
        for i, a in enumerate(aggs):
            want = sum(float(tensors[r][k][m.cuts(n, E)[i]:m.cuts(n, E)[i + 1]].astype(np.float64).sum())
                       for r in range(world) for k, n in enumerate(calls))
            while True:
                with a._lock:
                    held = sum(float(np.ldexp(b.values.astype(np.float64), -b.exponent).sum())
                               for s in a.model.jobs[JOB].slots for b in s.banks if b.state == BankState.OPEN)
                    total = released[i] + held
                if total == want or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            uncarried = int(a.model.jobs[JOB].counters[Counter.UNCARRIED])
            if uncarried:   # each a chunk of at most E values of |x| <= 8
                assert abs(want - total) <= uncarried * E * 8, (strategy, i, released[i], held, want, uncarried)
            else:
                assert total == want, (strategy, i, released[i], held, want)
    if strategy in ("sync", "ssp:2", "wbsp"):
        for k, n in enumerate(calls):
            exact = np.sum([tensors[r][k].astype(np.float64) for r in range(world)], axis=0)
            for r in range(world):
                assert np.array_equal(results[r][k], exact), (strategy, r, k)


def test_the_leader_probes_a_failed_aggregator_and_brings_it_back(aggs):
    """probe_every: the leader JOINs a failed-over aggregator in the background, first
    ``probe_every`` s after the failover, then as often until it answers; an aggregator that failed
    twice is probed half as often. Once one answers, the next agreed map brings it back."""
    from tests.harness.ranks import DictStore
    a = AggClient(aggs[0].address, JOB, 0, 1, bind=("127.0.0.1", 0))
    b = AggClient(aggs[1].address, JOB, 0, 1, bind=("127.0.0.1", 0))
    answers, asked = [False, True], []

    def rejoin(i):
        asked.append(i)
        if not answers.pop(0):
            raise TimeoutError("no JOIN_ACK")
        return None

    client = ShardedClient([a, b], store=DictStore(), rebalance_every=1, failover_after=1.0,
                           rejoin=rejoin, probe_every=0.05)
    try:
        client.dead.add(1)                       # as _fail_over leaves it
        client._failures[1] = 1
        client._probe_failed()
        assert not asked and client._probe_due[1] > time.monotonic()    # not before probe_every

        def probe_when_due():
            time.sleep(max(0.0, client._probe_due[1] - time.monotonic()))
            client._probe_failed()
            deadline = time.monotonic() + 5
            while 1 in client._probing and time.monotonic() < deadline:
                time.sleep(0.005)

        probe_when_due()                          # unanswered: due again a probe_every later
        assert asked == [1] and not client._revive
        probe_when_due()                          # answered: revived at the next agreed call
        assert asked == [1, 1] and client._revive == {1: None}
        # until that call, no more probes: a JOIN answered after the revival's own would move this
        # member's address to the probe's port, and the aggregator would refuse its data
        time.sleep(0.06)
        client._probe_failed()
        assert asked == [1, 1] and not client._probing and 1 not in client._probe_due
        client._failures[1] = 2                   # a host that failed twice: half as often
        assert client._probe_gap(1) == pytest.approx(0.1)
        with pytest.raises(ValueError, match="probe_every"):
            ShardedClient([a, b], probe_every=0)
    finally:
        client._revive.clear()
        a.close()
        b.close()
