"""numba kernels for the user-space aggregator's hot loops.

Same contract as ``aggd.core.model.np_load`` / ``np_accumulate`` / ``np_narrow`` (the numpy reference
the unit tests compare against); ``KERNEL_ARITHMETIC`` plugs them into ``AggregatorModel``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from aggd.core.model import Arithmetic
from aggd.core.robust import Combine, CombineKind, common_exponent, effective_trim

_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_MAX_SHIFT = 31
_MAX_SUM_SHIFT = 63
#: Rows up to this many are sorted by a network of min/max (branch-free); more by insertion.
_NETWORK_MAX = 12


@njit(cache=True, nogil=True)
def load(dst, src):
    """Copy ``src`` into ``dst``, zero-padding a short ``src`` and ignoring elements beyond ``dst``."""
    n = min(src.shape[0], dst.shape[0])
    for i in range(n):
        dst[i] = src[i]
    for i in range(n, dst.shape[0]):
        dst[i] = 0


@njit(cache=True, nogil=True)
def accumulate(acc, acc_exp, src, src_exp):
    """Add int32 ``src`` into the exact int64 sums ``acc`` at the smaller exponent; return it.

    The finer operand is shifted right arithmetically by the difference, clamped to 63 for the
    sums and 31 for the int32 contribution (exact floor divisions, as the C data plane does).
    """
    exp = min(acc_exp, src_exp)
    sa = min(acc_exp - exp, _MAX_SUM_SHIFT)
    ss = min(src_exp - exp, _MAX_SHIFT)
    n = min(src.shape[0], acc.shape[0])
    for i in range(n):
        acc[i] = (acc[i] >> sa) + (np.int64(src[i]) >> ss)
    if sa:
        for i in range(n, acc.shape[0]):
            acc[i] = acc[i] >> sa
    return exp


@njit(cache=True, nogil=True)
def narrow(values, out):
    """Write the sums' low 32 bits into ``out``; return whether any sum did not fit int32."""
    overflow = False
    for i in range(values.shape[0]):
        v = values[i]
        if v > _INT32_MAX or v < _INT32_MIN:
            overflow = True
        out[i] = np.int32(((v - _INT32_MIN) & 0xFFFFFFFF) + _INT32_MIN)  # wrap explicitly, as C does
    return overflow


@njit(cache=True, nogil=True)
def narrow16(values, out):
    """``narrow`` for int16 results (int8 contributions), whose range is the symmetric [-32767,
    32767] (``aggd.core.model``, "Results")."""
    overflow = False
    for i in range(values.shape[0]):
        v = values[i]
        if v > 32767 or v < -32767:
            overflow = True
        out[i] = np.int16(((v + 32768) & 0xFFFF) - 32768)
    return overflow


@njit(cache=True, nogil=True)
def combine_ranks(rows, exps, ranks, trim, zeno, rho, out):
    """``aggd.core.robust.combine_rows`` of rows ``ranks`` of ``rows`` (exponents ``exps``, by row)
    for ``trim`` rows dropped at each end (already ``effective_trim``), or with ``zeno`` the rows
    ``zeno_keeps`` (its float sums in element order, a row's own accumulator each), into int64
    ``out``; returns the common exponent (``ranks`` non-empty)."""
    n, size = ranks.shape[0], rows.shape[1]
    exp = exps[ranks[0]]
    for k in range(1, n):
        exp = min(exp, exps[ranks[k]])
    srt = np.empty((n, size), np.int64)        # the aligned rows, then sorted per coordinate
    for r in range(n):
        sh = min(exps[ranks[r]] - exp, _MAX_SHIFT)
        for i in range(size):
            srt[r, i] = np.int64(rows[ranks[r], i]) >> sh
    if zeno:
        aligned = srt.copy()
    if n <= _NETWORK_MAX:
        # a bubble network of min/max, a whole row pair at a time: no branch to mispredict, and
        # the loop over the values vectorises
        for a in range(n - 1):
            for j in range(n - 1 - a):
                for i in range(size):
                    lo, hi = srt[j, i], srt[j + 1, i]
                    srt[j, i], srt[j + 1, i] = min(lo, hi), max(lo, hi)
    else:                                      # insertion sort per coordinate: fewer steps for many rows
        col = np.empty(n, np.int64)
        for i in range(size):
            for r in range(n):
                v = srt[r, i]
                j = r
                while j > 0 and col[j - 1] > v:
                    col[j] = col[j - 1]
                    j -= 1
                col[j] = v
            for r in range(n):
                srt[r, i] = col[r]
    kk = n - 2 * trim
    for i in range(size):
        out[i] = 0
    for r in range(trim, n - trim):
        for i in range(size):
            out[i] += srt[r, i]
    for i in range(size):
        out[i] = (2 * out[i] * n + kk) // (2 * kk)     # floor division, as numpy's
    if zeno:
        m = np.empty(size, np.float64)
        for i in range(size):
            if n % 2:
                m[i] = np.float64(srt[n // 2, i])
            else:
                m[i] = (np.float64(srt[n // 2 - 1, i]) + np.float64(srt[n // 2, i])) * 0.5
        kept = 0
        keep = np.zeros(n, np.bool_)
        for r in range(n):
            d = 0.0
            q = 0.0
            for i in range(size):              # in element order, as the rule says
                x = np.float64(aligned[r, i])
                d += x * m[i]
                q += x * x
            if d >= rho * q:
                keep[r] = True
                kept += 1
        if kept:
            for i in range(size):
                out[i] = 0
            for r in range(n):
                if keep[r]:
                    for i in range(size):
                        out[i] += aligned[r, i]
            for i in range(size):
                out[i] = (2 * out[i] * n + kept) // (2 * kept)
    return exp


def _combine(rows: np.ndarray, exps: np.ndarray, how) -> tuple[np.ndarray, int]:
    """``combine_rows``'s contract: every row of ``rows`` combined by ``how``."""
    out = np.zeros(rows.shape[1], np.int64)
    if len(rows) == 0:
        return out, common_exponent(exps)
    exp = combine_ranks(rows, np.ascontiguousarray(exps, np.int64), np.arange(len(rows)),
                        effective_trim(how, len(rows)), how.kind == CombineKind.ZENO, float(how.rho), out)
    return out, int(exp)


def _accumulate(acc: np.ndarray, acc_exp: int, src: np.ndarray, src_exp: int) -> int:
    return int(accumulate(acc, acc_exp, src, src_exp))


def _narrow(values: np.ndarray, dtype: np.dtype = np.dtype("<i4")) -> tuple[np.ndarray, bool]:
    out = np.empty(values.shape[0], dtype)
    return out, bool((narrow16 if out.itemsize == 2 else narrow)(values, out))


def warm_up() -> None:
    """Compile (or load from cache) for the array types the server passes, before traffic arrives."""
    acc = np.zeros(4, np.int64)
    for src in (np.zeros(4, np.int32), np.frombuffer(bytes(16), "<i4"),
                np.frombuffer(bytearray(16), "<i4"), np.frombuffer(bytes(16), "<i2"),
                np.frombuffer(bytes(16), "<i1")):
        load(acc, src)
        _accumulate(acc, 0, src, 0)
    _narrow(acc)
    _narrow(acc, np.dtype("<i2"))
    _combine(np.zeros((2, 4), np.int32), np.zeros(2, np.int64), Combine(CombineKind.ZENO))


KERNEL_ARITHMETIC = Arithmetic(load, _accumulate, _narrow, _combine)
