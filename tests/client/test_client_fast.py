"""The optional numba kernels (aggd_client._fast) against the numpy reference path.

Both paths must produce bit-identical packets and results; a batch the kernel finds anomalous
(NACK, OVERFLOW, wrong count) must fall back to the numpy path and raise the same error.
"""
from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aggd_client import AggClient, AggregationOverflowError, NotMemberError, ProtocolError, quant
from aggd_client import _fast
from aggd_client.client import STAGE, AllreduceHandle, _Round, _Send
from aggd_client.protocol import HEADER_SIZE
from aggd_client.protocol.definition import (MAGIC, VERSION, ZERO_EXPONENT, Flag, MsgType, NackCode,
                                             StrategyKind)

pytestmark = pytest.mark.skipif(not _fast.AVAILABLE, reason="numba not installed")

JOB = 9


@pytest.fixture(scope="module")
def silent():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()
    s.close()


def silent_client(server, *args, **kw) -> AggClient:
    """A client of the silent server: nothing ever answers its rounds, so close() gives up at once
    (instead of retransmitting them for the default give_up_after, 5 s)."""
    return AggClient(server, *args, **{"give_up_after": 0.2, "fast": True, **kw})


def transfer(client, x, fast, mean=False, out_dtype=None, kind=StrategyKind.SYNC, number=0):
    """A round of ``x`` registered with ``client`` and its (only) send, not sent yet."""
    rnd = _Round(number, x.shape, out_dtype or x.dtype, x.size, client._elements, mean)
    send = _Send(client, rnd, x.reshape(-1), 0, kind)
    send.fast_fill = fast
    rnd.sends.append(send)
    client._rounds.append(rnd)
    client._sends.append(send)
    return rnd, send


def rings_after_fill(client, x, fast, kind=StrategyKind.SYNC):
    """Ring contents after filling all chunks in runs (as admit does: at most the ring's size,
    split where the ring wraps); one snapshot per run."""
    rnd, t = transfer(client, x, fast, kind=kind)
    t.ring.pk["payload"] = 0  # entries not filled yet hold an earlier send's packets
    S, snaps, c0 = client._slots, [], 0
    while c0 < t.n:
        k = min(t.n - c0, max(1, S // 2 + 1))
        r0 = c0 % S
        first = min(k, t.R - r0)
        t._fill(c0, first, r0)
        if first < k:
            t._fill(c0 + first, k - first, 0)
        snaps.append(t.ring.pk[:t.R].copy())
        c0 += k
    client._fail_all(RuntimeError("done"))  # hands the ring back
    return snaps


def same_rings(a, b):
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


finite = {w: st.floats(width=w, allow_nan=False, allow_infinity=False) for w in (16, 32, 64)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(width=st.sampled_from([16, 32, 64]), world=st.integers(1, 64), elements=st.integers(1, 9),
       kind=st.sampled_from(list(StrategyKind)), data=st.data())
def test_fill_is_bit_identical(silent, width, world, elements, kind, data):
    dtype = {16: np.float16, 32: np.float32, 64: np.float64}[width]
    x = data.draw(hnp.arrays(dtype, st.integers(1, 64 * elements), elements=finite[width]))
    with silent_client(silent, JOB, 0, world, elements=elements, slots=64) as c:
        slow = rings_after_fill(c, x, fast=False, kind=kind)
        fast = rings_after_fill(c, x, fast=True, kind=kind)
    assert same_rings(slow, fast)
    # the ring holds every chunk (64 slots), quantised with the strategy's headroom
    q, e = quant.quantise_flat(x, world, elements, terms=quant.terms_for(world, kind))
    ring = fast[-1][:q.shape[0]]
    assert np.array_equal(ring["payload"], q) and np.array_equal(ring["hdr"]["exponent"], e)
    assert np.array_equal(ring["hdr"]["chunk"], np.arange(q.shape[0]))
    assert ring["hdr"]["count"][-1] == x.size - (x.size - 1) // elements * elements


def test_fill_large_random_and_extremes(silent):
    rng = np.random.default_rng(0)
    for dtype in (np.float16, np.float32, np.float64):
        info = np.finfo(dtype)
        x = (rng.standard_normal(256 * 37 + 5) * 3).astype(dtype)
        x[:256] = 0
        x[256:300] = info.max
        x[600:700] = info.smallest_subnormal
        x[900] = -info.max
        for world in (1, 3, 64):
            with silent_client(silent, JOB, 1, world if world > 1 else 2, slots=16) as c:
                assert same_rings(rings_after_fill(c, x, False), rings_after_fill(c, x, True))


def result_size(client) -> int:
    """Bytes of a full result of ``client``'s job (a narrow job's results are wider than its
    contributions)."""
    return HEADER_SIZE + client._elements * client._lanes.result_bytes


def results_batch(client, t, rng, chunks, *, exps=None, n_contrib=None, flags=0, count=None):
    """Write RESULT messages of round ``t`` for ``chunks`` into the client's staging array;
    returns m."""
    st_ = client._stage
    m = len(chunks)
    st_[:m] = 0
    h = st_["hdr"]
    h["magic"][:m], h["version"][:m], h["type"][:m] = MAGIC, VERSION, MsgType.RESULT
    h["job"][:m], h["rank"][:m], h["round"][:m] = JOB, 0xFFFF, t.r32
    h["strategy"][:m], h["param"][:m], h["strategy_version"][:m] = StrategyKind.SSP, 2, 7
    h["chunk"][:m] = chunks
    h["code"][:m] = int(client._precision)
    E = client._elements
    cnt = np.where(np.asarray(chunks) == t.n_chunks - 1, t.last_count, E)
    if count is not None:
        cnt[:] = count
    h["count"][:m] = cnt
    h["exponent"][:m] = rng.integers(-60, 80, m) if exps is None else exps
    h["flags"][:m] = flags
    h["n_contrib"][:m] = rng.integers(1, 64, m) if n_contrib is None else n_contrib
    pay = rng.integers(-2**31, 2**31, (m, E), dtype=np.int64).astype(np.int32)
    for i in range(m):
        pay[i, cnt[i]:] = 0
    st_["payload"][:m] = pay.astype(st_["payload"].dtype.base)  # a narrow job's wraps
    client._sizes[:m] = result_size(client)
    return m


def fresh_client(silent, fast, **kw):
    c = silent_client(silent, JOB, 0, 4, **kw)
    c._fast = fast
    return c


#: result exponents: any (float64's whole range and beyond), or at and around the bounds of the
#: kernel's float32 arithmetic for float32 outputs (-96..126)
EXPONENTS = {"wide": np.arange(-990, 1100),
             "float32 bounds": np.array([-98, -97, -96, -95, -1, 0, 1, 30, 125, 126, 127, 128])}


@pytest.mark.parametrize("out_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("exponents", list(EXPONENTS))
@pytest.mark.parametrize("precision", [32, 16, 8])
def test_scatter_is_bit_identical(silent, out_dtype, mean, exponents, precision):
    """Batches holding results of two rounds in flight (and noise), through the kernel and
    through the numpy path: the same outputs, counts, answered chunks and strategy learnt; int32
    results, and the narrow jobs' (int32 for 16 bits, int16 for 8: the payload's values wrapped)."""
    rng = np.random.default_rng(1)
    E = 64
    x = np.zeros(E * 50 - 3, out_dtype)
    clients = [fresh_client(silent, fast, elements=E, slots=64, precision=precision) for fast in (False, True)]
    try:
        state = []
        for c in clients:
            rounds = [transfer(c, x, c._fast, mean=mean, number=n) for n in (0, 1)]
            for rnd, send in rounds:
                send.state[:] = 1
                send.inflight = send.n
                send.next = send.n
            state.append(rounds)
        for batch in range(8):
            chunks = rng.integers(0, 50, rng.integers(1, 40))
            exps = rng.choice(EXPONENTS[exponents], chunks.size)
            exps[rng.random(chunks.size) < 0.2] = ZERO_EXPONENT
            seed = int(rng.integers(1 << 30))
            which = batch % 2
            for c, rounds in zip(clients, state):
                r = np.random.default_rng(seed)
                m = results_batch(c, rounds[which][0], r, chunks, exps=exps)
                # noise both paths must skip: another job, a short datagram, a later sync round
                # (the last makes the kernel hand the batch to the numpy path as well)
                if batch % 3 == 0 and m + 3 <= STAGE:
                    c._stage[m:m + 3] = c._stage[0]
                    c._stage["hdr"]["job"][m] = JOB + 1
                    c._stage["hdr"]["round"][m + 2] = 9
                    c._stage["hdr"]["strategy"][m + 2] = StrategyKind.SYNC
                    c._sizes[m:m + 3] = result_size(c)
                    c._sizes[m + 1] = HEADER_SIZE - 1
                    m += 3
                c._process(m)
        assert clients[0].stats == clients[1].stats
        for (r0, s0), (r1, s1) in zip(*state):
            assert np.array_equal(r0.have, r1.have) and np.array_equal(r0.n_contrib, r1.n_contrib)
            assert r0.n_have == r1.n_have == int(r0.have.sum()) > 0
            assert np.array_equal(s0.state, s1.state) and s0.inflight == s1.inflight
            answered = np.repeat(r0.have.astype(bool), E)[:x.size]  # the rest is np.empty
            assert r0.result[answered].tobytes() == r1.result[answered].tobytes()
            assert r0.info == r1.info == (StrategyKind.SSP, 2, 7)
        assert clients[0].strategy == clients[1].strategy == (StrategyKind.SSP, 2, 7)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("kind", ["overflow", "count", "nack", "stale_nack"])
def test_scatter_anomalies_fall_back(silent, kind):
    rng = np.random.default_rng(2)
    E = 16
    x = np.zeros(E * 4, np.float32)
    with silent_client(silent, JOB, 0, 2, elements=E) as c:
        assert c._fast
        rnd, t = transfer(c, x, True)
        t.state[:] = 1
        t.inflight, t.next = t.n, t.n
        handle = AllreduceHandle(c, rnd, t)
        m = results_batch(c, rnd, rng, [0, 1, 2],
                          flags=Flag.OVERFLOW if kind == "overflow" else 0,
                          count=E - 1 if kind == "count" else None)
        if kind in ("nack", "stale_nack"):
            h = c._stage["hdr"]
            h["type"][1] = MsgType.NACK
            h["code"][1] = NackCode.NOT_MEMBER if kind == "nack" else NackCode.STALE
            h["round"][1] = rnd.r32 + 5 if kind == "stale_nack" else rnd.r32
            c._sizes[1] = HEADER_SIZE
        if kind == "nack":  # fatal: raised, every round in flight fails with it
            with pytest.raises(NotMemberError):
                c._process(m)
        elif kind == "stale_nack":  # a stale NACK of another round is ignored; results count
            c._process(m)
            assert list(rnd.have) == [1, 0, 1, 0] and list(t.state) == [2, 1, 2, 1]
            assert t.inflight == 2
        else:  # the round fails; its handle raises
            c._process(m)
            assert handle.done() and not c._rounds and not c._sends
            with pytest.raises({"overflow": AggregationOverflowError, "count": ProtocolError}[kind]):
                handle.wait()


def test_kernels_can_be_disabled(monkeypatch, silent):
    monkeypatch.setattr(_fast, "AVAILABLE", False)
    assert _fast.warm_up() is False
    with silent_client(silent, JOB, 0, 1) as c:
        assert not c._fast
        rnd, t = transfer(c, np.ones(3, np.float32), c._fast)
        assert not t.fast_fill


any_float = {w: st.floats(width=w) for w in (32, 64)}  # NaN and infinities included


@settings(max_examples=200, deadline=None)
@given(width=st.sampled_from([32, 64]), data=st.data())
def test_all_finite_agrees_with_numpy(width, data):
    assert _fast.warm_up()
    dtype = {32: np.float32, 64: np.float64}[width]
    x = data.draw(hnp.arrays(dtype, st.integers(1, 300), elements=any_float[width]))
    assert _fast.all_finite(x) == bool(np.isfinite(x).all())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
def test_all_finite_finds_one_bad_value_anywhere(dtype, bad):
    assert _fast.warm_up()
    info = np.finfo(dtype)
    x = np.array([0.0, -0.0, info.max, -info.max, info.smallest_subnormal, 1.0] * 100, dtype)
    assert _fast.all_finite(x)
    for pos in (0, 17, x.size - 1):
        y = x.copy()
        y[pos] = bad
        assert not _fast.all_finite(y)


def test_a_nan_is_refused_before_anything_is_sent_on_the_fast_path(silent):
    x = np.ones(10_000, np.float32)
    x[9_999] = np.nan
    with silent_client(silent, JOB, 0, 2, slots=16) as c:
        assert c._fast
        with pytest.raises(ValueError, match="NaN"):
            c.allreduce(x)
        assert c.stats["packets_sent"] == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(width=st.sampled_from([16, 32, 64]), precision=st.sampled_from([8, 16]), world=st.integers(1, 64),
       elements=st.integers(1, 9), data=st.data())
def test_narrow_fill_rounds_as_the_numpy_path(silent, width, precision, world, elements, data):
    """The narrow kernel's packets: the numpy path's headers and exponents; each value one of the
    two integers around ``x * 2**e`` (stochastic rounding with another generator), within ±Q."""
    dtype = {16: np.float16, 32: np.float32, 64: np.float64}[width]
    x = data.draw(hnp.arrays(dtype, st.integers(1, 64 * elements), elements=finite[width]))
    with silent_client(silent, JOB, 0, world, elements=elements, slots=64, precision=precision, seed=3) as c:
        slow = rings_after_fill(c, x, fast=False)[-1]
        fast = rings_after_fill(c, x, fast=True)[-1]
    assert np.array_equal(slow["hdr"], fast["hdr"])
    n = -(-x.size // elements)
    q, e = fast["payload"][:n].astype(np.int64), fast["hdr"]["exponent"][:n].astype(np.int64)
    padded = np.zeros(n * elements)
    padded[:x.size] = x
    y = np.ldexp(padded.reshape(n, elements), np.where(e == ZERO_EXPONENT, 0, e)[:, None])
    Q = quant.q_max(world, quant.terms_for(world), quant.precision_of(precision))
    assert np.all(np.abs(q) <= Q) and np.all((q == np.floor(y)) | (q == np.ceil(y)) | (np.abs(q) == Q))


@pytest.mark.parametrize("bits, scale", [(8, 64), (16, 16384)])
def test_narrow_fill_is_unbiased(bits, scale):
    x = np.full(4096, 0.3, np.float32)
    x[0] = 1.0                                   # the chunk's scale: `scale` steps of 1 (Q = 127, 32767)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    with AggClient(s.getsockname(), JOB, 0, 1, elements=4096, slots=4, precision=bits, headroom=1, fast=True) as c:
        ring = rings_after_fill(c, x, fast=True)[-1]
    s.close()
    q, e = ring["payload"][0].astype(np.float64), int(ring["hdr"]["exponent"][0])
    y = float(np.float32(0.3)) * scale           # 19.2 (int8), 4915.2 (int16)
    assert np.ldexp(1.0, e) == scale and q[0] == scale and set(q[1:]) == {np.floor(y), np.ceil(y)}
    # 0.2 of the values round up: the mean is y within five standard deviations (0.4 / 64)
    assert abs(q[1:].mean() - y) < 5 * 0.4 / 64
