"""ErrorFeedback (aggd_client.feedback): error reset delivers every bit of the inputs over a reset
period, residuals persist and stay bounded without reset, keys are bounded (LRU); the torch
settings that turn it on."""
from __future__ import annotations

import numpy as np
import pytest

from aggd_client import AggClient, quant
from aggd_client.feedback import ErrorFeedback
from aggd_client.protocol.definition import Precision

from tests.harness.fake_aggregator import JOB, PrecisionFake
from tests.harness.ranks import run_ranks

E = 64


def run_members(fake, world, fn, *, precision=8, **kw):
    """``fn(rank, ErrorFeedback)`` in one thread per member; their return values."""
    clients = [AggClient(fake.address, JOB, r, world, bind=("127.0.0.1", 0), elements=E,
                         precision=precision, seed=100 + r, give_up_after=10.0) for r in range(world)]
    try:
        return run_ranks(clients, lambda r, c: fn(r, ErrorFeedback(c, **kw)), timeout=60)
    finally:
        for c in clients:
            c.close()


def inputs(world, calls, size, seed=0):
    rng = np.random.default_rng(seed)
    # values spread over decades: int8 rounds the small ones to 0 or one step
    return [[(rng.standard_normal(size) * np.exp(rng.uniform(-6, 0, size))).astype(np.float32)
             for _ in range(calls)] for _ in range(world)]


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("precision", [8, 16])
def test_reset_delivers_the_sum_of_the_inputs(op, precision):
    world, H, size = 4, 5, 3 * E + 11
    xs = inputs(world, 2 * H, size, seed=precision)

    def member(r, ef):
        got = [ef.allreduce(x, key="grad", op=op) for x in xs[r]]
        return got, ef.stats.copy(), ef.residual("grad").copy()

    with PrecisionFake(world, quant.precision_of(precision)) as fake:
        out = run_members(fake, world, member, precision=precision, reset_every=H)
    div = world if op == "mean" else 1
    for period in range(2):
        calls = slice(period * H, (period + 1) * H)
        exact = np.sum([np.sum([x.astype(np.float64) for x in xs[r][calls]], axis=0) for r in range(world)],
                       axis=0) / div
        for got, stats, residual in out:
            delivered = np.sum([g.astype(np.float64) for g in got[calls]], axis=0)
            # within one residual quantisation error: each member's residual is below two steps u
            # of its last call (its rounding, the alignment), u <= 2 max|c| / Q with c = x + r
            # (|r| a few steps: max|c| <= 1.1 max|x|); the reset round quantises residuals with
            # steps u' <= 4u / Q and loses at most 2 * world * u' (quant.error_bound)
            Q = quant.q_max(world, precision=quant.precision_of(precision))
            u = 2 * 1.1 * max(np.abs(xs[r][calls][-1]).max() for r in range(world)) / Q
            reset_error = 2 * world * 4 * u / Q
            rounding = H * np.spacing(np.abs(np.float32(delivered))).astype(np.float64)
            err = np.abs(delivered - exact)
            assert (err <= reset_error / div + rounding + 1e-12).all(), err.max()
            # and far better than the error of the calls without feedback would allow
            assert stats["resets"] == 2 and stats["keys"] == 1
            assert not residual.any()  # the last call was a reset
    for got, _, _ in out[1:]:  # every member applied the same values
        for a, b in zip(got, out[0][0]):
            assert np.array_equal(a, b)


def test_without_reset_residuals_persist_and_stay_bounded():
    world, calls, size = 3, 12, 2 * E
    xs = inputs(world, calls, size, seed=5)

    def member(r, ef):
        res = []
        for x in xs[r]:
            ef.allreduce(x, key=0)
            res.append(ef.residual(0).copy())
        return res, ef.stats.copy()

    with PrecisionFake(world, Precision.INT8) as fake:
        out = run_members(fake, world, member, precision=8, reset_every=None)
    for r, (res, stats) in enumerate(out):
        assert stats["resets"] == 0 and stats["calls"] == calls
        assert any(a.any() for a in res)  # something is carried
        for k, resid in enumerate(res):
            # below one step of the corrected value's chunk, plus one of the alignment
            corrected_max = np.abs(xs[r][k]).max() + np.abs(res[k - 1]).max() if k else np.abs(xs[r][k]).max()
            assert np.abs(resid).max() <= 2 * corrected_max * 2.0 ** -5


def test_feedback_beats_no_feedback_over_many_calls():
    world, calls, size = 2, 16, E
    xs = inputs(world, calls, size, seed=9)
    exact = np.sum([np.sum([x.astype(np.float64) for x in xs[r]], axis=0) for r in range(world)], axis=0)

    def with_ef(r, ef):
        return np.sum([ef.allreduce(x, key=1) for x in xs[r]], axis=0, dtype=np.float64)

    def without(r, ef):
        return np.sum([ef.client.allreduce(x) for x in xs[r]], axis=0, dtype=np.float64)

    with PrecisionFake(world, Precision.INT8) as fake:
        a = run_members(fake, world, with_ef, precision=8, reset_every=calls)
    with PrecisionFake(world, Precision.INT8) as fake:
        b = run_members(fake, world, without, precision=8, reset_every=None)
    assert np.abs(a[0] - exact).max() * 20 < np.abs(b[0] - exact).max()


def test_keys_are_bounded_lru():
    world = 1
    sizes = [3, 5, 7, 9]

    def member(r, ef):
        for s in sizes:                      # 4 keys into room for 3: key 3 dropped
            ef.allreduce(np.full(s, 0.1, np.float32), key=s)
        ef.allreduce(np.full(5, 0.1, np.float32), key=5)  # 5 is now the newest
        ef.allreduce(np.full(11, 0.1, np.float32), key=11)  # drops 7, the least recently used
        with pytest.raises(ValueError, match="key 5"):
            ef.allreduce(np.ones(6, np.float32), key=5)
        return [k for k in (3, 5, 7, 9, 11) if ef.residual(k) is not None], ef.stats.copy()

    with PrecisionFake(world, Precision.INT8) as fake:
        (kept, stats), = run_members(fake, world, member, precision=8, reset_every=None, max_keys=3)
    assert kept == [5, 9, 11]
    assert stats["keys"] == 3 and stats["evicted"] == 2


def test_default_key_and_int32_client_and_bad_arguments():
    with pytest.raises(ValueError):
        ErrorFeedback(object(), reset_every=-1)

    def member(r, ef):
        x = np.linspace(-1, 1, 100).astype(np.float32)
        y = ef.allreduce(x)
        assert y.dtype == np.float32 and y.shape == x.shape
        out = np.empty_like(x)
        assert ef.allreduce(x, out=out) is out
        return ef.residual((100, x.dtype.str)) is not None

    with PrecisionFake(1, Precision.INT32) as fake:
        assert run_members(fake, 1, member, precision=32, reset_every=2) == [True]


def test_torch_settings_for_error_feedback():
    settings = pytest.importorskip("aggd_client.torch.settings")
    base = {"server": "h:1", "job": "j", "token": "t"}
    s = settings.Settings.resolve(base, environ={})
    assert s.error_feedback is None and s.error_reset == 16
    assert s.feedback_for(8) and s.feedback_for(16) and not s.feedback_for(32)
    s = settings.Settings.resolve(base, environ={"AGGD_ERROR_FEEDBACK": "off", "AGGD_ERROR_RESET": "4"})
    assert not s.feedback_for(8) and s.error_reset == 4
    s = settings.Settings.resolve({**base, "error_feedback": "on", "error_reset": 0}, environ={})
    assert s.feedback_for(32) and s.error_reset == 0
    with pytest.raises(settings.SettingsError, match="AGGD_ERROR_FEEDBACK"):
        settings.Settings.resolve(base, environ={"AGGD_ERROR_FEEDBACK": "maybe"})
    with pytest.raises(settings.SettingsError, match="error_reset"):
        settings.Settings.resolve({**base, "error_reset": "-2"}, environ={})


def test_ddp_hook_state_enables_feedback_for_narrow_jobs():
    pytest.importorskip("torch")
    from aggd_client.torch_hook import AggdHookState

    class Fake:
        def __init__(self, p):
            self.precision = p

    assert AggdHookState(Fake(Precision.INT8)).feedback is not None
    assert AggdHookState(Fake(Precision.INT16), reset_every=4).feedback.reset_every == 4
    assert AggdHookState(Fake(Precision.INT32)).feedback is None
    assert AggdHookState(Fake(Precision.INT8), error_feedback=False).feedback is None
