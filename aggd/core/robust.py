"""Robust jobs: how a round's contributions are combined when members may send garbage.

A plain job sums. A robust job keeps every member's contribution to a round apart (its *row*) and
releases, times the number of rows, the coordinate-wise median or trimmed mean of the rows, or
(``zeno``) the mean of the rows that score at least 0 against the median: the result stays a sum
to the client (divided by ``n_contrib`` it is the statistic), so the protocol is unchanged
(docs/protocol.md, "Robust jobs"). Each release also scores every row against the result,
Zeno-style, which the policy reads to quarantine a member whose score stays bad
(``aggd.core.departures.ScoreWatch``).

Pure: numpy in, numpy out. ``combine_rows`` is the reference the user-space kernel
(``aggd.dataplane.userspace.kernels.combine_ranks``) is tested equal to.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import numpy as np

from aggd_client.protocol import ZERO_EXPONENT, StrategyKind

#: An int32 row is shifted by at most this to a common exponent (its sign by then), as a sum is.
MAX_ROW_SHIFT = 31


class CombineKind(enum.IntEnum):
    SUM = 0
    MEDIAN = 1
    TRIMMED = 2
    ZENO = 3


#: The strategies a robust job runs: each releases a round's rows together. async answers every
#: contribution with a running sum and wbsp adds several steps per member: neither has one row a member.
ROBUST_STRATEGIES = frozenset({StrategyKind.SYNC, StrategyKind.QUORUM, StrategyKind.SSP})


@dataclass(frozen=True)
class Combine:
    """``sum`` (every contribution added, the default), ``median`` (coordinate-wise),
    ``trimmed:t`` (coordinate-wise mean of the rows left once the ``t`` largest and ``t`` smallest
    are dropped; at most (n - 1) // 2 each side of n rows), or ``zeno`` (the mean of the rows
    ``x`` with ``<x, m> >= rho·<x, x>``, ``m`` the median: a row that points away from the others
    or dwarfs them is left out, the honest ones are averaged as a sum would; none: the median).
    ``rho``: the job's ``score_rho``, which the policy's score uses too."""
    kind: CombineKind = CombineKind.SUM
    trim: int = 0
    rho: float = 0.05

    @property
    def robust(self) -> bool:
        return self.kind != CombineKind.SUM

    def __str__(self) -> str:
        if self.kind == CombineKind.TRIMMED:
            return f"trimmed:{self.trim}"
        return self.kind.name.lower()


SUM = Combine()
_TEXT = re.compile(r"(sum|median|zeno|trimmed:(\d+))")


def parse_combine(text: str, rho: float = 0.05) -> Combine:
    """``sum``, ``median``, ``zeno`` or ``trimmed:t`` (t >= 1), with the job's ``rho``; ValueError
    saying what is accepted."""
    m = _TEXT.fullmatch(str(text).strip().lower())
    if m is None:
        raise ValueError(f"combine {text!r}: one of 'sum', 'median', 'zeno', 'trimmed:t' (t >= 1 rows "
                         f"dropped at each end)")
    if m.group(2) is not None:
        trim = int(m.group(2))
        if trim < 1:
            raise ValueError(f"combine {text!r}: trimmed needs t >= 1 (trimmed:0 is the mean: use 'sum')")
        return Combine(CombineKind.TRIMMED, trim, rho)
    return Combine(CombineKind[m.group(1).upper()], 0, rho)


def check_strategy(combine: Combine, kind: StrategyKind) -> None:
    """ValueError if a job combining by ``combine`` cannot run strategy ``kind``."""
    if combine.robust and StrategyKind(kind) not in ROBUST_STRATEGIES:
        names = ", ".join(sorted(k.name.lower() for k in ROBUST_STRATEGIES))
        raise ValueError(f"a {combine} job runs {names}, not {StrategyKind(kind).name.lower()} "
                         f"(it needs one row per member, released together)")


def effective_trim(combine: Combine, n: int) -> int:
    """Rows dropped at each end of ``n`` rows (a median keeps the middle one or two; so does zeno's
    reference)."""
    if combine.kind in (CombineKind.MEDIAN, CombineKind.ZENO):
        return (n - 1) // 2
    return min(combine.trim, (n - 1) // 2)


def common_exponent(exps: np.ndarray) -> int:
    """The rows' common exponent: the coarsest (smallest), as a sum aligns; ZERO_EXPONENT if none."""
    return int(exps.min()) if len(exps) else ZERO_EXPONENT


def combine_rows(rows: np.ndarray, exps: np.ndarray, combine: Combine) -> tuple[np.ndarray, int]:
    """The result of ``n`` rows (int[n, elements] at exponents int[n]) as an exact int64 sum at
    the returned exponent: each row shifted right (arithmetically, at most MAX_ROW_SHIFT) to the
    common exponent, then per coordinate the middle ``n - 2t`` sorted values (``t``:
    ``effective_trim``) summed, ``S``, and scaled to ``n`` rows: ``floor((2·S·n + k) / (2k))``
    with ``k = n - 2t`` (the mean rounded half up, times ``n``). A median of an even ``n`` is
    exact: ``(n/2)·(a + b)``. ``zeno``: ``S`` sums the ``k`` rows that ``zeno_keeps``, whole (the
    median's when it keeps none)."""
    n = len(rows)
    exp = common_exponent(exps)
    if n == 0:
        return np.zeros(rows.shape[1], np.int64), exp
    shifts = np.minimum(exps.astype(np.int64) - exp, MAX_ROW_SHIFT)
    aligned = rows.astype(np.int64) >> shifts[:, None]
    ordered = np.sort(aligned, axis=0)
    t = effective_trim(combine, n)
    if combine.kind == CombineKind.ZENO:
        keep = zeno_keeps(aligned, ordered, combine.rho)
        if keep.any():
            k = int(keep.sum())
            return (2 * aligned[keep].sum(axis=0) * n + k) // (2 * k), exp
    k = n - 2 * t
    s = ordered[t:n - t].sum(axis=0)
    return (2 * s * n + k) // (2 * k), exp


def zeno_keeps(aligned: np.ndarray, ordered: np.ndarray, rho: float) -> np.ndarray:
    """Which of the aligned rows (int64[n, elements]; ``ordered``: sorted per coordinate) score at
    least 0 against their coordinate-wise median ``m`` (float64: the middle value, or the two
    middle ones' sum times 0.5): ``<x, m> >= rho·<x, x>``, both sums taken in float64 in element
    order (``cumsum``: the kernel adds in the same order, so both keep the same rows)."""
    n = len(aligned)
    m = ordered[n // 2].astype(np.float64)
    if n % 2 == 0:
        m = (ordered[n // 2 - 1].astype(np.float64) + m) * 0.5
    x = aligned.astype(np.float64)
    dots = np.cumsum(x * m, axis=1)[:, -1]
    norms = np.cumsum(x * x, axis=1)[:, -1]
    return dots >= rho * norms


def score_terms(rows: np.ndarray, exps: np.ndarray, values: np.ndarray, exponent: int) -> tuple[np.ndarray, float]:
    """Per row ``i``: ``(<x_i, m>, <x_i, x_i>)`` in float64, and ``<m, m>``, where ``x_i`` is the
    row's value and ``m`` the statistic (the result over ``n`` rows). The inputs of a Zeno score:
    ``(dot - rho·norm) / ref`` over a window (``aggd.core.departures.zeno_score``)."""
    n = len(rows)
    if n == 0:
        return np.zeros((0, 2)), 0.0
    m = np.ldexp(values.astype(np.float64), -int(exponent)) / n
    x = np.ldexp(rows.astype(np.float64), -exps.astype(np.int64)[:, None])
    return np.stack([x @ m, np.einsum("ij,ij->i", x, x)], axis=1), float(m @ m)
