"""AggClient against the real user-space aggregator (aggd.dataplane.userspace.server) on 127.0.0.1.

Skipped when the daemon package is not installed: the client does not depend on it.
"""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from aggd_client import AggClient, NotMemberError, UnknownJobError, quant

userspace = pytest.importorskip("aggd.dataplane.userspace.server")
model = pytest.importorskip("aggd.core.model")

JOB = 11
E = 256


def reduce_all(agg, world, arrays, *, rounds=2, op="sum", group=None, slots=16, **kw):
    clients = [AggClient(agg.address, JOB, r, world, bind=("127.0.0.1", 0), slots=slots,
                         group=group, give_up_after=10.0, **kw) for r in range(world)]
    try:
        agg.add_job(model.JobConfig(job=JOB, world=world, slots=slots, max_chunks=1 << 20,
                                    members={r: c.address for r, c in enumerate(clients)},
                                    group=group, elements=E))
        out: list = [None] * world
        errs: list = [None] * world

        def work(r):
            try:
                out[r] = [clients[r].allreduce(arrays[r], op=op) for _ in range(rounds)]
            except BaseException as e:  # noqa: BLE001
                errs[r] = e

        threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for e in errs:
            if e is not None:
                raise e
        return out, clients
    finally:
        for c in clients:
            c.close()


def bound_for(arrays, world):
    flat = [a.ravel() for a in arrays]
    exps = np.stack([quant.quantise_flat(f, world, E)[1] for f in flat]).min(axis=0)
    b = np.repeat(quant.error_bound(world, exps), E)[:flat[0].size]
    return b + world * np.spacing(np.sum([np.abs(f.astype(np.float64)) for f in flat], axis=0))


@pytest.fixture
def agg(userspace_agg):
    return userspace_agg(E)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sum_through_userspace_aggregator(agg, dtype):
    world = 3
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(100 * E + 9).astype(dtype) for _ in range(world)]
    out, clients = reduce_all(agg, world, arrays, rounds=2)
    exact = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    bound = bound_for(arrays, world)
    for rs in out:
        for res in rs:
            assert res.dtype == np.dtype(dtype)
            assert (np.abs(res - exact) <= bound + quant.output_rounding(res)).all()
    drops = agg.stats()["jobs"][JOB]["drops"]
    assert drops["busy"] == 0 and drops["stale"] == 0  # the window keeps the slot rule


def test_mean_through_userspace_aggregator(agg):
    world = 2
    arrays = [np.full(E + 1, 1.0), np.full(E + 1, 2.0)]
    out, _ = reduce_all(agg, world, arrays, op="mean", rounds=1)
    assert np.array_equal(out[0][0], np.full(E + 1, 1.5))


def test_multicast_results_from_userspace_aggregator(agg):
    world = 2
    group = ("239.78.0.%d" % random.randint(1, 250), random.randint(40000, 60000))
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(5 * E).astype(np.float32) for _ in range(world)]
    out, _ = reduce_all(agg, world, arrays, group=group)
    exact = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    bound = bound_for(arrays, world)
    for rs in out:
        for res in rs:
            assert (np.abs(res - exact) <= bound + quant.output_rounding(res)).all()


def test_nacks_from_userspace_aggregator(agg):
    with AggClient(agg.address, JOB + 1, 0, 1, bind=("127.0.0.1", 0)) as c:
        with pytest.raises(UnknownJobError):
            c.allreduce(np.ones(3, np.float32))
    agg.add_job(model.JobConfig(job=JOB, world=2, slots=4, max_chunks=16,
                                members={0: ("127.0.0.1", 1), 1: ("127.0.0.1", 2)}, elements=E))
    with AggClient(agg.address, JOB, 1, 2, bind=("127.0.0.1", 0)) as c:
        with pytest.raises(NotMemberError):
            c.allreduce(np.ones(3, np.float32))


def test_client_waits_for_answers_to_pile_up_only_when_many_are_due(agg, monkeypatch):
    """With a full window and answers trickling in, a client naps BATCH_WAIT before reading again
    (fewer passes of its loop); with fewer than 4 * SMALL_BATCH packets awaiting answers it never
    does, so a small allreduce keeps its latency."""
    import sys

    import aggd_client.client as cl

    naps: list[int] = []  # packets in flight of the napping client at each nap
    real_sleep = cl.time.sleep

    def recording_sleep(seconds):
        caller = sys._getframe(1).f_locals.get("self")
        if isinstance(caller, cl.AggClient):
            naps.append(sum(s.inflight for s in caller._sends))
        real_sleep(seconds)

    monkeypatch.setattr(cl.time, "sleep", recording_sleep)
    world = 3
    rng = np.random.default_rng(2)
    small = [rng.standard_normal(40 * E).astype(np.float32) for _ in range(world)]
    out, clients = reduce_all(agg, world, small, rounds=3, slots=512)
    assert all(c.stats["batch_waits"] == 0 for c in clients) and not naps  # never 64 in flight

    agg.remove_job(JOB)
    big = [rng.standard_normal(3000 * E).astype(np.float32) for _ in range(world)]
    out, clients = reduce_all(agg, world, big, rounds=2, slots=512, window=256)
    exact = np.sum([a.astype(np.float64) for a in big], axis=0)
    bound = bound_for(big, world)
    for rs in out:
        for res in rs:
            assert (np.abs(res - exact) <= bound + quant.output_rounding(res)).all()
    assert sum(c.stats["batch_waits"] for c in clients) == len(naps) > 0
    assert min(naps) >= 4 * cl.SMALL_BATCH
