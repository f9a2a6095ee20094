"""quant at int16 and int8: the range, stochastic rounding's bias, the error bound, int16 sums."""
from __future__ import annotations

import numpy as np
import pytest

from aggd_client import quant
from aggd_client.protocol.definition import LANES, ZERO_EXPONENT, Precision, StrategyKind

NARROW = [Precision.INT16, Precision.INT8]
Q4 = {Precision.INT16: 32767, Precision.INT8: 127}


@pytest.mark.parametrize("p", NARROW)
@pytest.mark.parametrize("kind", list(StrategyKind))
def test_every_q_within_Q_under_every_headroom(p, kind):
    world = 4
    terms = quant.terms_for(world, kind)
    for headroom in range(1, quant.MAX_HEADROOM + 1):
        for t in (terms, world * headroom):
            Q = quant.q_max(world, t, p)
            assert Q == Q4[p], (p, t)  # 4 members fit every headroom at full range
            rng = np.random.default_rng(t)
            x = rng.standard_normal((7, 33)) * np.array([1e-300, 1e-5, 1, 3e5, 1e300, 0, 1])[:, None]
            x[5] = 0
            x[6, 3] = -1e308
            q, e = quant.quantise(x, world, terms=t, precision=p, rng=rng)
            assert q.dtype == np.dtype(LANES[p].contrib)
            assert np.abs(q.astype(np.int64)).max() <= Q
            assert e[5] == ZERO_EXPONENT and not q[5].any()
            # the largest magnitude of each chunk is within one step of Q (the range is used)
            assert (np.abs(q[[0, 1, 2, 3, 4, 6]].astype(np.int64)).max(axis=1) >= Q // 2).all()


@pytest.mark.parametrize("p", NARROW)
@pytest.mark.parametrize("value", [0.3, -0.7071, 1 / 3])
def test_stochastic_rounding_is_unbiased(p, value):
    world = 4
    rng = np.random.default_rng(7)
    # many chunks of (1.0, value): the 1.0 sets the exponent, so value * 2**e is not whole
    n = 200_000
    block = np.stack([np.ones(n), np.full(n, value)], axis=1)  # (n chunks, 2 elements)
    q, e = quant.quantise(block, world, precision=p, rng=rng)
    scaled = value * np.ldexp(1.0, int(e[0]))
    assert scaled != np.floor(scaled)  # a real rounding
    got = q[:, 1].astype(np.float64)
    assert set(np.unique(got)) <= {np.floor(scaled), np.floor(scaled) + 1}
    mean = got.mean()
    # standard error of a Bernoulli mean: <= 0.5 / sqrt(n); 5 sigma
    assert abs(mean - scaled) < 5 * 0.5 / np.sqrt(n), (mean, scaled)


@pytest.mark.parametrize("p", NARROW)
@pytest.mark.parametrize("kind", [StrategyKind.SYNC, StrategyKind.QUORUM, StrategyKind.WBSP])
def test_error_bound_holds_on_random_and_extreme_data(p, kind):
    world = 4
    terms = quant.terms_for(world, kind)
    rng = np.random.default_rng(int(p) * 10 + int(kind))
    E = 32
    tiny, huge = float(np.ldexp(1.0, -1074)), float(np.finfo(np.float64).max) / 8
    scales = [1.0, 1e-3, 1e6, 1e-310, 1e300]
    for trial in range(12):
        x = np.stack([rng.standard_normal((6, E)) * scales[trial % len(scales)] for _ in range(world)])
        x[:, 0] = 0.0                       # an all-zero chunk
        x[0, 1, 0] = huge                   # the largest floats
        x[1, 1, 1] = -huge
        x[2, 2, 0] = tiny                   # the smallest (subnormal)
        x[3, 2, 1] = -tiny
        x[:, 3, ::2] = 0.0                  # zeros among values
        qs, es = zip(*[quant.quantise(x[m], world, terms=terms, precision=p, rng=rng) for m in range(world)])
        total, e_min = quant.align_and_sum(np.stack(qs), np.stack(es))
        assert np.abs(total).max() <= LANES[p].result_max
        got = quant.dequantise(total, e_min)
        exact = x.sum(axis=0)
        b = quant.error_bound(world, e_min, precision=p)[:, None]
        slack = world * np.spacing(np.abs(x).sum(axis=0))
        assert (np.abs(got - exact) <= b + slack).all()
        assert (got[0] == 0).all()


def test_256_int8_terms_at_Q127_sum_within_int16():
    assert quant.q_max(1, 256, Precision.INT8) == 127  # 256 * 127 = 32512 <= 32767
    assert quant.q_max(1, 258, Precision.INT8) == 127
    assert quant.q_max(1, 259, Precision.INT8) < 127
    n = 256
    q = np.full((n, 3, 16), 127, np.int8)
    q[:, 1] = -127
    q[:, 2, ::2] = -127
    e = np.full((n, 3), 5, np.int32)
    total, e_min = quant.align_and_sum(q, e)
    assert total.max() == 256 * 127 <= np.iinfo(np.int16).max
    assert total.min() == -256 * 127 >= np.iinfo(np.int16).min
    assert (e_min == 5).all()
    # with mixed exponents (shifts are floors of negative values: -1) still within int16
    e2 = e.copy()
    e2[::2] = 9
    total2, _ = quant.align_and_sum(q, e2)
    assert np.abs(total2).max() <= np.iinfo(np.int16).max


def test_precision_of():
    assert quant.precision_of(8) == Precision.INT8
    assert quant.precision_of("int16") == Precision.INT16
    assert quant.precision_of(Precision.INT32) == Precision.INT32
    with pytest.raises(ValueError):
        quant.precision_of(4)
