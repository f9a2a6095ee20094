"""Per-chunk int32 fixed-point quantisation, as docs/protocol.md specifies.

Every function works on whole blocks of chunks at once: a 2-D array of shape ``(n_chunks, elements)``
(the last chunk padded with zeros), one exponent per row. The arithmetic is done in float64 whatever
the input dtype (float16, float32 or float64), and every step is exact except the one rounding to an
integer the protocol asks for:

* ``Q = floor((2**31 - 1) / terms)``, ``terms`` the most contributions one result may hold: ``world``
  under ``sync``, ``ssp`` and ``async``, ``2 * world`` under ``quorum`` (late contributions carried
  into the next round) and ``4 * world`` under ``wbsp`` (local steps); ``terms_for(world, kind)``
  says which. ``m`` the largest magnitude of a chunk;
* the exponent ``e`` is the largest integer with ``m * 2**e <= Q`` (found from the binary exponents
  of ``m`` and ``Q``, never from a logarithm, so it is exact for subnormals and for ``m`` near the
  float64 maximum); an all-zero chunk gets ``ZERO_EXPONENT``;
* ``q = round(x * 2**e)`` (``ldexp`` then round half to even), so ``|q| <= Q``.

Narrow precisions (``Precision.INT16`` and ``INT8``, docs/protocol.md "Precision"): contributions are
int16 or int8 and results twice as wide, so ``Q = min(2**(b-1) - 1, (2**(2b-1) - 1) // terms)``
(``b`` the contribution's bits: 127 for int8 up to 258 terms, 32767 for int16), and the rounding is
stochastic, ``q = floor(x * 2**e + U)`` with ``U`` uniform in [0, 1) (unbiased: the expected ``q`` is
``x * 2**e``), computed in float64 so that the addition is exact enough not to bias it.

``align_and_sum`` is the aggregator's arithmetic (align every contribution to the smallest exponent
with an arithmetic right shift, add in int32) for simulations and tests; ``error_bound`` is the bound
on ``|dequantised sum - exact sum|`` that follows from it.
"""
from __future__ import annotations

import math

import numpy as np

from .protocol.definition import LANES, MAX_MEMBERS, PRECISION_OF_BITS, ZERO_EXPONENT, Precision, StrategyKind

__all__ = ["FLOAT_DTYPES", "HEADROOM", "MAX_HEADROOM", "terms_for", "q_max", "chunk_exponents", "quantise",
           "quantise_flat", "dequantise", "align_and_sum", "error_bound", "output_rounding", "precision_of"]

#: Input dtypes the client accepts; results come back in the same dtype.
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

INT32_MAX = 2**31 - 1
#: smallest positive float64 (subnormal): covers the rounding of a subnormal dequantised value.
_TINY = float(np.ldexp(1.0, -1074))
#: Contributions per member one result may hold, by strategy (1 for the others): ``quorum`` carries
#: late contributions into the next round (at most one per member besides its own), ``wbsp`` takes
#: several local steps per member (the client sends at most 4 per round, its late steps of the
#: previous round carried in included).
HEADROOM = {StrategyKind.QUORUM: 2, StrategyKind.WBSP: 4}
#: The headroom that fits every strategy: a daemon job's rounds are quantised for this many
#: contributions per member unless the job was created with less (the JOIN_ACK's ``headroom``).
MAX_HEADROOM = max(HEADROOM.values())
#: ``n_contrib`` is a u16 in the header: no result holds more terms.
MAX_TERMS = 0xFFFF
#: Most workers one result may sum (a rack job's ``span``): what the headroom leaves room for.
MAX_SPAN = MAX_TERMS // MAX_HEADROOM


def precision_of(value: "Precision | int | str") -> Precision:
    """The Precision a user names by its bits (32, 16, 8, or "int8" ...); ValueError otherwise."""
    if isinstance(value, Precision):
        return value
    text = str(value).strip().lower().removeprefix("int")
    if text.isdigit() and int(text) in PRECISION_OF_BITS:
        return PRECISION_OF_BITS[int(text)]
    raise ValueError(f"precision must be one of {sorted(PRECISION_OF_BITS, reverse=True)} (bits of a "
                     f"contribution), not {value!r}")


def terms_for(world: int, kind: StrategyKind | int = StrategyKind.SYNC) -> int:
    """How many contributions a result may hold under strategy ``kind``: quantise for this many."""
    return int(world) * HEADROOM.get(StrategyKind(kind), 1)


def q_max(world: int, terms: int | None = None, precision: Precision | int = Precision.INT32) -> int:
    """``Q``: the largest magnitude a contribution may carry so that ``terms`` of them (``world`` by
    default) add up without overflowing the result's lanes (int32, or int16 for int8 contributions),
    and that fits the contribution's own lanes."""
    world = int(world)
    if not 1 <= world <= MAX_MEMBERS:
        raise ValueError(f"world must be in 1..{MAX_MEMBERS}, got {world}")
    t = world if terms is None else int(terms)
    if not world <= t <= MAX_TERMS:
        raise ValueError(f"terms must be in {world}..{MAX_TERMS} (at least the world size), got {t}")
    lanes = LANES[Precision(precision)]
    q = min(lanes.contrib_max, lanes.result_max // t)
    if q < 1:
        raise ValueError(f"{lanes.bits}-bit contributions cannot hold {t} terms in "
                         f"{8 * lanes.result_bytes}-bit results")
    return q


def _q_frexp(world: int, terms: int | None = None, precision: Precision | int = Precision.INT32
             ) -> tuple[float, int]:
    # Q = fq * 2**jq, 0.5 <= fq < 1, exact (Q < 2**31)
    return math.frexp(float(q_max(world, terms, precision)))


def chunk_exponents(max_abs: np.ndarray, world: int, terms: int | None = None,
                    precision: Precision | int = Precision.INT32) -> np.ndarray:
    """Per-chunk exponent (int32 array) for chunks whose largest magnitude is ``max_abs``.

    The largest ``e`` with ``max_abs * 2**e <= Q`` (``Q = q_max(world, terms, precision)``);
    ``ZERO_EXPONENT`` where ``max_abs == 0``. ``max_abs`` must be finite and non-negative.
    """
    fq, jq = _q_frexp(world, terms, precision)
    fm, km = np.frexp(np.asarray(max_abs, dtype=np.float64))  # m = fm * 2**km (subnormals too)
    # m * 2**e = fm * 2**(km + e) <= fq * 2**jq: e = jq - km when fm <= fq, one less otherwise.
    e = (jq - km) - (fm > fq)
    e[fm == 0] = ZERO_EXPONENT  # frexp(0) = (0, 0)
    return e.astype(np.int32, copy=False)


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """Float type the scaling and rounding run in. ``x * 2**e`` is a power-of-two scaling whose
    result is below ``2**31`` in magnitude, so it is exact in float32 for float16/float32 input
    (as is rounding it to an integer): the outcome is bit-identical to doing it in float64, with
    half the memory traffic. Anything too small to be exact in float32 rounds to 0 either way."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _quantise_rows(x: np.ndarray, world: int, out: np.ndarray, terms: int | None = None,
                   precision: Precision | int = Precision.INT32,
                   rng: np.random.Generator | None = None, cap: np.ndarray | None = None,
                   own: np.ndarray | None = None) -> np.ndarray:
    """Quantise finite 2-D ``x`` into ``out`` (the precision's integer type or wider, same shape);
    returns exponents. No validation: the caller checked dtype, shape and finiteness. Narrow
    precisions round stochastically with ``rng`` (a fresh default generator when None). ``cap``:
    per row, an exponent not to exceed (a scale the members share, ``aggd_client.scales``); a
    coarser one (smaller) still fits. ``own`` receives each row's own exponent."""
    m = np.maximum(x.max(axis=1), -x.min(axis=1))  # no |x| temporary
    e = chunk_exponents(m, world, terms, precision)
    if own is not None:
        own[...] = e
    if cap is not None:
        e = np.minimum(e, cap).astype(np.int32, copy=False)
    if Precision(precision) == Precision.INT32:
        y = np.ldexp(x.astype(_work_dtype(x.dtype), copy=False), e[:, None])
        np.rint(y, out=y)
        out[...] = y  # |y| <= Q < 2**31: exact
        return e
    y = np.ldexp(x.astype(np.float64), e[:, None])  # exact; |y| <= Q <= 32767
    y += (rng if rng is not None else np.random.default_rng()).random(y.shape)
    np.floor(y, out=y)
    q = q_max(world, terms, precision)
    np.clip(y, -q, q, out=y)  # Q + U can round up to Q + 1 in float64
    out[...] = y
    return e


def quantise(chunks: np.ndarray, world: int, out: np.ndarray | None = None, *,
             terms: int | None = None, precision: Precision | int = Precision.INT32,
             rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a ``(n_chunks, elements)`` float block; returns ``(q, exponents int32)``, ``q`` of the
    precision's contribution type (int32, int16 or int8).

    ``out``, if given, receives ``q`` (an array of the same shape that holds the precision's values,
    e.g. the payload column of a packet array). ``terms``: contributions a result may hold
    (``terms_for(world, kind)``; default ``world``). ``rng``: the generator of a narrow precision's
    stochastic rounding. Raises ``ValueError`` on NaN or infinity.
    """
    x = np.asarray(chunks)
    if x.ndim != 2:
        raise ValueError(f"quantise takes a (n_chunks, elements) block, got shape {x.shape}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"aggd quantises float16/32/64, got {x.dtype}")
    q_max(world, terms, precision)
    if out is None:
        out = np.empty(x.shape, LANES[Precision(precision)].contrib)
    if x.size == 0:
        return out, np.full(x.shape[0], ZERO_EXPONENT, np.int32)
    if not (np.isfinite(x.max()) and np.isfinite(x.min())):  # NaN propagates through max/min
        raise ValueError("cannot quantise a non-finite value (NaN or infinity)")
    return out, _quantise_rows(x, world, out, terms, precision, rng)


def quantise_flat(x: np.ndarray, world: int, elements: int, *, terms: int | None = None,
                  precision: Precision | int = Precision.INT32, rng: np.random.Generator | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a flat array of any length, chunked by ``elements`` (last chunk zero-padded)."""
    x = np.ravel(x)
    n_chunks = -(-x.size // elements)
    if x.size != n_chunks * elements:
        padded = np.zeros(n_chunks * elements, x.dtype)
        padded[:x.size] = x
        x = padded
    return quantise(x.reshape(n_chunks, elements), world, terms=terms, precision=precision, rng=rng)


def dequantise(q: np.ndarray, exponents: np.ndarray, out: np.ndarray | None = None,
               divisor: np.ndarray | None = None) -> np.ndarray:
    """``q * 2**-exponent`` per chunk in float64 (exact unless subnormal), divided by ``divisor``.

    ``q`` is ``(n_chunks, elements)``; ``exponents`` and ``divisor`` have one value per chunk.
    ``out``, if given, receives the values cast to its dtype (float16/32 round once, there).
    """
    e = np.asarray(exponents).astype(np.int32)
    with np.errstate(over="ignore"):  # a sum beyond the float64 range is inf, as it should be
        v = np.ldexp(np.asarray(q).astype(np.float64), -e[:, None])
    if divisor is not None:
        v /= np.asarray(divisor, dtype=np.float64)[:, None]
    if out is None:
        return v
    with np.errstate(over="ignore"):  # a float16 sum may not fit: it becomes inf, as a cast would
        out[...] = v
    return out


def align_and_sum(q: np.ndarray, exponents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The aggregator's arithmetic: contributions ``q`` ``(world, n_chunks, elements)`` int32 with
    ``exponents`` ``(world, n_chunks)`` are aligned to each chunk's smallest exponent by an
    arithmetic right shift (a floor) and added. Returns ``(sum int64, exponent int32)``; the sum is
    int64 so callers can check that it fits int32 (it always does for honest senders).
    """
    q = np.asarray(q)
    if q.dtype not in (np.int8, np.int16, np.int32):
        q = q.astype(np.int32)
    e = np.asarray(exponents).astype(np.int32)
    e_min = e.min(axis=0)
    # |q| < 2**31, so any shift of 31 or more yields floor(q / 2**shift) (0 or -1) as well.
    shift = np.minimum(e - e_min[None, :], 31)
    aligned = np.right_shift(q.astype(np.int32), shift[:, :, None])
    return aligned.sum(axis=0, dtype=np.int64), e_min


def error_bound(world: int, exponents: np.ndarray, n_contrib: np.ndarray | int | None = None,
                precision: Precision | int = Precision.INT32) -> np.ndarray:
    """Per-chunk bound on ``|dequantised result - exact float64 sum|`` (same units as the data).

    ``exponents`` are the result exponents (one per chunk). Each of the ``world`` contributions
    loses at most half its own step (``<= u/2``, ``u = 2**-exponent``) to rounding, and at most
    once more less than ``u`` to the aligning right shift (a floor), hence ``1.5 * world * u``.
    A result holding another number of contributions than ``world`` (``n_contrib`` of the result:
    more under ``quorum`` with carried contributions and under ``wbsp`` with local steps, fewer for
    an ``async`` running sum or a ``quorum`` released by its deadline) has ``1.5 * n_contrib * u``.
    The headroom (``terms``) a sender quantised with does not enter: it only sets how large ``u``
    is (``u`` is about ``2 * max|x| * terms / 2**31``, so the bound is about
    ``3 * n_contrib * terms * max|x| / 2**31``).
    Narrow precisions round stochastically, which loses less than a whole step (``< u``): their
    bound is ``2 * n_contrib * u``, with ``u`` about ``2 * max|x| / 127`` (int8) or ``/ 32767`` (int16).
    A chunk whose contributions were all zero (``ZERO_EXPONENT``) is exact. The result of
    ``dequantise`` in float64 is exact unless subnormal; a smallest subnormal is added to cover that
    rounding. Divide by ``n_contrib`` for a mean; float16/float32 outputs round once more (see
    ``output_rounding``).
    """
    if not 1 <= int(world) <= MAX_MEMBERS:
        raise ValueError(f"world must be in 1..{MAX_MEMBERS}, got {world}")
    e = np.asarray(exponents).astype(np.int32)
    n = np.full(e.shape, float(world)) if n_contrib is None else \
        np.broadcast_to(np.asarray(n_contrib, dtype=np.float64), e.shape)
    per_term = 1.5 if Precision(precision) == Precision.INT32 else 2.0
    b = np.ldexp(per_term * n, -e) + _TINY
    return np.where(e == ZERO_EXPONENT, 0.0, b)


def output_rounding(values: np.ndarray) -> np.ndarray:
    """Per-element bound on the rounding of a float64 result stored as ``values`` (their dtype).

    Half a unit in the last place at ``values`` for float16/float32 outputs, zero for float64
    (whose rounding ``error_bound`` already covers). Add it to ``error_bound`` for the end-to-end
    bound of what ``AggClient.allreduce`` returns.
    """
    v = np.asarray(values)
    if v.dtype == np.float64:
        return np.zeros(v.shape)
    return np.spacing(np.abs(v)).astype(np.float64) / 2
