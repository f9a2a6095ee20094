"""Narrow precisions end to end: 4 AggClients at int8 and int16 against the real user-space
aggregator (aggd.dataplane.userspace.server) on 127.0.0.1, under sync and quorum, tensors of one
value, less than a packet, several packets and of unequal sizes across calls; every result within
``quant.error_bound(..., precision=...)`` of the exact float64 sum. Error feedback through it too.

Skipped when the daemon package is not installed: the client does not depend on it.
"""
from __future__ import annotations


import time

import numpy as np
import pytest

from aggd_client import AggClient, quant
from aggd_client.feedback import ErrorFeedback
from aggd_client.protocol.definition import Precision, StrategyKind

from tests.harness.ranks import run_ranks

userspace = pytest.importorskip("aggd.dataplane.userspace.server")
model = pytest.importorskip("aggd.core.model")
strategy = pytest.importorskip("aggd.core.strategy")

JOB = 17
E = 128
WORLD = 4
SIZES = [1, E - 9, 4 * E + 3, 7, 2 * E]   # unequal sizes across calls


@pytest.fixture
def agg(userspace_agg):
    return userspace_agg(E)


def run(agg, precision: Precision, text: str, fn, **kw):
    """``fn(rank, client)`` for every member in threads, on a job of ``precision`` under ``text``."""
    kw.setdefault("give_up_after", 10.0)
    clients = [AggClient(agg.address, JOB, r, WORLD, bind=("127.0.0.1", 0), elements=E, slots=16,
                         precision=precision, seed=r, strategy=text.rsplit(":", 1)[0] if
                         text.startswith("quorum") else text, catch_up=False, **kw)
               for r in range(WORLD)]
    try:
        agg.add_job(model.JobConfig(job=JOB, world=WORLD, slots=16, max_chunks=1 << 16,
                                    members={r: c.address for r, c in enumerate(clients)},
                                    elements=E, strategy=strategy.parse(text), precision=precision))
        out = run_ranks(clients, fn, timeout=60)
    finally:
        for c in clients:
            c.close()
    drops = {k: v for k, v in agg.stats()["jobs"][JOB]["drops"].items() if v}
    assert "bad_precision" not in drops
    return out


def arrays_for(call: int, size: int):
    rng = np.random.default_rng(1000 * call + size)
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for _ in range(WORLD)]


def bound(arrays, precision, terms):
    flat = [a.ravel() for a in arrays]
    exact = np.sum([f.astype(np.float64) for f in flat], axis=0)
    exps = np.stack([quant.quantise_flat(f, WORLD, E, precision=precision, terms=terms)[1]
                     for f in flat]).min(axis=0)
    b = np.repeat(quant.error_bound(WORLD, exps, precision=precision), E)[:exact.size]
    return exact, b + WORLD * np.spacing(np.sum([np.abs(f.astype(np.float64)) for f in flat], axis=0))


@pytest.mark.parametrize("text", ["sync", "quorum:4:5s"])
@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT16])
def test_narrow_sums_through_userspace_aggregator(agg, precision, text):
    kind = StrategyKind.QUORUM if text.startswith("quorum") else StrategyKind.SYNC
    terms = quant.terms_for(WORLD, kind)
    calls = [arrays_for(i, s) for i, s in enumerate(SIZES)]

    def member(r, c):
        return [c.allreduce(arrays[r]) for arrays in calls]

    out = run(agg, precision, text, member)
    for i, arrays in enumerate(calls):
        exact, b = bound(arrays, precision, terms)
        for rs in out:
            res = rs[i]
            assert res.dtype == np.float32 and res.shape == arrays[0].shape
            err = np.abs(res.astype(np.float64) - exact)
            allowed = b + quant.output_rounding(res)
            assert (err <= allowed).all(), (i, err.max(), allowed[np.argmax(err - allowed)])
        for rs in out[1:]:
            assert np.array_equal(rs[i], out[0][i])


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT16])
def test_error_feedback_reset_through_userspace_aggregator(agg, precision):
    H = 4
    rng = np.random.default_rng(int(precision))
    calls = []
    for i in range(H):
        # the members' chunks share their largest magnitude 6 = 0.75 * 2**3, hence their exponents
        # (with the residuals added, 6 scaled stays clear of Q), as gradients of one model mostly
        # do: the aggregator then aligns nothing, and every member's residual is exactly what the
        # result lacks of its values (with differing exponents the aggregator floors partial sums,
        # which no member's residual can see: see aggd_client.feedback)
        arrays = [np.clip(rng.standard_normal(3 * E + 1), -5.5, 5.5).astype(np.float32) for _ in range(WORLD)]
        for a in arrays:
            a[::E] = 6.0
        calls.append(arrays)

    def member(r, c):
        ef = ErrorFeedback(c, reset_every=H)
        return [ef.allreduce(arrays[r], key="g") for arrays in calls], ef.stats["resets"]

    out = run(agg, precision, "sync", member)
    exact = np.sum([np.sum([a.astype(np.float64) for a in arrays], axis=0) for arrays in calls], axis=0)
    Q = quant.q_max(WORLD, precision=precision)
    u = 2 * 1.1 * max(np.abs(a).max() for a in calls[-1]) / Q   # a step of the last call
    for got, resets in out:
        assert resets == 1
        delivered = np.sum([g.astype(np.float64) for g in got], axis=0)
        rounding = H * np.spacing(np.abs(delivered).astype(np.float32)).astype(np.float64)
        assert (np.abs(delivered - exact) <= 2 * WORLD * 4 * u / Q + rounding).all()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-scales", "own-scales"])
@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT16])
def test_error_feedback_with_members_of_different_scales(agg, precision, shared):
    """One member's gradients are 8 times the others' (a coarser exponent in every chunk) and it
    comes last, so the aggregator floors the others' partial sum when it arrives. With the shared
    scale (aggd_client.scales) nothing is aligned after the first call, and what the calls
    delivered stays within a few steps of the inputs over three reset periods; with each member's
    own scale it drifts away by some tenths of a step a call, which no reset takes back."""
    H, periods = 16, 3
    rng = np.random.default_rng(7 + int(precision))
    calls = [[(rng.standard_normal(2 * E + 5) * (8.0 if r == WORLD - 1 else 1.0)).astype(np.float32)
              for r in range(WORLD)] for _ in range(H * periods)]

    def member(r, c):
        ef = ErrorFeedback(c, reset_every=H, shared_scales=shared)
        got = []
        for arrays in calls:
            if r == WORLD - 1:
                time.sleep(0.003)  # after the others
            got.append(ef.allreduce(arrays[r], key="g"))
        return got, ef.last_handle

    out = run(agg, precision, "sync", member)
    (got, h) = out[0]
    # in steps of the last call's results (their exponents: the coarse member's)
    step = np.repeat(np.ldexp(1.0, -h.scales.shared.astype(np.int64)), E)[:calls[0][0].size]
    drift = []   # |delivered - inputs| at the end of each reset period, in steps
    for p in range(1, periods + 1):
        exact = np.sum([np.sum([a.astype(np.float64) for a in arrays], axis=0) for arrays in calls[:p * H]], axis=0)
        delivered = np.sum([g.astype(np.float64) for g in got[:p * H]], axis=0)
        drift.append(np.abs(delivered - exact) / step)
    print(f"{precision.name} shared={shared}: mean drift by period", [f"{d.mean():.2f}" for d in drift])
    if shared:   # the first call's alignment (at most world - 2 steps floored less), and no more
        assert all(d.max() <= WORLD - 2 + 0.1 for d in drift)
        assert drift[-1].mean() <= drift[0].mean() + 0.1
    else:
        assert drift[-1].mean() > drift[0].mean() + 5
