"""Quantisation (aggd_client.quant) against docs/protocol.md, with exact rational arithmetic.

The aggregator is simulated with ``quant.align_and_sum`` (align each contribution to the chunk's
smallest exponent by an arithmetic right shift, i.e. a floor, then add); its own correctness is
checked against a pure-Python floor-division model first.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aggd_client import quant
from aggd_client.protocol.definition import ZERO_EXPONENT

INT32_MAX = 2**31 - 1
FLOATS = {16: np.float16, 32: np.float32, 64: np.float64}


def exact(v) -> Fraction:
    return Fraction(float(v))


def py_round_half_even(fr: Fraction) -> int:
    return round(fr)  # Fraction.__round__ rounds half to even


# -- the exponent and the rounding ------------------------------------------------------------

@given(m=st.floats(min_value=0, allow_nan=False, allow_infinity=False),
       world=st.integers(1, 64))
def test_exponent_is_the_largest_that_fits(m, world):
    q = quant.q_max(world)
    assert q == INT32_MAX // world
    e = int(quant.chunk_exponents(np.array([m]), world)[0])
    if m == 0:
        assert e == ZERO_EXPONENT
        return
    scaled = Fraction(m) * Fraction(2) ** e
    assert scaled <= q < scaled * 2
    assert -32768 < e < ZERO_EXPONENT  # fits the signed 16-bit header field


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.sampled_from([16, 32, 64]), world=st.integers(1, 64), data=st.data())
def test_quantise_matches_the_definition(width, world, data):
    dtype = FLOATS[width]
    x = data.draw(hnp.arrays(dtype, hnp.array_shapes(min_dims=2, max_dims=2, max_side=6),
                             elements=st.floats(width=width, allow_nan=False, allow_infinity=False)))
    q, e = quant.quantise(x, world)
    assert q.dtype == np.int32 and e.dtype == np.int32 and e.shape == (x.shape[0],)
    qm = quant.q_max(world)
    for i in range(x.shape[0]):
        m = max(abs(exact(v)) for v in x[i])
        if m == 0:
            assert e[i] == ZERO_EXPONENT and not q[i].any()
            continue
        assert m * Fraction(2) ** int(e[i]) <= qm < m * Fraction(2) ** (int(e[i]) + 1)
        for v, qv in zip(x[i], q[i]):
            assert int(qv) == py_round_half_even(exact(v) * Fraction(2) ** int(e[i]))
        assert np.abs(q[i].astype(np.int64)).max() <= qm


@given(x=hnp.arrays(np.float32, (3, 5), elements=st.floats(width=32, allow_nan=False,
                                                           allow_infinity=False)),
       world=st.integers(1, 64))
def test_float32_path_is_bit_identical_to_float64(x, world):
    q32, e32 = quant.quantise(x, world)
    q64, e64 = quant.quantise(x.astype(np.float64), world)
    assert np.array_equal(q32, q64) and np.array_equal(e32, e64)


@given(x=hnp.arrays(np.float16, (3, 5), elements=st.floats(width=16, allow_nan=False,
                                                           allow_infinity=False)),
       world=st.integers(1, 64))
def test_float16_path_is_bit_identical_to_float64(x, world):
    q16, e16 = quant.quantise(x, world)
    q64, e64 = quant.quantise(x.astype(np.float64), world)
    assert np.array_equal(q16, q64) and np.array_equal(e16, e64)


def test_quantise_rejects_bad_input():
    with pytest.raises(ValueError):
        quant.quantise(np.array([[1.0, np.nan]]), 2)
    with pytest.raises(ValueError):
        quant.quantise(np.array([[np.inf, 1.0]]), 2)
    with pytest.raises(TypeError):
        quant.quantise(np.ones((2, 2), np.int32), 2)
    with pytest.raises(ValueError):
        quant.quantise(np.ones(4), 2)
    for world in (0, 65):
        with pytest.raises(ValueError):
            quant.q_max(world)
        with pytest.raises(ValueError):
            quant.error_bound(world, np.zeros(1))


def test_quantise_into_a_packet_column_and_flat_padding():
    from aggd_client.protocol import packet_dtype
    x = np.linspace(-3, 5, 10, dtype=np.float32)
    q, e = quant.quantise_flat(x, 4, 4)
    assert q.shape == (3, 4) and e.shape == (3,)
    assert not q[2, 2:].any()  # padding
    pk = np.zeros(3, packet_dtype(4))
    out, e2 = quant.quantise(np.concatenate([x, [0, 0]]).reshape(3, 4), 4, out=pk["payload"])
    assert np.array_equal(pk["payload"], q) and np.array_equal(e, e2)
    q0, e0 = quant.quantise(np.zeros((2, 3)), 7)
    assert not q0.any() and (e0 == ZERO_EXPONENT).all()
    assert quant.quantise(np.zeros((0, 3)), 7)[1].shape == (0,)


# -- the aggregator's arithmetic and the error bound ---------------------------------------------

def test_align_and_sum_is_floor_alignment():
    rng = np.random.default_rng(0)
    q = rng.integers(-2**30, 2**30, size=(5, 4, 3), dtype=np.int64).astype(np.int32)
    e = rng.integers(-40, 60, size=(5, 4)).astype(np.int32)
    e[2, 1] = ZERO_EXPONENT
    q[2, 1] = 0
    total, e_min = quant.align_and_sum(q, e)
    for c in range(4):
        assert e_min[c] == e[:, c].min()
        for j in range(3):
            want = sum(int(q[w, c, j]) // 2 ** (int(e[w, c]) - int(e_min[c])) for w in range(5))
            assert total[c, j] == want


def contributions(width: int, max_world: int = 64):
    """(world, x) with x of shape (world, n_chunks, elements): every chunk of every worker gets
    its own magnitude, so exponents differ and alignment shifts (small and huge) happen."""
    dtype = FLOATS[width]
    info = np.finfo(dtype)

    @st.composite
    def strat(draw):
        world = draw(st.integers(1, max_world))
        n_chunks = draw(st.integers(1, 3))
        elements = draw(st.integers(1, 6))
        shape = (world, n_chunks, elements)
        mode = draw(st.sampled_from(["any", "scaled", "zeros", "same"]))
        if mode == "any":  # hypothesis' own extremes: subnormals, max, -0.0, ...
            x = draw(hnp.arrays(dtype, shape, elements=st.floats(
                width=width, allow_nan=False, allow_infinity=False)))
        else:
            base = draw(hnp.arrays(np.float64, shape, elements=st.floats(-1, 1)))
            lo, hi = int(np.log2(info.tiny)) - info.nmant, int(np.log2(info.max)) - 1
            scale = draw(hnp.arrays(np.int64, shape[:2], elements=st.integers(lo, hi)))
            x = np.ldexp(base, scale[..., None]).astype(dtype)
            if mode == "zeros":
                x[draw(hnp.arrays(bool, shape))] = 0
            if mode == "same":
                x[:] = x[0]
        return world, x
    return strat()


def check_sum_within_bound(world: int, x: np.ndarray) -> None:
    w, n_chunks, elements = x.shape
    q = np.empty(x.shape, np.int32)
    e = np.empty((w, n_chunks), np.int32)
    for r in range(w):  # each worker quantises its own chunks
        q[r], e[r] = quant.quantise(x[r], world)
    qm = quant.q_max(world)
    assert np.abs(q.astype(np.int64)).max() <= qm
    total, e_min = quant.align_and_sum(q, e)
    assert np.abs(total).max() <= INT32_MAX, "int32 overflow"
    bound = quant.error_bound(world, e_min)
    result = quant.dequantise(total, e_min)
    assert result.dtype == np.float64
    for c in range(n_chunks):
        ec = int(e_min[c])
        if ec == ZERO_EXPONENT:
            assert not total[c].any() and bound[c] == 0
            assert not x[:, c].any()
            continue
        u = Fraction(2) ** -ec
        for j in range(elements):
            s = sum(exact(x[r, c, j]) for r in range(w))
            r_exact = int(total[c, j]) * u
            # the integer result itself: rounding (<= u/2 each) + floor (< u each)
            assert abs(r_exact - s) <= Fraction(3, 2) * world * u
            assert abs(r_exact - s) <= Fraction(float(bound[c]))
            # the float64 result: correctly rounded from the integer one, within error_bound
            try:
                fr = float(r_exact)
            except OverflowError:
                assert np.isinf(result[c, j])
                continue
            assert result[c, j] == fr
            assert abs(Fraction(fr) - s) <= Fraction(float(bound[c]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contributions(64))
def test_sum_within_bound_float64(wx):
    check_sum_within_bound(*wx)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contributions(32))
def test_sum_within_bound_float32(wx):
    check_sum_within_bound(*wx)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contributions(16))
def test_sum_within_bound_float16(wx):
    check_sum_within_bound(*wx)


@pytest.mark.parametrize("world", [1, 2, 3, 7, 31, 32, 33, 63, 64])
def test_worst_case_magnitudes_do_not_overflow(world):
    """Every worker at the largest magnitude (positive and negative): the sum is at most
    world * Q and cannot wrap."""
    big = np.array([[np.finfo(np.float64).max / 128, -1.0, 3.0]])
    for sign in (1, -1):
        x = np.stack([sign * big] * world)
        check_sum_within_bound(world, x)
    # and the float16 extremes
    x16 = np.stack([np.array([[65504, -65504, 6e-8]], np.float16)] * world)
    check_sum_within_bound(world, x16)


@pytest.mark.parametrize("world", [1, 2, 5, 16, 64])
def test_large_random_blocks_vectorised(world):
    """Many chunks with magnitudes spread from 1e-300 to 1e300, checked in float64 with numpy."""
    rng = np.random.default_rng(world)
    n_chunks, elements = 200, 64
    scale = np.ldexp(1.0, rng.integers(-990, 990, size=(world, n_chunks, 1)))
    x = rng.standard_normal((world, n_chunks, elements)) * scale
    x[:, :5] = 0  # all-zero chunks
    x[0, 5:10] = 0  # one worker silent on some chunks
    q = np.empty(x.shape, np.int32)
    e = np.empty((world, n_chunks), np.int32)
    for r in range(world):
        q[r], e[r] = quant.quantise(x[r], world)
    total, e_min = quant.align_and_sum(q, e)
    assert np.abs(total).max() <= INT32_MAX
    result = quant.dequantise(total, e_min)
    ref = np.array([[math.fsum(x[:, c, j]) for j in range(elements)] for c in range(n_chunks)])
    err = np.abs(result - ref)
    bound = quant.error_bound(world, e_min)[:, None] + np.spacing(np.abs(ref))  # fsum rounds
    assert (err <= bound).all()
    assert (result[:5] == 0).all() and (e_min[:5] == ZERO_EXPONENT).all()


def test_error_bound_formula():
    e = np.array([0, 10, -5, ZERO_EXPONENT, 1100])
    b = quant.error_bound(4, e)
    assert b[0] == 6.0 and b[1] == 6.0 / 1024 and b[2] == 6.0 * 32 and b[3] == 0
    assert b[4] > 0  # a true bound even below the subnormal range
    # the doc's estimate: about 3 * world**2 * max|x| / 2**31
    world, m = 8, 0.75
    e = quant.chunk_exponents(np.array([m]), world)
    assert quant.error_bound(world, e)[0] <= 3 * world**2 * m / 2**31


def test_dequantise_mean_and_cast():
    q = np.array([[3, -5, 0]], np.int32)
    e = np.array([1])
    assert np.array_equal(quant.dequantise(q, e), [[1.5, -2.5, 0]])
    assert np.array_equal(quant.dequantise(q, e, divisor=np.array([2])), [[0.75, -1.25, 0]])
    out = np.empty((1, 3), np.float16)
    quant.dequantise(q, np.array([-20]), out=out)  # 3 * 2**20 does not fit float16
    assert np.isinf(out[0, 0]) and np.isinf(out[0, 1]) and out[0, 2] == 0


def test_output_rounding():
    v = np.array([1.0, 1000.0], np.float32)
    assert np.array_equal(quant.output_rounding(v), np.spacing(v).astype(np.float64) / 2)
    assert not quant.output_rounding(np.ones(2)).any()
    assert quant.output_rounding(np.array([2048], np.float16))[0] == 1.0
