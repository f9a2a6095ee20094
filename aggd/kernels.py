"""numba kernels for the user-space aggregator's hot loops.

Same contract as ``aggd.model.np_load`` / ``np_accumulate`` (the numpy reference the unit tests
compare against); ``KERNEL_ARITHMETIC`` plugs them into ``AggregatorModel``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .model import Arithmetic

_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_MAX_SHIFT = 31


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
    """Add ``src`` into ``acc`` at the smaller exponent; return (exponent, overflowed).

    The finer operand is shifted right arithmetically by the difference (clamped to 31); sums are
    computed in int64 and stored wrapped to int32, as the C data plane stores them.
    """
    exp = min(acc_exp, src_exp)
    sa = min(acc_exp - exp, _MAX_SHIFT)
    ss = min(src_exp - exp, _MAX_SHIFT)
    n = min(src.shape[0], acc.shape[0])
    overflow = False
    for i in range(n):
        t = (np.int64(acc[i]) >> sa) + (np.int64(src[i]) >> ss)
        if t > _INT32_MAX or t < _INT32_MIN:
            overflow = True
        acc[i] = np.int32(((t - _INT32_MIN) & 0xFFFFFFFF) + _INT32_MIN)  # wrap explicitly, as C does
    if sa:
        for i in range(n, acc.shape[0]):
            acc[i] = acc[i] >> sa
    return exp, overflow


def _accumulate(acc: np.ndarray, acc_exp: int, src: np.ndarray, src_exp: int) -> tuple[int, bool]:
    exp, overflow = accumulate(acc, acc_exp, src, src_exp)
    return int(exp), bool(overflow)


def warm_up() -> None:
    """Compile (or load from cache) for the array types the server passes, before traffic arrives."""
    acc = np.zeros(4, np.int32)
    for src in (np.zeros(4, np.int32), np.frombuffer(bytes(16), "<i4"),
                np.frombuffer(bytearray(16), "<i4")):
        load(acc, src)
        _accumulate(acc, 0, src, 0)


KERNEL_ARITHMETIC = Arithmetic(load, _accumulate)
