"""AggClient at int16 and int8 precision against a fake aggregator on 127.0.0.1 (no privileges).

The fake (``PrecisionFake``) is test_client's ``FakeAggregator`` reading contributions in the type
their ``code`` says and answering with results of the job's result type (int32 for int16, int16 for
int8), as the protocol's Precision asks; ``result_code`` makes it answer in another precision.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from aggd_client import AggClient, ProtocolError, quant
from aggd_client.protocol import HEADER_SIZE, Header
from aggd_client.protocol.definition import LANES, Flag, MsgType, NackCode, Precision

from .test_client import JOB, FakeAggregator, check_close, make_arrays, path, run_workers  # noqa: F401 (path: a fixture)


class PrecisionFake(FakeAggregator):
    def __init__(self, world: int, precision: Precision, *, result_code: int | None = None, room: bool = False,
                 **kw):
        super().__init__(world, **kw)
        self.precision = Precision(precision)
        self.room = room      # contributions carry room for their result (its values first)
        self.result_code = int(self.precision) if result_code is None else int(result_code)
        self.codes: set[int] = set()
        self.sizes: set[int] = set()

    def handle(self, data: bytes, src) -> None:
        self.received += 1
        h = Header.unpack(data)
        assert h.type == MsgType.CONTRIB
        self.codes.add(h.code)
        self.sizes.add(len(data))
        if h.code != self.precision:
            return  # the data plane drops it (bad_precision)
        if h.rank >= self.world:
            return self._nack(h, NackCode.NOT_MEMBER, src)
        lanes = LANES[self.precision]
        key = (h.round, h.chunk)
        if key in self.released:
            self.rereads += 1
            res, payload = self.released[key]
            res.flags |= Flag.REREAD
            return self._send(res.pack() + payload, src)
        contribs = self.pending.setdefault(key, {})
        if h.rank in contribs:
            return
        self.addr[h.rank] = src
        contribs[h.rank] = (data, h.exponent, h.count)
        if len(contribs) < self.world:
            return
        del self.pending[key]
        width = lanes.result_bytes if self.room else lanes.contrib_bytes
        q = np.stack([np.frombuffer(contribs[r][0], lanes.contrib, offset=HEADER_SIZE,
                                    count=(len(contribs[r][0]) - HEADER_SIZE) // width)
                      for r in sorted(contribs)])
        assert np.abs(q.astype(np.int64)).max(initial=0) <= lanes.contrib_max
        assert not q[:, h.count:].any(), "padding is zero"
        e = np.array([[contribs[r][1]] for r in sorted(contribs)])
        total, e_min = quant.align_and_sum(q[:, None, :], e)
        assert np.abs(total).max() <= lanes.result_max, "honest senders never overflow the result lanes"
        res = Header(type=MsgType.RESULT, job=h.job, rank=0xFFFF, round=h.round, chunk=h.chunk,
                     count=h.count, exponent=int(e_min[0]), code=self.result_code,
                     contributors=(1 << self.world) - 1, n_contrib=self.world)
        rdtype = LANES[Precision(self.result_code)].result if self.result_code in LANES else "<i4"
        payload = total[0].astype(rdtype).tobytes()
        self.released[key] = (res, payload)
        for r in range(self.world):
            self._send(res.pack() + payload, self.addr[r])


def bound(arrays, world, elements, precision, terms=None):
    """Exact float64 sum and the per-element bound (result exponent: the smallest of the members'
    exponents, which the members' own quantisation gives: the rounding does not change them)."""
    flat = [np.ravel(a) for a in arrays]
    exact = np.sum([f.astype(np.float64) for f in flat], axis=0)
    exps = np.stack([quant.quantise_flat(f, world, elements, precision=precision, terms=terms)[1]
                     for f in flat]).min(axis=0)
    b = np.repeat(quant.error_bound(world, exps, precision=precision), elements)[:exact.size]
    b = b + world * np.spacing(np.sum([np.abs(f.astype(np.float64)) for f in flat], axis=0))
    return exact.reshape(np.shape(arrays[0])), b.reshape(np.shape(arrays[0]))


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
    exact, b = bound(arrays, world, E, p)
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
