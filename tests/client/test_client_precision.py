"""AggClient at int16 and int8 precision against a fake aggregator on 127.0.0.1 (no privileges):
``PrecisionFake`` of tests/harness/fake_aggregator.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from aggd_client import AggClient, ProtocolError, quant
from aggd_client.protocol import HEADER_SIZE
from aggd_client.protocol.definition import LANES, Precision

from tests.harness.fake_aggregator import (JOB, PrecisionFake, check_close, expected_and_bound, make_arrays,
                                           run_workers)

E = 64


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("size", [1, E - 3, 5 * E + 7])
@pytest.mark.parametrize("dtype,room", [(np.float32, False), (np.float16, False), (np.float32, True)])
def test_narrow_sum_against_fake(bits, size, dtype, room):
    world = 4
    p = quant.precision_of(bits)
    arrays = make_arrays(world, size, dtype, seed=size + bits)
    with PrecisionFake(world, p, room=room) as fake:
        results, clients = run_workers(fake, arrays, elements=E, precision=bits, rounds=2, room=room)
        assert fake.codes == {int(p)}
        # contribution packets carry the narrow type (with room: as long as the result)
        lanes = LANES[p]
        assert fake.sizes == {HEADER_SIZE + E * (lanes.result_bytes if room else lanes.contrib_bytes)}
    exact, b = expected_and_bound(arrays, world, E, precision=p)
    for rs in results:
        for res in rs:
            assert res.dtype == np.dtype(dtype)
            check_close(res, exact, b)
    for rs in results[1:]:  # every member gets the same result
        assert np.array_equal(rs[0], results[0][0])
    assert all(c.precision == p for c in clients)


def sum_with_residuals(arrays, precision=Precision.INT8):
    """Every member sums its array through a ``PrecisionFake`` with ``residual=``, in threads:
    (results, residuals)."""
    world = len(arrays)
    residuals = [np.empty(a.size) for a in arrays]
    out = [None] * world
    with PrecisionFake(world, precision) as fake:
        clients = [AggClient(fake.address, JOB, r, world, bind=("127.0.0.1", 0), elements=E,
                             precision=LANES[precision].bits, seed=r, give_up_after=10.0) for r in range(world)]

        def work(r):
            out[r] = clients[r].allreduce(arrays[r], "sum", residual=residuals[r])

        ts = [threading.Thread(target=work, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        for c in clients:
            c.close()
    return out, residuals


def test_mean_and_residual_at_int8():
    world = 3
    arrays = make_arrays(world, 3 * E + 5, np.float64, seed=4)
    out, residuals = sum_with_residuals(arrays)
    # the residuals say exactly what the result lacks of the inputs (alignment included)
    exact = np.sum(arrays, axis=0)
    lacking = np.sum(residuals, axis=0)
    assert np.allclose(out[0] + lacking, exact, rtol=0, atol=1e-12 * np.abs(exact).max())
    steps = [np.repeat(np.ldexp(1.0, -quant.quantise_flat(a, world, E, precision=Precision.INT8)[1]), E)[:a.size]
             for a in arrays]
    for r, s in zip(residuals, steps):
        assert (np.abs(r) < 2 * s).all()  # one step of the own rounding, one of the alignment


@pytest.mark.parametrize("path", ["numba", "numpy"], indirect=True)
def test_residuals_with_members_of_different_scales(path, monkeypatch):
    """Members whose chunks differ in scale get results aligned to the finest exponent, which drops
    low bits of the coarser members' contributions: each residual takes them once the round is
    complete, on the numba result path as on the numpy one (which the numba path no longer leaves
    residual rounds to)."""
    from aggd_client.results import ResultHandler
    numpy_batches = []
    original = ResultHandler._process_numpy
    monkeypatch.setattr(ResultHandler, "_process_numpy",
                        lambda self, m: numpy_batches.append(m) or original(self, m))
    arrays = [a * 4.0 ** r for r, a in enumerate(make_arrays(3, 7 * E + 5, np.float64, seed=8))]
    out, residuals = sum_with_residuals(arrays)
    exact = np.sum(arrays, axis=0)
    assert np.allclose(out[0] + np.sum(residuals, axis=0), exact, rtol=0, atol=1e-12 * np.abs(exact).max())
    assert (path == "numba") == (not numpy_batches), numpy_batches


def test_result_of_another_precision_fails_the_round():
    world = 2
    with PrecisionFake(world, Precision.INT8, result_code=int(Precision.INT32)) as fake:
        with pytest.raises(ProtocolError) as ei:
            run_workers(fake, make_arrays(world, 100, np.float32), elements=E, precision=8, give_up_after=3.0)
    msg = str(ei.value)
    assert "int32" in msg and "int8" in msg


def test_int32_result_to_narrow_job_and_bad_precision_argument():
    with pytest.raises(ValueError, match="precision"):
        AggClient(("127.0.0.1", 9), JOB, 0, 2, precision=12)
    with PrecisionFake(1, Precision.INT16) as fake:
        with AggClient(fake.address, JOB, 0, 1, bind=("127.0.0.1", 0), elements=E, precision="int16") as c:
            assert c.precision == Precision.INT16
            x = np.linspace(-1, 1, 3 * E)
            r = c.allreduce(x)
    exps = quant.quantise_flat(x, 1, E, precision=Precision.INT16)[1]
    assert (np.abs(r - x) <= np.repeat(quant.error_bound(1, exps, precision=Precision.INT16), E)).all()


def test_int32_default_is_unchanged_on_the_wire():
    with PrecisionFake(2, Precision.INT32) as fake:
        results, _ = run_workers(fake, make_arrays(2, 2 * E, np.float32), elements=E)
        assert fake.codes == {0} and fake.sizes == {HEADER_SIZE + 4 * E}
