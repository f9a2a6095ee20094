"""Optional numba kernels for the client's two hot loops; the numpy code is the reference.

``fill`` quantises a run of chunks straight into the packet ring and writes their header fields;
``scatter`` checks a batch of received messages and dequantises one round's new results into its
output (the client calls it once per round in flight); ``ack`` marks answered chunks of a send.
Both do in one pass what the numpy path does in a dozen, which matters when batches are small.
For int32 jobs (round half to even) they give bit-identical results to the numpy path
(tests/client/test_client_fast.py): the same exact power-of-two scaling, rounding, and
dequantisation rounded once to the output's type. For 8- and 16-bit jobs ``fill_narrow`` rounds stochastically,
as the numpy path does, with a faster generator of its own (same rule and bound, other draws: tested
for unbiasedness), and ``scatter`` reads every precision's results (``code`` and ``width``).

Used only when numba imports, the host is little-endian (the kernels write the big-endian header by
bytes and the little-endian payload as native int32) and ``AGGD_CLIENT_NUMBA`` is not ``0``.
Kernels are compiled (or loaded from numba's cache) by ``warm_up`` before a client sends anything,
so a first compilation never delays a round.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
import threading

import numpy as np

from .protocol import HEADER_DTYPE, HEADER_SIZE
from .protocol.definition import LANES, MAGIC, VERSION, ZERO_EXPONENT, Flag, MsgType, Precision, StrategyKind

log = logging.getLogger("aggd_client")

#: numba is imported (and the kernels compiled) only by ``warm_up``, so importing aggd_client
#: stays cheap for tools that only need the protocol.
AVAILABLE = (os.environ.get("AGGD_CLIENT_NUMBA", "1") != "0" and sys.byteorder == "little"
             and importlib.util.find_spec("numba") is not None)

_P = HEADER_SIZE // 4  # payload offset in int32 words
_P16, _P8 = HEADER_SIZE // 2, HEADER_SIZE  # ... in int16 and int8 values
_M32 = np.uint64(0xFFFFFFFF)
# byte offsets of the header fields the kernels touch, from the one definition
_O = {name: HEADER_DTYPE.fields[name][1] for name in HEADER_DTYPE.names}
_MAGIC, _VERSION, _TYPE, _JOB, _ROUND = _O["magic"], _O["version"], _O["type"], _O["job"], _O["round"]
_CHUNK, _COUNT, _EXP, _FLAGS, _NCONTRIB = (_O["chunk"], _O["count"], _O["exponent"], _O["flags"],
                                           _O["n_contrib"])
_STRATEGY, _PARAM, _SVERSION = _O["strategy"], _O["param"], _O["strategy_version"]
_CODE = _O["code"]
assert [HEADER_DTYPE.fields[n][0].itemsize for n in
        ("magic", "version", "type", "job", "round", "chunk", "count", "exponent", "flags",
         "n_contrib", "strategy", "param", "strategy_version")] == [2, 1, 1, 2, 4, 4, 2, 2, 1, 2, 1, 1, 2]
_RESULT = int(MsgType.RESULT)
_NACK = int(MsgType.NACK)
_OVERFLOW = int(Flag.OVERFLOW)
# a release that may leave members out: whether it answers our packet takes the numpy path's check
_QUORUM, _WBSP = int(StrategyKind.QUORUM), int(StrategyKind.WBSP)

#: scatter() status codes
OK, ANOMALY = 0, 1


def _max_abs_bits(xb, absmask):  # pragma: no cover - jitted
    """The largest ``bits & absmask`` of ``xb`` (a float array's bits): the bits of the largest
    |value| when every value is finite (IEEE order on non-negative floats is their bits' order),
    at least the exponent mask when one is not. An integer reduction: it vectorises, a float max
    with NaN semantics does not."""
    m = xb.dtype.type(0)
    for j in range(xb.size):
        m = max(m, xb[j] & absmask)
    return m


def _chunk_exponent(xb, absmask, pick_b, pick_f, fq, jq):  # pragma: no cover - jitted
    """The exponent of a chunk whose values' bits are ``xb``: the largest ``e`` with
    ``max|x| * 2**e <= Q`` (``Q = fq * 2**jq``), ZERO_EXPONENT for an all-zero chunk."""
    pick_b[0] = _max_abs_bits(xb, absmask)
    m = np.float64(pick_f[0])
    if m == 0.0:
        return ZERO_EXPONENT
    fm, km = math.frexp(m)
    e = jq - km
    if fm > fq:
        e -= 1
    return e


def _write_header(ring_u8, r, c, cnt, e, flags):  # pragma: no cover - jitted
    """Ring entry ``r``'s chunk, count and exponent (big-endian), and its flags set to ``flags``
    unless that is -1 (left as they are)."""
    ring_u8[r, _CHUNK] = (c >> 24) & 255
    ring_u8[r, _CHUNK + 1] = (c >> 16) & 255
    ring_u8[r, _CHUNK + 2] = (c >> 8) & 255
    ring_u8[r, _CHUNK + 3] = c & 255
    ring_u8[r, _COUNT] = (cnt >> 8) & 255
    ring_u8[r, _COUNT + 1] = cnt & 255
    eu = e & 0xFFFF
    ring_u8[r, _EXP] = eu >> 8
    ring_u8[r, _EXP + 1] = eu & 255
    if flags >= 0:
        ring_u8[r, _FLAGS] = flags


def _fill(x, xb, absmask, pick_b, pick_f, xc0, c0, k, E, fq, jq, ring_u8, ring_i32, r0,
          flags, cap, own):  # pragma: no cover - jitted
    """Chunks c0 .. c0+k-1, whose values start at x[xc0 * E], into ring rows r0 .. r0+k-1.
    Chunk ``c``'s own exponent goes to ``own[c]``, and it is sent at ``min(own[c], cap[c])`` (a
    shared scale: ``aggd_client.scales``; ZERO_EXPONENT in ``cap`` leaves the own one).
    ``xb`` is ``x``'s bits (uint32 or uint64), ``absmask`` clears their sign; ``pick_b`` and
    ``pick_f`` are one-element views of the same bytes, which turn the largest bits back into a
    float. Loops run over slices: numba then knows the indices are in range and vectorises."""
    n = x.size
    for i in range(k):
        r = r0 + i
        s = (xc0 + i) * E
        cnt = min(E, n - s)
        xs = x[s:s + cnt]
        dst = ring_i32[r, _P:_P + E]
        e = _chunk_exponent(xb[s:s + cnt], absmask, pick_b, pick_f, fq, jq)
        own[c0 + i] = e
        e = min(e, cap[c0 + i])
        if -1000 <= e <= 1000:  # 2**e is a normal float64: scaling by it is exact (as ldexp)
            scale = math.ldexp(1.0, e)
            for j in range(cnt):
                dst[j] = np.int32(np.rint(np.float64(xs[j]) * scale))
        else:  # zero chunks and extreme magnitudes
            for j in range(cnt):
                dst[j] = np.int32(np.rint(math.ldexp(np.float64(xs[j]), e)))
        for j in range(cnt, E):
            dst[j] = 0
        _write_header(ring_u8, r, c0 + i, cnt, e, flags)


def _next_random(state):  # pragma: no cover - jitted
    """xorshift64* (Vigna): the next 64 random bits from ``state[0]`` (never 0)."""
    s = state[0]
    s ^= s >> np.uint64(12)
    s ^= s << np.uint64(25)
    s ^= s >> np.uint64(27)
    state[0] = s
    return s * np.uint64(2685821657736338717)


def _mix(z):  # pragma: no cover - jitted
    """splitmix64's finaliser: 64 well-mixed bits of ``z`` (a counter-based generator: each value's
    draw depends on its index alone, so the loop over a chunk vectorises)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hash32(z):  # pragma: no cover - jitted
    """A 32-bit counter-based generator (Wellons' lowbias32) of the low half of ``z`` (an int64):
    the int8 loop's, where with int64 arithmetic and masks (no unsigned conversions) numba
    vectorises the whole loop, generator and rounding together."""
    z = z & 0xFFFFFFFF
    z ^= z >> 16
    z = (z * 0x7FEB352D) & 0xFFFFFFFF
    z ^= z >> 15
    z = (z * 0x846CA68B) & 0xFFFFFFFF
    return z ^ (z >> 16)


def _round_pairs(xs, dst, cnt, scale, q, key32, ft):  # pragma: no cover - jitted
    """``dst[j] = floor(xs[j] * scale + U)`` clipped to ``±q`` for ``j < cnt``: ``U`` and the bounds
    in the float type ``ft`` (``scale`` and ``q`` are of it), the product in the wider of ``ft`` and
    ``xs``'s type. One ``_hash32`` draw of ``key32`` and the pair's index serves two values, 16 bits
    each (``U = (k + 1/2) / 2**16``). No branch in the loop, so numba vectorises it."""
    half, step = ft(0.5), ft(1.0 / 65536.0)
    for j in range(cnt // 2):
        z = _hash32(key32 + j * 0x9E3779B9)
        u0 = (ft(z & 0xFFFF) + half) * step
        u1 = (ft(z >> 16) + half) * step
        dst[2 * j] = np.int32(max(-q, min(q, np.floor(xs[2 * j] * scale + u0))))
        dst[2 * j + 1] = np.int32(max(-q, min(q, np.floor(xs[2 * j + 1] * scale + u1))))
    if cnt & 1:
        u0 = (ft(_hash32(key32 + (cnt // 2) * 0x9E3779B9) & 0xFFFF) + half) * step
        dst[cnt - 1] = np.int32(max(-q, min(q, np.floor(xs[cnt - 1] * scale + u0))))


def _fill_narrow(x, xb, absmask, pick_b, pick_f, xc0, c0, k, E, fq, jq, ring_u8, ring_n, r0, flags, qmax,
                 state, cap, own):  # pragma: no cover - jitted
    """``_fill`` for a narrow precision: ``ring_n`` is the ring's rows as the precision's values (int8
    or int16: ``ring_u8`` viewed so, the payload at ``_P8`` or ``_P16``) and each value is rounded
    stochastically, ``floor(x * 2**e + U)`` clipped to ``±qmax``, with ``U`` from a counter-based
    generator of a per-chunk key drawn from ``state`` and the value's index: the numpy path's rule
    with another generator (``cap`` and ``own`` as ``_fill``'s). A 32-bit generator (``_hash32``)
    whose draw serves two values, 16 bits each (``U = (k + 1/2) / 2**16``: a bias below 2**-16 of a
    step, which error feedback carries).
    Loops run over slices of C-contiguous rows, without a branch inside: numba then vectorises them
    (16M float32 values on this project's lab host: int8 1.1 ns a value, int16 1.3, where splitmix64
    and 24 bits a value took 1.7).

    int8 values (|x * 2**e| below 128) are scaled in float32, where ``x * 2**e`` is exact and
    ``x * 2**e + U`` rounds to 2**-17 at most, about that generator's resolution; int16 values in
    float64 (float32 resolves ``x * 2**e + U`` only to 2**-8 at 2**15), as are chunks of extreme
    exponents. Zero chunks and exponents beyond float64's normal scaling take splitmix64 (``_mix``),
    24 bits a value."""
    n = x.size
    q = np.float64(qmax)
    q32 = np.float32(qmax)
    p = _P8 if ring_n.itemsize == 1 else _P16
    for i in range(k):
        r = r0 + i
        s = (xc0 + i) * E
        cnt = min(E, n - s)
        xs = x[s:s + cnt]
        dst = ring_n[r, p:p + E]
        e = _chunk_exponent(xb[s:s + cnt], absmask, pick_b, pick_f, fq, jq)
        own[c0 + i] = e
        e = min(e, cap[c0 + i])
        key = _next_random(state)
        if p == _P8 and -126 <= e <= 126:  # 2**e is a normal float32: int8 values in float32
            _round_pairs(xs, dst, cnt, np.float32(math.ldexp(1.0, e)), q32, np.int64(key & _M32), np.float32)
        elif -1000 <= e <= 1000:  # 2**e is a normal float64: scaling by it is exact (as ldexp)
            _round_pairs(xs, dst, cnt, math.ldexp(1.0, e), q, np.int64(key & _M32), np.float64)
        else:  # zero chunks and extreme magnitudes
            for j in range(cnt):
                u = (np.float64(_mix(key + np.uint64(j) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) + 0.5) \
                    * (1.0 / 16777216.0)
                dst[j] = max(-q, min(q, math.floor(math.ldexp(np.float64(xs[j]), e) + u)))
        for j in range(cnt, E):
            dst[j] = 0
        _write_header(ring_u8, r, c0 + i, cnt, e, flags)


def _be16(b, i, o):  # pragma: no cover - jitted
    return (np.int64(b[i, o]) << 8) | np.int64(b[i, o + 1])


def _be32(b, i, o):  # pragma: no cover - jitted
    return (_be16(b, i, o) << 16) | _be16(b, i, o + 2)


def _scatter(st_u8, st_pay, sizes, m, job, round32, n_chunks, E, last_count, have, ncontrib, res_exp, out,
             mean, acks, meta, code, width):  # pragma: no cover - jitted
    """The results of round ``round32`` in a received batch. Every one (chunk below ``n_chunks``)
    is listed in ``acks``; one for a chunk without a result yet (``have`` 0) is dequantised into
    ``out`` (divided by its ``n_contrib`` for a mean), and ``have``, ``ncontrib``, ``res_exp`` (its
    exponent) and ``meta`` (strategy, param, strategy_version of the last one) are set. Returns (status, new results,
    acks, results of the job in the batch whatever their round). Writes nothing unless every
    message is either ignorable or a well-formed result (status OK); a NACK is an anomaly too, and
    so is a result of this round under quorum or wbsp (whether it answers our packet depends on its
    contributors: the numpy path, which also serves those strategies once they are known).
    ``st_pay``: the staging records' payload column in the job's result type (``width`` bytes a
    value); a result whose ``code`` is not the job's precision ``code`` is an anomaly."""
    for apply in range(2):
        nd = 0
        na = 0
        nj = 0
        for i in range(m):
            if sizes[i] < HEADER_SIZE:
                continue
            if _be16(st_u8, i, _MAGIC) != MAGIC or st_u8[i, _VERSION] != VERSION \
                    or _be16(st_u8, i, _JOB) != job:
                continue
            typ = st_u8[i, _TYPE]
            if typ == _NACK:
                return ANOMALY, 0, 0, 0
            if typ != _RESULT:
                continue
            nj += 1
            if _be32(st_u8, i, _ROUND) != round32:
                continue
            if st_u8[i, _STRATEGY] == _QUORUM or st_u8[i, _STRATEGY] == _WBSP:
                return ANOMALY, 0, 0, 0
            c = _be32(st_u8, i, _CHUNK)
            if c >= n_chunks:
                continue
            if apply:
                acks[na] = c
            na += 1
            if have[c]:
                continue
            cnt = _be16(st_u8, i, _COUNT)
            ncon = _be16(st_u8, i, _NCONTRIB)
            if not apply:
                expect = last_count if c == n_chunks - 1 else E
                if (st_u8[i, _FLAGS] & _OVERFLOW) or cnt != expect or sizes[i] < HEADER_SIZE + width * cnt \
                        or (mean and ncon == 0) or st_u8[i, _CODE] != code:
                    return ANOMALY, 0, 0, 0
                continue
            e = _be16(st_u8, i, _EXP)
            if e >= 32768:
                e -= 65536
            base = c * E
            div = np.float64(ncon) if mean else 1.0
            src = st_pay[i, :cnt]  # slices: the loops vectorise
            dst = out[base:base + cnt]
            if out.itemsize == 4 and not mean and -96 <= e <= 126:
                # a float32 result in float32 arithmetic: float32(q) * 2**-e is the float64 product
                # rounded once (q rounds to 24 bits, the power of two moves it and every product
                # is a normal float32 within these exponents), and takes a third less time
                scale32 = np.float32(math.ldexp(1.0, -e))
                for j in range(cnt):
                    dst[j] = np.float32(src[j]) * scale32
            elif -1000 <= e <= 1000:  # q * 2**-e rounds once, exactly as ldexp does
                scale = math.ldexp(1.0, -e)
                if mean:
                    for j in range(cnt):
                        dst[j] = (np.float64(src[j]) * scale) / div
                else:
                    for j in range(cnt):
                        dst[j] = np.float64(src[j]) * scale
            else:
                for j in range(cnt):
                    dst[j] = math.ldexp(np.float64(src[j]), -e) / div
            have[c] = 1
            ncontrib[c] = ncon
            res_exp[c] = e
            meta[0] = st_u8[i, _STRATEGY]
            meta[1] = st_u8[i, _PARAM]
            meta[2] = _be16(st_u8, i, _SVERSION)
            nd += 1
        if apply:
            return OK, nd, na, nj
    return OK, 0, 0, 0


def _ack(state, chunks, n, sent_at, retries, now, overtaken, out):  # pragma: no cover - jitted
    """Chunks ``chunks[:n]`` answered: those in flight (1) become done (2); returns how many.
    ``out``: the longest answer time (``now - sent_at``) of those sent once (``retries`` 0) and
    not overtaken (sent at or after ``overtaken``: a chunk sent later was answered first, so its
    wait was a loss's recovery, not the path), how many of those there were, and the newest send
    time of every chunk answered on its first send (-inf: none)."""
    k = 0
    longest = 0.0
    once = 0
    newest = -np.inf
    for i in range(n):
        c = chunks[i]
        if state[c] == 1:
            state[c] = 2
            k += 1
            if retries[c] == 0:
                if sent_at[c] > newest:
                    newest = sent_at[c]
                if sent_at[c] >= overtaken:
                    once += 1
                    if now - sent_at[c] > longest:
                        longest = now - sent_at[c]
    out[0] = longest
    out[1] = once
    out[2] = newest
    return k


fill = scatter = ack = max_abs_bits = None  # the compiled kernels, once warm_up succeeded

#: Per float dtype: its bits' dtype, the mask that clears the sign, the exponent mask (all ones:
#: infinity or NaN).
BITS = {np.dtype(np.float32): (np.uint32, np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)),
        np.dtype(np.float64): (np.uint64, np.uint64(0x7FFFFFFFFFFFFFFF),
                               np.uint64(0x7FF0000000000000))}


def all_finite(x: np.ndarray) -> bool:
    """Whether a contiguous float32/float64 array holds no NaN or infinity: one vectorised pass
    over its bits (numpy's min and max are two). Needs ``warm_up()`` to have succeeded."""
    utype, absmask, expmask = BITS[x.dtype]
    return bool(max_abs_bits(x.view(utype), absmask) < expmask)


def fill_args(dtype) -> tuple:
    """(absmask, pick_bits, pick_float) for ``fill`` on arrays of ``dtype``."""
    utype, absmask, _ = BITS[np.dtype(dtype)]
    pick_b = np.zeros(1, utype)
    return absmask, pick_b, pick_b.view(dtype)

_warm = threading.Lock()
_warmed: bool | None = None


def warmed() -> bool:
    """Whether ``warm_up`` has already loaded the kernels in this process (another client did)."""
    return AVAILABLE and _warmed is True


def warm_up() -> bool:
    """Compile (or load from numba's cache) every specialisation the client uses; whether the
    kernels are usable. Any failure (numba missing or broken) means the numpy path."""
    global _warmed
    if not AVAILABLE:
        return False
    with _warm:
        if _warmed is None:
            try:
                _compile()
                _warmed = True
            except Exception as e:  # pragma: no cover - depends on the environment
                log.warning("numba kernels unavailable (%s); using numpy", e)
                _warmed = False
        return _warmed


def _compile() -> None:
    global fill, fill_narrow, scatter, ack, max_abs_bits, _be16, _be32, _max_abs_bits, _next_random, _mix, _hash32, \
        _round_pairs, _chunk_exponent, _write_header
    import numba
    jit = numba.njit(cache=True)  # short kernels: releasing the GIL would cost more than it gives
    _be16 = jit(_be16)  # module globals: the kernels below resolve them when compiled
    _be32 = jit(_be32)
    _max_abs_bits = max_abs_bits = jit(_max_abs_bits)  # fill calls it; all_finite too
    _next_random, _mix, _hash32 = jit(_next_random), jit(_mix), jit(_hash32)
    _round_pairs = jit(_round_pairs)
    _chunk_exponent, _write_header = jit(_chunk_exponent), jit(_write_header)
    fill, fill_narrow, scatter, ack = jit(_fill), jit(_fill_narrow), jit(_scatter), jit(_ack)

    from .protocol import packet_dtype
    ring = np.zeros(2, packet_dtype(4))
    u8 = ring.view(np.uint8).reshape(2, -1)
    i32 = u8.view(np.int32)
    fq, jq = math.frexp(float(2**31 - 1))
    have = np.zeros(2, np.uint8)
    ncontrib = np.zeros(2, np.uint16)
    acks = np.zeros(2, np.int64)
    meta = np.zeros(3, np.int64)
    sizes = np.zeros(2, np.int64)
    ack(have, acks, 2, np.zeros(2), have, 0.0, -np.inf, np.zeros(3))
    for dt in (np.float32, np.float64):
        x = np.ones(5, dt)
        absmask, pick_b, pick_f = fill_args(dt)
        cap, own = np.full(2, ZERO_EXPONENT, np.int32), np.zeros(2, np.int32)
        fill(x, x.view(pick_b.dtype), absmask, pick_b, pick_f, 0, 0, 2, 4, fq, jq, u8, i32, 0, True, cap, own)
        for prec in (Precision.INT16, Precision.INT8):
            narrow_u8 = np.zeros(2, packet_dtype(4, prec)).view(np.uint8).reshape(2, -1)
            fill_narrow(x, x.view(pick_b.dtype), absmask, pick_b, pick_f, 0, 0, 2, 4, fq, jq,
                        narrow_u8, narrow_u8.view(LANES[prec].contrib), 0, True, 127, np.ones(1, np.uint64),
                        cap, own)
        all_finite(x)
        for mean in (False, True):
            for prec in Precision:
                res = np.zeros(2, packet_dtype(4, prec, result=True))
                scatter(res.view(np.uint8).reshape(2, -1), res["payload"], sizes, 2, 1, 0, 2, 4, 1, have, ncontrib,
                        np.zeros(2, np.int32), np.zeros(5, dt), mean, acks, meta, int(prec), res["payload"].itemsize)
