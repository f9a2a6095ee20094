"""The rebalancing policy of a sharded job (aggd_client.shard_policy) against reference sequences,
and the agreement on its maps through a shared store (ShardedClient with real user-space
aggregators; the lab test with torch's TCPStore: tests/netns/test_sharded.py)."""
from __future__ import annotations

import numpy as np
import pytest

from aggd_client.shard_map import ShardMap
from aggd_client.shard_policy import RebalancePolicy

E = 256


def observe(p, rates, values=(1000, 1000, 1000)):
    k = p.k
    p.observe(values[:k], [v / r for v, r in zip(values[:k], rates)])


def test_reference_sequence_two_aggregators():
    p = RebalancePolicy(2, alpha=1.0, tolerance=0.25, patience=2)
    m = ShardMap((1, 1))
    d = p.decide(m)
    assert d.shard_map is None and "no service rate yet for aggregators 0, 1" in d.reason
    observe(p, (100, 90))                                  # within tolerance
    d = p.decide(m)
    assert d.shard_map is None and d.reason.startswith("balanced")
    observe(p, (300, 100))                                 # aggregator 1 three times slower ...
    d = p.decide(m)
    assert d.shard_map is None and "1 of 2 checks" in d.reason and "aggregator 1's part" in d.reason
    observe(p, (300, 100))                                 # ... twice running: move
    d = p.decide(m)
    assert d.shard_map == ShardMap((750, 250), 1)
    assert "weights (1, 1) -> (750, 250)" in d.reason
    m = d.shard_map
    observe(p, (300, 100))                                 # the new map fits the rates
    assert p.decide(m).shard_map is None
    observe(p, (100, 100))                                 # aggregator 1 recovers: back to even
    assert p.decide(m).shard_map is None                   # (patience)
    observe(p, (100, 100))
    assert p.decide(m).shard_map == ShardMap((500, 500), 2)


def test_noise_moves_nothing():
    p = RebalancePolicy(2, alpha=1.0, patience=2)
    m = ShardMap((1, 1))
    for i in range(20):                                    # one slow check at a time, alternating
        observe(p, (300, 100) if i % 2 else (100, 100))
        assert p.decide(m).shard_map is None


def test_floor_and_drained_aggregators():
    p = RebalancePolicy(3, alpha=1.0, patience=1, floor=0.02)
    m = ShardMap((1, 1, 0))                                # aggregator 2 drained
    observe(p, (1000, 10, 5000))
    d = p.decide(m)
    assert d.shard_map.weights == (980, 20, 0)             # the slow one keeps the floor; 2 stays out
    assert p.decide(ShardMap((1, 0, 0))).reason == "one aggregator in use: nothing to balance"


def test_a_new_aggregator_is_measured_before_it_moves_anything():
    p = RebalancePolicy(2, alpha=1.0, patience=1)
    observe(p, (100, 100))
    p.grow()
    d = p.decide(ShardMap((1, 1, 1)))
    assert d.shard_map is None and d.reason == "no service rate yet for aggregator 2"
    observe(p, (100, 100, 300))
    assert p.decide(ShardMap((1, 1, 1))).shard_map.weights == (200, 200, 600)


def test_smoothing_and_checks():
    p = RebalancePolicy(2, alpha=0.5)
    observe(p, (100, 100))
    observe(p, (300, 100))
    # one size of part: values over seconds of the weighted observations, 750 / (2.5 + 5 / 3)
    assert p.rates == pytest.approx([180.0, 100.0])
    p.observe([0, 1000], [0.0, 10.0])                      # no part on aggregator 0: its rate stays
    assert p.rates == pytest.approx([180.0, 100.0])
    with pytest.raises(ValueError, match="one observation an aggregator"):
        p.observe([1], [1.0])
    with pytest.raises(ValueError, match="3 weights for 2"):
        p.decide(ShardMap((1, 1, 1)))
    with pytest.raises(ValueError):
        RebalancePolicy(2, floor=0.6)


# -- agreement through a store --------------------------------------------------------------------

def test_members_switch_maps_at_the_same_call(monkeypatch):
    """Two members over two real user-space aggregators, the leader's policy made to see aggregator 1
    as slow: every call of both members is cut by the same map, the switch lands at a multiple of
    rebalance_every, and every sum is right."""
    pytest.importorskip("aggd.dataplane.userspace.server")   # the client alone has no aggregator
    from tests.harness.ranks import DictStore, run_and_close, sharded_members, userspace_aggregators

    with userspace_aggregators(2, E) as aggs:
        world = 2
        clients = sharded_members(aggs, 5, world, E, store=DictStore(), rebalance_every=3)
        slow = clients[0].policy                          # the leader's: aggregator 1 seen 4x slower
        real = slow.observe
        monkeypatch.setattr(slow, "observe", lambda v, s: real(v, [s[0], s[1] * 4]))
        x = [np.arange(40 * E, dtype=np.float32) * (r + 1) for r in range(world)]

        def work(r, c):
            maps = []
            for _ in range(12):
                h = c.allreduce_async(x[r])
                np.testing.assert_array_equal(h.wait(30), x[0] * 3)
                maps.append(h.shard_map)
            return maps, c.history
        out = run_and_close(clients, work)
    (maps0, hist0), (maps1, hist1) = out
    assert maps0 == maps1 and hist0 == hist1
    switched = [call for call, m, _ in hist0[1:]]
    assert switched and all(c % 3 == 0 for c in switched)
    assert maps0[-1].weights[0] > 2 * maps0[-1].weights[1], hist0


def test_the_leader_drains_an_aggregator_by_its_weights():
    """Scale in: the leader sets aggregator 1's weight to 0; from the next agreed call no member
    gives it a part."""
    pytest.importorskip("aggd.dataplane.userspace.server")
    from tests.harness.ranks import DictStore, run_and_close, sharded_members, userspace_aggregators

    with userspace_aggregators(2, E) as aggs:
        clients = sharded_members(aggs, 5, 2, E, store=DictStore(), rebalance_every=2)
        with pytest.raises(ValueError, match="only the leader"):
            clients[1].set_weights((1, 0))
        x = np.ones(10 * E, np.float32)

        def work(r, c):
            weights = []
            for call in range(8):
                if r == 0 and call == 3:
                    c.set_weights((1, 0))
                np.testing.assert_array_equal(c.allreduce(x), x * 2)
                weights.append(c.shard_map.weights)
            return weights
        out = run_and_close(clients, work)
        assert out[0] == out[1] and out[0][:4] == [(1, 1)] * 4 and out[0][4:] == [(1, 0)] * 4, out
        drained = aggs[1].job_stats(5).counters["released"]
        assert drained == 4 * 5   # 5 chunks a call on aggregator 1 in calls 0-3, none after


def test_a_fixed_cost_a_call_does_not_run_the_map_away():
    """Two equal aggregators (1 ms a call plus a million values a second) and small tensors of
    mixed sizes, cut by the map in force: values over seconds counted the fixed cost against the
    one with the smaller part, whose rate fell the less it had (a user saw 978:22). The fitted
    slope gives both the same rate, and the map stays even."""
    p = RebalancePolicy(2)
    current = ShardMap((1, 1))
    for call in range(400):
        n = (362, 2048, 5000, 1024)[call % 4]
        parts = [round(n * w / sum(current.weights)) for w in current.weights]
        p.observe(parts, [0.001 + v / 1e6 if v else 0.0 for v in parts])
        if call % 4 == 3:
            decided = p.decide(current)
            current = decided.shard_map or current
    assert current.version == 0 and p.rates == pytest.approx([1e6, 1e6], rel=1e-6)


def test_the_slope_sees_through_unequal_fixed_costs():
    """Aggregator 1 is twice as fast but 5 ms further away: its parts' rate is its bandwidth, and
    the map gives it two thirds."""
    p = RebalancePolicy(2, patience=1)
    for call in range(40):
        n = (2000, 20000)[call % 2]
        p.observe([n, n], [n / 1e6, 0.005 + n / 2e6])
    assert p.rates == pytest.approx([1e6, 2e6])
    assert p.decide(ShardMap((1, 1))).shard_map.weights == (333, 667)
