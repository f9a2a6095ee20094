"""The user-space aggregator's fast path: a received batch's common case decided in numba.

The common case is a well-formed contribution of exactly its job's packet size (a narrow one with or
without room for its result), from the
registered address of a member, with a step below STEPS, to a slot where no bank is past its
deadline, that either goes to the open bank of its key (rule 1: added, or dropped ``duplicate``),
opens the bank of a key newer than the slot's newest (rule 3: opened and added, or dropped
``busy``), is the member's retransmission into its released round (rule 2: the result re-sent to
it, unless it is a deadline release's first answer), or is late to its released round (rule 4, a
quorum's straggler: carried into the chunk's next round, opening a holding bank for it if need be,
and answered with its round's result). The kernel decides those exactly as ``AggregatorModel`` does
-- counters, drops, the result's bytes -- with the same arithmetic kernels
(``aggd.dataplane.userspace.kernels``). Any other packet (re-reads, late contributions whose round
is gone, timeouts, malformed or foreign packets, NACKs, a short payload, a release
observer) stops the kernel and goes to ``AggregatorModel.process`` unchanged; the kernel then goes
on from the packet after it. tests/unit/test_fastpath.py plays random sequences through both.

A robust job (docs/protocol.md, "Robust jobs") is served alike: the kernel keeps each contribution
in its member's row and combines the rows at the release (``kernels.combine_ranks``), adding the score
terms the model's ``_combine`` adds (the same sums, in another order: equal to rounding).

A job's banks live twice: in the model's ``Bank`` objects (what the model and its readers use)
and in arrays here (what the kernel uses). The sums (``Bank.values``, rebound to views of the
array here), the counters and the drops are shared, not copied. A slot's other fields go from
arrays to objects before the model handles a packet of that slot, if the kernel changed the slot
(``dirty``), and back after; ``sync`` brings every changed slot to the objects for readers.
"""
from __future__ import annotations

import math
import socket
import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit

from aggd_client.mrecv import SOCKADDR_IN, sockaddr_in
from aggd_client.protocol import HEADER_DTYPE, HEADER_SIZE, INT8_MAX_CONTRIBUTIONS, MAGIC, RESULT_WINDOW, SKIP_MAX, \
    VERSION, ZERO_EXPONENT, Counter, DropReason, MAX_MEMBERS, Flag, MsgType, Precision, StrategyKind, values_per_packet

from aggd.dataplane.userspace.kernels import accumulate, combine_ranks, load, narrow, narrow16
from aggd.core.model import (ASYNC_MAX_OPEN, BANKS, M_CONTRIBUTIONS, M_LAG_NS, M_LAST_NS, M_LAST_ROUND, M_LATE,
                             RESULT_RANK, S_DOT, S_NORM, S_REF, STEPS, AggregatorModel, Bank, BankState, JobState,
                             Slot, Verdict)
from aggd.core.robust import CombineKind

# Header field offsets, from the protocol definition.
_OFF = {name: off for name, (_, off) in HEADER_DTYPE.fields.items()}
O_MAGIC, O_VERSION, O_TYPE, O_JOB = _OFF["magic"], _OFF["version"], _OFF["type"], _OFF["job"]
O_RANK, O_ROUND, O_CHUNK, O_COUNT = _OFF["rank"], _OFF["round"], _OFF["chunk"], _OFF["count"]
O_SVERSION, O_EXPONENT, O_FLAGS = _OFF["strategy_version"], _OFF["exponent"], _OFF["flags"]
O_CONTRIBUTORS, O_NCONTRIB, O_STEP = _OFF["contributors"], _OFF["n_contrib"], _OFF["step"]
O_STRATEGY, O_PARAM, O_SKIP = _OFF["strategy"], _OFF["param"], _OFF["skip"]
O_CODE = _OFF["code"]
HDR = HEADER_SIZE
HDR32 = HEADER_SIZE // 4
HDR16 = HEADER_SIZE // 2
INT32, INT16, INT8 = int(Precision.INT32), int(Precision.INT16), int(Precision.INT8)
CONTRIB, RESULT = int(MsgType.CONTRIB), int(MsgType.RESULT)
RETRANSMIT, OVERFLOW, ORDERED, REREAD = int(Flag.RETRANSMIT), int(Flag.OVERFLOW), int(Flag.ORDERED), int(Flag.REREAD)
EMPTY, OPEN, RELEASED = int(BankState.EMPTY), int(BankState.OPEN), int(BankState.RELEASED)
QUORUM, SSP, ASYNC = int(StrategyKind.QUORUM), int(StrategyKind.SSP), int(StrategyKind.ASYNC)
C_RX_PACKETS, C_RX_BYTES, C_ELEMENTS = int(Counter.RX_PACKETS), int(Counter.RX_BYTES), int(Counter.ELEMENTS)
C_CONTRIBUTIONS, C_RELEASED, C_OVERFLOWS = int(Counter.CONTRIBUTIONS), int(Counter.RELEASED), int(Counter.OVERFLOWS)
C_RETRANSMITS, C_PARTIALS, C_REREADS = int(Counter.RETRANSMITS), int(Counter.PARTIALS), int(Counter.REREADS)
C_CARRIED = int(Counter.CARRIED)
CARRIED = int(Flag.CARRIED)
U32_MAX = 0xFFFFFFFF
D_DUPLICATE, D_BUSY = int(DropReason.DUPLICATE), int(DropReason.BUSY)
SUM, TRIMMED, ZENO = int(CombineKind.SUM), int(CombineKind.TRIMMED), int(CombineKind.ZENO)

# A bank's fields in the kernel's arrays: small ones in int64 ``bi``, 64-bit ones in uint64 ``bu``.
(F_STATE, F_ROUND, F_CHUNK, F_HOLDING, F_NCONTRIB, F_EXPONENT, F_FLAGS, F_VERSION, F_KIND, F_PARAM,
 F_TIMEOUT_US, F_UNANNOUNCED, F_COUNT, F_CARRIED) = range(14)
NF = 14
U_BITMAP, U_LATE, U_TFIRST, U_HELD = range(4)
NU = 4
#: Strategy table rows for the kernel: from_round, version, kind, param, timeout_us.
T_FROM, T_VERSION, T_KIND, T_PARAM, T_TIMEOUT = range(5)

#: What the kernel did with a packet (``out_kind``).
SLOW = 0       #: not decided here: the model's
ABSORBED = 1   #: added, nothing sent (Verdict("drop"))
DROPPED = 2    #: dropped, ``out_reason`` counted
TO_GROUP = 3   #: released: the result in ``out[i]`` goes to the job's group
TO_SENDER = 4  #: an async running sum in ``out[i]`` goes back to the sender


@njit(inline="always")
def _be16(p, o):
    return (np.int64(p[o]) << 8) | np.int64(p[o + 1])


@njit(inline="always")
def _be32(p, o):
    return (np.int64(p[o]) << 24) | (np.int64(p[o + 1]) << 16) | (np.int64(p[o + 2]) << 8) | np.int64(p[o + 3])


@njit(inline="always")
def _be64(p, o):
    v = np.uint64(0)
    for k in range(8):
        v = (v << np.uint64(8)) | np.uint64(p[o + k])
    return v


@njit(inline="always")
def _put(p, o, nbytes, v):
    for k in range(nbytes):
        p[o + k] = np.uint8((v >> (8 * (nbytes - 1 - k))) & 0xFF)


@njit(inline="always")
def _put64(p, o, v):
    for k in range(8):
        p[o + k] = np.uint8((v >> np.uint64(8 * (7 - k))) & np.uint64(0xFF))


@njit(inline="always")
def _popcount(v):
    n = 0
    while v:
        v &= v - np.uint64(1)
        n += 1
    return n


@njit(inline="always")
def _key_less(r1, c1, r2, c2):
    return r1 < r2 or (r1 == r2 and c1 < c2)


@njit(cache=True, nogil=True)
def _governing(table, round_):
    """aggd.core.strategy.governing in numba (a compiled copy: tests/unit/test_fastpath.py plays
    swapped tables through both): the row index."""
    best = -1
    for e in range(table.shape[0]):
        if table[e, T_FROM] <= round_ and (best < 0 or table[e, T_FROM] > table[best, T_FROM]
                                           or (table[e, T_FROM] == table[best, T_FROM]
                                               and table[e, T_VERSION] > table[best, T_VERSION])):
            best = e
    if best >= 0:
        return best
    for e in range(table.shape[0]):
        if best < 0 or table[e, T_FROM] < table[best, T_FROM] or (
                table[e, T_FROM] == table[best, T_FROM] and table[e, T_VERSION] > table[best, T_VERSION]):
            best = e
    return best


@njit(inline="always")
def _reusable(bi, bu, s, b, everyone, kind, shared_s):
    """Slot.reusable of bank (s, b) for a new round that ``kind`` governs (every member awaited)."""
    if bi[s, b, F_STATE] != RELEASED:
        return False
    kb = bi[s, b, F_KIND]
    if shared_s != 0 and (kb == SSP or kb == ASYNC or kb == QUORUM):
        return bu[s, b, U_HELD] & everyone == everyone
    return not (kb == SSP or kb == ASYNC) or kind == QUORUM or bu[s, b, U_HELD] & everyone == everyone


@njit(inline="always")
def _hold_bank(bi, bu, s, everyone, kind, shared_s):
    """AggregatorModel._hold's choice of bank for a carry's holding round: Slot.free_bank, if
    Slot.n_free leaves another bank for the rounds in progress; -1 when there is none (busy)."""
    empty = 0
    first_empty = -1
    oldest = -1
    for b in range(BANKS):
        if bi[s, b, F_STATE] == EMPTY:
            empty += 1
            if first_empty < 0:
                first_empty = b
        elif bi[s, b, F_STATE] == RELEASED and (oldest < 0 or _key_less(
                bi[s, b, F_ROUND], bi[s, b, F_CHUNK], bi[s, oldest, F_ROUND], bi[s, oldest, F_CHUNK])):
            oldest = b
    n_free = empty
    if oldest >= 0 and _reusable(bi, bu, s, oldest, everyone, kind, shared_s):
        for b in range(BANKS):
            if _reusable(bi, bu, s, b, everyone, kind, shared_s):
                n_free += 1
    if n_free < 2:
        return -1
    if first_empty >= 0:
        return first_empty
    return oldest      # reusable: n_free counted it


@njit(inline="always")
def _add_payload(bi, values, s, b, fresh, exponent, payload):
    if fresh:
        load(values[s, b], payload)
        bi[s, b, F_EXPONENT] = exponent
    else:
        bi[s, b, F_EXPONENT] = accumulate(values[s, b], bi[s, b, F_EXPONENT], payload, exponent)


@njit(inline="always")
def _add_values(bi, values, s, b, i, fresh, exponent, prec, stage32, stage16, stage8):
    """AggregatorModel._add's sums of a summing job: packet ``i``'s values loaded into a fresh
    bank (s, b), else added (one call a type: numba types each payload view on its own)."""
    elements = values.shape[2]
    if prec == INT32:
        _add_payload(bi, values, s, b, fresh, exponent, stage32[i, HDR32:HDR32 + elements])
    elif prec == INT16:
        _add_payload(bi, values, s, b, fresh, exponent, stage16[i, HDR16:HDR16 + elements])
    else:
        _add_payload(bi, values, s, b, fresh, exponent, stage8[i, HDR:HDR + elements])


@njit(cache=True, nogil=True)
def _result(bi, bu, values, s, b, job, served_flags, out, out32, out16, i, counters, prec, flags=0):
    """AggregatorModel._result of bank (s, b) into ``out[i]`` (a job of precision ``prec``: int16
    results for int8 contributions, int32 otherwise), with ``flags`` added; its length."""
    elements = values.shape[2]
    o = out[i]
    if prec == INT8:
        over = narrow16(values[s, b], out16[i, HDR16:HDR16 + elements]) or \
            bi[s, b, F_NCONTRIB] > INT8_MAX_CONTRIBUTIONS
    else:
        over = narrow(values[s, b], out32[i, HDR32:HDR32 + elements])
    if over:
        extra = OVERFLOW | flags
        counters[C_OVERFLOWS] += np.uint64(1)
    else:
        extra = flags
    for k in range(HDR):
        o[k] = 0
    _put(o, O_MAGIC, 2, MAGIC)
    o[O_VERSION] = VERSION
    o[O_TYPE] = RESULT
    _put(o, O_JOB, 2, job)
    _put(o, O_RANK, 2, RESULT_RANK)
    _put(o, O_ROUND, 4, bi[s, b, F_ROUND])
    _put(o, O_CHUNK, 4, bi[s, b, F_CHUNK])
    _put(o, O_COUNT, 2, bi[s, b, F_COUNT])   # the round's (Bank.count)
    _put(o, O_SVERSION, 2, bi[s, b, F_VERSION])
    _put(o, O_EXPONENT, 2, bi[s, b, F_EXPONENT] & 0xFFFF)
    o[O_FLAGS] = np.uint8(bi[s, b, F_FLAGS] | extra | served_flags)
    _put64(o, O_CONTRIBUTORS, bu[s, b, U_BITMAP])
    _put(o, O_NCONTRIB, 2, bi[s, b, F_NCONTRIB])
    o[O_STRATEGY] = np.uint8(bi[s, b, F_KIND])
    o[O_PARAM] = np.uint8(bi[s, b, F_PARAM])
    o[O_CODE] = np.uint8(prec)
    return HDR + (2 if prec == INT8 else 4) * elements


@njit(cache=True, nogil=True, fastmath=True)
def _add_scores(values, rows, row_exp, ranks, exp, scores):
    """``score_terms`` of the rows ``ranks`` against the result ``values`` (at ``exp``), added to
    their members' ``scores``: x = row * 2**-e_r, m = values * 2**-exp / n. (The sums in any order:
    scores are compared to a tolerance, never bit for bit.)"""
    n, size = ranks.shape[0], values.shape[0]
    scale = math.ldexp(1.0, -exp) / n
    m = np.empty(size, np.float64)
    ref = 0.0
    for i in range(size):
        m[i] = values[i] * scale
        ref += m[i] * m[i]
    for j in range(n):
        xs = math.ldexp(1.0, -row_exp[ranks[j]])
        dot = 0.0
        norm = 0.0
        for i in range(size):
            x = rows[ranks[j], i] * xs
            dot += x * m[i]
            norm += x * x
        scores[ranks[j], S_DOT] += dot
        scores[ranks[j], S_NORM] += norm
        scores[ranks[j], S_REF] += ref


@njit(cache=True, nogil=True)
def _combine(bu, values, rows, row_exp, scores, s, b, world, combine_kind, trim, rho):
    """AggregatorModel._combine of a robust job's bank (s, b): its members' rows combined into its
    sums (``kernels.combine_ranks``), each one's score terms added to ``scores`` (``_add_scores``);
    returns the exponent."""
    bitmap = bu[s, b, U_BITMAP]
    n = _popcount(bitmap)
    ranks = np.empty(n, np.int64)
    k = 0
    for r in range(world):
        if bitmap >> np.uint64(r) & np.uint64(1):
            ranks[k] = r
            k += 1
    t = (n - 1) // 2 if combine_kind != TRIMMED else min(trim, (n - 1) // 2)
    exp = combine_ranks(rows[s, b], row_exp[s, b], ranks, t, combine_kind == ZENO, rho, values[s, b])
    _add_scores(values[s, b], rows[s, b], row_exp[s, b], ranks, exp, scores)
    return exp


@njit(cache=True, nogil=True)
def run(stage, stage32, stage16, stage8, sizes, names, nows, start, n, job, world, max_chunks, served_flags,
        prec, member_ip, member_port, member_tag, table, bi, bu, steps, pending, shared, late_ranks, values, counters,
        drops, dirty, members, out, out32, out16, out_len, out_kind, out_reason, combine_kind, trim, rho, rows, row_exp,
        scores):
    """Decide packets ``start ..`` of the batch while they are the common case of ``job`` (its
    contributions of precision ``prec``: ``stage32``, ``stage16`` and ``stage8`` are the batch's
    records as int32, int16 and int8); return the index of the first that is not (``n`` when all
    were). A robust job (``combine_kind`` not SUM) keeps each contribution in its member's row of
    ``rows`` and combines them at the release (``_combine``). See the module docstring."""
    nslots, elements = values.shape[0], values.shape[2]
    # the members every round awaits (the kernel runs only jobs that await them all)
    everyone = np.uint64(0xFFFFFFFFFFFFFFFF) if world == 64 else (np.uint64(1) << np.uint64(world)) - np.uint64(1)
    size_ok = HDR + (4 if prec == INT32 else (2 if prec == INT16 else 1)) * elements
    # a narrow contribution may carry room for its result (docs/protocol.md, "Precision")
    size_room = HDR + (2 if prec == INT8 else 4) * elements
    i = start
    while i < n:
        p = stage[i]
        if (sizes[i] != size_ok and sizes[i] != size_room) or _be16(p, O_MAGIC) != MAGIC or p[O_VERSION] != VERSION \
                or p[O_TYPE] != CONTRIB or _be16(p, O_JOB) != job or p[O_CODE] != prec:
            break                                            # (the code byte: the job's precision)
        count, rank, chunk, step = _be16(p, O_COUNT), _be16(p, O_RANK), _be32(p, O_CHUNK), _be16(p, O_STEP)
        if count == 0 or count > elements or rank >= world or chunk >= max_chunks or step >= STEPS \
                or (combine_kind != SUM and step != 0):     # (bad_step: the model's)
            break
        nm = names[i]
        if member_port[rank] != _be16(nm, 2) or member_ip[rank] != _be32(nm, 4) or \
                _be64(p, O_CONTRIBUTORS) != member_tag[rank]:
            break
        round_ = _be32(p, O_ROUND)
        ordered = (p[O_FLAGS] & ORDERED) != 0
        exponent = _be16(p, O_EXPONENT)
        if exponent >= 0x8000:
            exponent -= 0x10000
        s = chunk % nslots
        now = nows[i]
        if (chunk >= nslots or ordered) and shared[s] == 0:
            shared[s] = 1                                    # Slot.shared (note_sender)
            dirty[s] = 1
        # Rule 0 would release a bank: the model's.  Meanwhile find K's bank and the newest key.
        slow = False
        found = -1
        newest = False
        nr = nc = 0
        for b in range(BANKS):
            state = bi[s, b, F_STATE]
            if state == EMPTY:
                continue
            r, c = bi[s, b, F_ROUND], bi[s, b, F_CHUNK]
            if pending[s] != 0 and pending[s] == (np.uint64(r) << np.uint64(32) | np.uint64(c)) + np.uint64(1):
                pending[s] = 0                               # a bank holds the pending key now
                dirty[s] = 1
            if round_ >= r + RESULT_WINDOW or (step == 0 and round_ == r and chunk > c) or \
                    (round_ > r and (c >= nslots or chunk >= nslots or ordered)):  # Slot.note_sender
                if not bu[s, b, U_HELD] >> np.uint64(rank) & np.uint64(1):
                    bu[s, b, U_HELD] |= np.uint64(1) << np.uint64(rank)
                    dirty[s] = 1
            if state == OPEN and bi[s, b, F_KIND] == QUORUM and bi[s, b, F_HOLDING] == 0 and \
                    now - bu[s, b, U_TFIRST] >= np.uint64(bi[s, b, F_TIMEOUT_US] * 1000):
                slow = True
            if found < 0 and r == round_ and c == chunk:
                found = b
            if bi[s, b, F_HOLDING] == 0 and (not newest or _key_less(nr, nc, r, c)):
                newest, nr, nc = True, r, c
        if slow:
            break
        fresh = False
        busy = False
        resend = False
        carry = -1         # rule 4: the bank a late contribution is carried into
        hold = False       # ... a holding bank opened for it (AggregatorModel._hold), of round r2
        r2 = e2 = 0        # under table row e2
        answer = -1        # the released bank that answers it
        if found >= 0:
            if bi[s, found, F_STATE] != OPEN:
                # Rule 2: a member's retransmission into its released round is answered with the
                # result (AggregatorModel._resend). Rule 4 with that round released: a quorum's
                # straggler, its contribution carried into the chunk's next round and answered with
                # its round's result (AggregatorModel._late). What these need beyond (a forwarded
                # round, a deadline release's first re-send, no bank to carry into, a late memory
                # of the member in the slot) is the model's. (In the model's path each cost
                # 0.3 ms: under quorum:3 a fourth of all contributions are late, and a DDP bucket
                # of 1377 chunks went from 0.2 s to 7 s a call as retransmissions piled up.)
                if bi[s, found, F_STATE] != RELEASED:
                    break
                if steps[s, found, rank] >> step & 1:
                    if bi[s, found, F_UNANNOUNCED] != 0:
                        break
                    resend = True
                else:
                    if combine_kind != SUM or late_ranks[s] >> np.uint64(rank) & np.uint64(1):
                        break
                    passed_full = False
                    for b2 in range(BANKS):           # the chunk's earliest later round still open
                        if bi[s, b2, F_STATE] == OPEN and bi[s, b2, F_CHUNK] == chunk and bi[s, b2, F_ROUND] > round_:
                            if bi[s, b2, F_KIND] == QUORUM and bi[s, b2, F_CARRIED] >= world:
                                passed_full = True   # full of carries (Bank.full)
                            elif carry < 0 or bi[s, b2, F_ROUND] < bi[s, carry, F_ROUND]:
                                carry = b2
                    if passed_full and carry < 0:    # past a full round, none with room: the model's
                        break
                    if carry < 0:                    # else a holding bank for the chunk's next round
                        r2 = round_
                        for b2 in range(BANKS):      # (after the chunk's holding banks too)
                            if bi[s, b2, F_STATE] != EMPTY and bi[s, b2, F_CHUNK] == chunk and bi[s, b2, F_ROUND] > r2:
                                r2 = bi[s, b2, F_ROUND]
                        r2 += 1
                        if newest and not _key_less(nr, nc, r2, chunk):
                            r2 = nr + (1 if chunk <= nc else 0)
                        if r2 > U32_MAX:
                            break
                        e2 = _governing(table, r2)
                        carry = _hold_bank(bi, bu, s, everyone, table[e2, T_KIND], shared[s])
                        if carry < 0:
                            break
                        hold = True
                    answer = found
                    if carry == found:
                        # the holding bank is K's own (the oldest released, reused): the answer is
                        # the chunk's newest result left; with none the model remembers the carry
                        answer = -1
                        for b2 in range(BANKS):
                            if b2 != found and bi[s, b2, F_STATE] == RELEASED and bi[s, b2, F_CHUNK] == chunk and \
                                    (answer < 0 or bi[s, b2, F_ROUND] > bi[s, answer, F_ROUND]):
                                answer = b2
                        if answer < 0:
                            break
            b = found
            if bi[s, b, F_HOLDING] and pending[s] != 0 and not steps[s, b, rank] >> step & 1 and \
                    (np.uint64(round_) << np.uint64(32) | np.uint64(chunk)) >= pending[s]:
                busy = True                                  # a round proper after the pending key
        elif not newest or _key_less(nr, nc, round_, chunk):  # rule 3: open a bank
            top = -1
            held = False
            for b2 in range(BANKS):
                if bi[s, b2, F_STATE] == EMPTY or bi[s, b2, F_CHUNK] != chunk:
                    continue
                if bi[s, b2, F_HOLDING]:
                    held = True
                elif bi[s, b2, F_ROUND] > top:
                    top = bi[s, b2, F_ROUND]
            e = _governing(table, round_)
            kind = table[e, T_KIND]
            skip = _be16(p, O_SKIP)
            key = np.uint64(round_) << np.uint64(32) | np.uint64(chunk)
            queued = pending[s] != 0 and key >= pending[s]    # a key refused before goes first
            if queued:
                busy = True
            elif top < 0:
                busy = False
            elif skip >= SKIP_MAX:
                busy = round_ < top + 1 + SKIP_MAX
            else:
                busy = round_ > top + 1 + skip
            if held and not busy:
                break                                         # a holding bank to adopt: the model's
            if not busy:
                n_open = 0
                for b2 in range(BANKS):
                    if bi[s, b2, F_STATE] != OPEN:
                        continue
                    if kind == ASYNC:
                        n_open += 1
                    elif bi[s, b2, F_HOLDING] == 0:
                        if kind != SSP or bi[s, b2, F_ROUND] + table[e, T_PARAM] < round_:
                            busy = True
                busy = busy or (kind == ASYNC and n_open >= ASYNC_MAX_OPEN)
            b = -1
            if not busy:         # an empty bank, else the oldest released one if a new round may take it
                for b2 in range(BANKS):
                    if bi[s, b2, F_STATE] == EMPTY:
                        b = b2
                        break
                if b < 0:
                    for b2 in range(BANKS):
                        if bi[s, b2, F_STATE] == RELEASED and (b < 0 or _key_less(
                                bi[s, b2, F_ROUND], bi[s, b2, F_CHUNK], bi[s, b, F_ROUND], bi[s, b, F_CHUNK])):
                            b = b2
                    if b >= 0 and not _reusable(bi, bu, s, b, everyone, kind, shared[s]):
                        b = -1                                 # kept (Slot.reusable)
                busy = b < 0
            if busy and not queued and (kind == SSP or kind == ASYNC):     # Slot.pending: it goes first
                pending[s] = key + np.uint64(1)
                dirty[s] = 1
            if not busy:
                if pending[s] == key + np.uint64(1):
                    pending[s] = 0
                bi[s, b, F_STATE], bi[s, b, F_ROUND], bi[s, b, F_CHUNK] = OPEN, round_, chunk
                bi[s, b, F_HOLDING], bi[s, b, F_NCONTRIB], bi[s, b, F_FLAGS] = 0, 0, 0
                bi[s, b, F_VERSION], bi[s, b, F_KIND] = table[e, T_VERSION], kind
                bi[s, b, F_PARAM], bi[s, b, F_TIMEOUT_US] = table[e, T_PARAM], table[e, T_TIMEOUT]
                bi[s, b, F_UNANNOUNCED], bi[s, b, F_COUNT], bi[s, b, F_CARRIED] = 0, count, 0
                bu[s, b, U_BITMAP], bu[s, b, U_LATE], bu[s, b, U_TFIRST], bu[s, b, U_HELD] = 0, 0, now, 0
                bi[s, b, F_EXPONENT] = ZERO_EXPONENT     # (Bank.open; a sum's first load sets it)
                steps[s, b, :] = 0
                fresh = True
        else:
            break                                             # rule 4: the model's

        # Decided here: the packet counts for its job.
        counters[C_RX_PACKETS] += np.uint64(1)
        counters[C_RX_BYTES] += np.uint64(sizes[i])
        if p[O_FLAGS] & RETRANSMIT:
            counters[C_RETRANSMITS] += np.uint64(1)
        if busy:
            drops[D_BUSY] += np.uint64(1)
            out_kind[i], out_reason[i] = DROPPED, D_BUSY
            i += 1
            continue
        if carry >= 0:
            dirty[s] = 1
            t = carry
            if hold:                                          # Bank.open(holding=True)
                bi[s, t, F_STATE], bi[s, t, F_ROUND], bi[s, t, F_CHUNK] = OPEN, r2, chunk
                bi[s, t, F_HOLDING], bi[s, t, F_NCONTRIB], bi[s, t, F_FLAGS] = 1, 0, 0
                bi[s, t, F_VERSION], bi[s, t, F_KIND] = table[e2, T_VERSION], table[e2, T_KIND]
                bi[s, t, F_PARAM], bi[s, t, F_TIMEOUT_US] = table[e2, T_PARAM], table[e2, T_TIMEOUT]
                bi[s, t, F_UNANNOUNCED], bi[s, t, F_COUNT], bi[s, t, F_CARRIED] = 0, count, 0
                bu[s, t, U_BITMAP], bu[s, t, U_LATE], bu[s, t, U_TFIRST], bu[s, t, U_HELD] = 0, 0, now, 0
                bi[s, t, F_EXPONENT] = ZERO_EXPONENT
                steps[s, t, :] = 0
            _add_values(bi, values, s, t, i, hold, exponent, prec, stage32, stage16, stage8)
            weight = _be16(p, O_NCONTRIB)
            bi[s, t, F_NCONTRIB] = (bi[s, t, F_NCONTRIB] + (weight if weight > 0 else 1)) & 0xFFFF
            counters[C_CONTRIBUTIONS] += np.uint64(1)
            counters[C_ELEMENTS] += np.uint64(count)
            members[rank, M_CONTRIBUTIONS] += np.uint64(1)          # JobState.count_member(late=True)
            members[rank, M_LATE] += np.uint64(1)
            if np.uint64(round_ + 1) > members[rank, M_LAST_ROUND]:
                members[rank, M_LAST_ROUND] = np.uint64(round_ + 1)
            members[rank, M_LAST_NS] = now
            bi[s, t, F_FLAGS] |= CARRIED
            bi[s, t, F_CARRIED] += 1
            counters[C_CARRIED] += np.uint64(1)
            if t != b:                                             # K's own bank: answered from now on
                bu[s, b, U_LATE] |= np.uint64(1) << np.uint64(rank)
                steps[s, b, rank] |= np.uint8(1 << step)
            b = answer
            if bi[s, b, F_UNANNOUNCED] == 0:
                resend = True                                      # answered as rule 2's re-send, below
            else:                                                  # _resend: a deadline release's first answer
                bi[s, b, F_UNANNOUNCED] = 0
                out_len[i] = _result(bi, bu, values, s, b, job, served_flags, out, out32, out16, i, counters, prec)
                out_kind[i] = TO_GROUP
                i += 1
                continue
        if resend:
            counters[C_REREADS] += np.uint64(1)
            out_len[i] = _result(bi, bu, values, s, b, job, served_flags, out, out32, out16, i, counters,
                                 prec, REREAD)
            out_kind[i] = TO_SENDER
            i += 1
            continue
        if not fresh and steps[s, b, rank] >> step & 1:       # rule 1: counted already
            drops[D_DUPLICATE] += np.uint64(1)
            out_kind[i], out_reason[i] = DROPPED, D_DUPLICATE
            i += 1
            continue
        dirty[s] = 1
        if combine_kind != SUM:     # a robust job's row (one call a type, as in _add_values)
            if prec == INT32:
                load(rows[s, b, rank], stage32[i, HDR32:HDR32 + elements])
            elif prec == INT16:
                load(rows[s, b, rank], stage16[i, HDR16:HDR16 + elements])
            else:
                load(rows[s, b, rank], stage8[i, HDR:HDR + elements])
            row_exp[s, b, rank] = exponent
        else:
            _add_values(bi, values, s, b, i, fresh, exponent, prec, stage32, stage16, stage8)
        weight = _be16(p, O_NCONTRIB)       # a rack's partial sum holds that many (a worker's: 0, one)
        bi[s, b, F_NCONTRIB] = (bi[s, b, F_NCONTRIB] + (weight if weight > 0 else 1)) & 0xFFFF
        counters[C_CONTRIBUTIONS] += np.uint64(1)
        counters[C_ELEMENTS] += np.uint64(count)
        members[rank, M_CONTRIBUTIONS] += np.uint64(1)              # JobState.count_member
        if chunk == 0 and step == 0:                               # the start of its call
            members[rank, M_LAG_NS] += now - bu[s, b, U_TFIRST]
        if np.uint64(round_ + 1) > members[rank, M_LAST_ROUND]:
            members[rank, M_LAST_ROUND] = np.uint64(round_ + 1)
        members[rank, M_LAST_NS] = now
        if bi[s, b, F_HOLDING]:
            bi[s, b, F_HOLDING], bi[s, b, F_COUNT] = 0, count
            bu[s, b, U_TFIRST] = now
        if step == 0:
            bu[s, b, U_BITMAP] |= np.uint64(1) << np.uint64(rank)
        steps[s, b, rank] |= np.uint8(1 << step)
        bitmap = bu[s, b, U_BITMAP]
        if bi[s, b, F_KIND] == QUORUM:
            complete = _popcount(bitmap) >= bi[s, b, F_PARAM]
        elif world == 64:
            complete = bitmap == np.uint64(0xFFFFFFFFFFFFFFFF)
        else:
            complete = bitmap == (np.uint64(1) << np.uint64(world)) - np.uint64(1)
        if complete:
            if combine_kind != SUM:
                bi[s, b, F_EXPONENT] = _combine(bu, values, rows, row_exp, scores, s, b, world, combine_kind, trim, rho)
            bi[s, b, F_STATE] = RELEASED
            counters[C_RELEASED] += np.uint64(1)
            out_len[i] = _result(bi, bu, values, s, b, job, served_flags, out, out32, out16, i, counters,
                                 prec)
            out_kind[i] = TO_GROUP
        elif bi[s, b, F_KIND] == ASYNC:
            counters[C_PARTIALS] += np.uint64(1)
            out_len[i] = _result(bi, bu, values, s, b, job, served_flags, out, out32, out16, i, counters,
                                 prec)
            out_kind[i] = TO_SENDER
        else:
            out_kind[i] = ABSORBED
        i += 1
    return i


def _ipv4(host: str) -> int | None:
    """The address as an int, if ``host`` is written exactly as received addresses are."""
    try:
        packed = socket.inet_aton(host)
    except OSError:
        return None
    return int.from_bytes(packed, "big") if socket.inet_ntoa(packed) == host else None


#: A summing job's stand-in for the rows, their exponents and the score terms (typed as a robust job's).
_NO_ROWS = (np.zeros((1, BANKS, 1, 1), np.int32), np.zeros((1, BANKS, 1), np.int64), np.zeros((1, 3), np.float64))


class FastJob:
    """One job's arrays for the kernel, tied to its ``JobState`` in ``model``."""

    @staticmethod
    def layout(slots: int, elements: int, rows: int = 0) -> dict[str, tuple[type, tuple[int, ...]]]:
        """name -> (dtype, shape) of a job's arrays: the slots' and the counters'; with ``rows`` (a
        robust job's world), its banks' rows and the members' score terms too."""
        arrays = {"bi": (np.int64, (slots, BANKS, NF)), "bu": (np.uint64, (slots, BANKS, NU)),
                  "steps": (np.uint8, (slots, BANKS, MAX_MEMBERS)), "pending": (np.uint64, (slots,)),
                  "shared": (np.uint8, (slots,)),
                  "values": (np.int64, (slots, BANKS, elements)),
                  "counters": (np.uint64, (len(Counter),)), "drops": (np.uint64, (len(DropReason),)),
                  "members": (np.uint64, (MAX_MEMBERS, 6))}
        if rows:
            arrays.update({"rows": (np.int32, (slots, BANKS, rows, elements)),
                           "row_exp": (np.int64, (slots, BANKS, rows)),
                           "scores": (np.float64, (MAX_MEMBERS, 3))})
        return arrays

    def __init__(self, model: AggregatorModel, job: int, files=None) -> None:
        """``files``: an ``aggd.dataplane.userspace.keep.SlotFiles`` to keep the arrays in (and
        take them from, when it ``restored`` them), or None for memory only.

        Nothing here touches the slot arrays' pages: zeros are empty banks (a new file is sparse,
        a new array calloc'd), so a job costs memory only in the slots its packets reach; the
        model's slot objects are made from the arrays when first used (``_make_slot``)."""
        self.model, self.job = model, job
        self.state: JobState = model.jobs[job]
        #: every packet to the model: some of the job's slots are the kernel's (a narrow job's
        #: frames the XDP program could not grow, handed back to it: UserspaceAggregator.hand_back)
        self.slow_only = False
        cfg = self.state.cfg
        #: a robust job's banks keep a row a member, here and in the model's objects (views alike)
        self.robust = cfg.combine.robust
        slots = cfg.slots
        arrays = {name: (files.array(name, dt, shape) if files is not None else np.zeros(shape, dt))
                  for name, (dt, shape) in self.layout(slots, values_per_packet(model.elements, cfg.precision),
                                                       self.rows_of(cfg)).items()}
        self.bi, self.bu, self.steps, self.values = arrays["bi"], arrays["bu"], arrays["steps"], arrays["values"]
        self.pending = arrays["pending"]         # Slot.pending: key + 1, 0 for none
        self.shared = arrays["shared"]           # Slot.shared: 1, else 0
        self.rows, self.row_exp = arrays.get("rows"), arrays.get("row_exp")
        restored = files is not None and files.restored
        # one array each, shared with the model: it counts (and sums) in place
        shared = [("counters", self.state.counters), ("drops", model._drops[job]), ("members", self.state.members)]
        if self.robust:
            shared.append(("scores", self.state.scores))
        for name, own in shared:
            if not restored:
                arrays[name][:] = own
        self.state.counters, self.state.members = arrays["counters"], arrays["members"]
        if self.robust:
            self.state.scores = arrays["scores"]
        c = cfg.combine
        #: the kernel's combine arguments (a summing job's rows are one empty stand-in)
        self.combine_args = (int(c.kind), int(c.trim), float(c.rho),
                             *((self.rows, self.row_exp, self.state.scores) if self.robust else _NO_ROWS))
        model._drops[job] = arrays["drops"]
        self.counters, self.drops, self.members = arrays["counters"], arrays["drops"], arrays["members"]
        self.dirty = np.zeros(slots, np.uint8)
        #: per slot, the members the model's late memories (Slot.late) know of: their late
        #: contributions are the model's (not kept in the files: a restart forgets them too)
        self.late_ranks = np.zeros(slots, np.uint64)
        made = dict(self.state.slots.made())
        self.state.slots.make = self._make_slot
        for s, slot in made.items():                 # (slots the model made before: none, normally)
            for b, bank in enumerate(slot.banks):
                if not restored:
                    self.values[s, b] = bank.values
                bank.values = self.values[s, b]
                if self.robust:
                    if not restored:
                        self.rows[s, b], self.row_exp[s, b] = bank.rows, bank.row_exp
                    bank.rows, bank.row_exp = self.rows[s, b], self.row_exp[s, b]
            if restored:
                self.dirty[s] = 1
            else:
                self.to_arrays(s)
        if restored:                                 # the kept arrays are the truth: objects follow
            # (read, not mapped: looking costs no resident pages)
            self.dirty[(files.read("bi")[:, :, F_STATE] != EMPTY).any(axis=1)] = 1
            self.sync()
        self.refresh()

    @staticmethod
    def rows_of(cfg) -> int:
        """Rows a bank of the job ``cfg`` keeps: its world if it is robust, else none."""
        return cfg.world if cfg.combine.robust else 0

    def _make_slot(self, s: int) -> Slot:
        """The model's slot ``s``, its banks' sums (and rows) views of the arrays, its fields from them."""
        slot = Slot([Bank(self.values[s, b]) for b in range(BANKS)])
        if self.robust:
            for b, bank in enumerate(slot.banks):
                bank.rows, bank.row_exp = self.rows[s, b], self.row_exp[s, b]
        self._fill(s, slot)
        return slot

    def close(self) -> None:
        """Let go of the arrays (a removed job): the model's slots stop making themselves from them,
        so once the job's objects are dropped its memory maps are unmapped."""
        self.state.slots.make = None                 # (it refers back to this object)
        self.state.slots.made().clear()              # the banks' views of the values
        self.bi = self.bu = self.steps = self.values = self.rows = self.row_exp = self.pending = self.shared = None
        self.late_ranks = None

    def refresh(self) -> None:
        """Take the job's members, group and strategy table again (after set_member/set_strategy)."""
        cfg = self.state.cfg
        self.member_ip = np.zeros(64, np.int64)
        self.member_port = np.full(64, -1, np.int64)   # -1: no address a packet can come from
        self.member_tag = np.zeros(64, np.uint64)
        for rank, tag in cfg.tags.items():
            self.member_tag[rank] = tag
        for rank, (host, port) in cfg.members.items():
            ip = _ipv4(host)
            if ip is not None:
                self.member_ip[rank], self.member_port[rank] = ip, port
        self.group = (cfg.group,) if cfg.group is not None else tuple(cfg.members[r] for r in sorted(cfg.members))
        try:   # the group's addresses as sendmmsg takes them; None: only sendto can (not IPv4 numbers)
            self.group_names = np.array([np.frombuffer(sockaddr_in(a), np.uint8) for a in self.group],
                                        np.uint8).reshape(-1, SOCKADDR_IN)
        except (OSError, ValueError, struct.error):
            self.group_names = None
        self.table = np.array([(e.from_round, e.version, e.kind, e.param, e.timeout_us) for e in self.state.table],
                              np.int64)

    def to_arrays(self, s: int) -> None:
        """Slot ``s`` from the model's objects to the arrays."""
        for b, bank in enumerate(self.state.slots[s].banks):
            self.bi[s, b] = (bank.state, bank.key[0], bank.key[1], bank.holding, bank.n_contrib, bank.exponent,
                             bank.flags, bank.version, bank.kind, bank.param, bank.timeout_us, bank.unannounced,
                             bank.count, bank.carried)
            self.bu[s, b] = (bank.bitmap, bank.late, bank.t_first % (1 << 64), bank.held)
            self.steps[s, b] = [x & 0xFF for x in bank.steps]  # bits >= STEPS mean nothing (counted anyway)
        p = self.state.slots[s].pending
        self.pending[s] = 0 if p is None else (p[0] << 32 | p[1]) + 1
        self.shared[s] = int(self.state.slots[s].shared)
        self.late_ranks[s] = sum(1 << r for r, mem in self.state.slots[s].late.items() if mem.round is not None)
        self.dirty[s] = 0

    def to_objects(self, s: int) -> None:
        """Slot ``s`` from the arrays to the model's objects, if the kernel changed it (a slot not
        made yet is made so)."""
        if not self.dirty[s]:
            return
        slots = self.state.slots
        if slots.is_made(s):
            self._fill(s, slots[s])
        else:
            slots[s]                                 # made from the arrays
        self.dirty[s] = 0

    def _fill(self, s: int, slot: Slot) -> None:
        p = int(self.pending[s])
        slot.pending = None if p == 0 else ((p - 1) >> 32, (p - 1) & 0xFFFFFFFF)
        slot.shared = bool(self.shared[s])
        for b, bank in enumerate(slot.banks):
            if self.bi[s, b, F_STATE] == EMPTY:      # never used (a bank is never emptied again)
                continue
            (state, round_, chunk, holding, bank.n_contrib, bank.exponent, bank.flags, bank.version, kind,
             bank.param, bank.timeout_us, unannounced, bank.count, bank.carried) = self.bi[s, b].tolist()
            bank.state, bank.key, bank.holding = BankState(state), (round_, chunk), bool(holding)
            bank.kind, bank.unannounced = StrategyKind(kind), bool(unannounced)
            bank.bitmap, bank.late, bank.t_first, bank.held = self.bu[s, b].tolist()
            bank.steps = self.steps[s, b].tolist()

    def sync(self) -> None:
        for s in np.flatnonzero(self.dirty):
            self.to_objects(int(s))


@dataclass
class Batch:
    """A batch's buffers: ``n`` records of ``rec`` bytes received (sizes, senders, times) and the
    answers the kernel builds (one record per packet)."""
    n: int
    rec: int

    def __post_init__(self) -> None:
        if self.rec % 8:
            raise ValueError("records must be a multiple of 8 bytes")
        self.stage = np.zeros((self.n, self.rec), np.uint8)
        self.stage32 = self.stage.view(np.int32)
        self.stage16 = self.stage.view(np.int16)
        self.stage8 = self.stage.view(np.int8)
        self.sizes = np.zeros(self.n, np.int64)
        self.names = np.zeros((self.n, SOCKADDR_IN), np.uint8)
        self.nows = np.zeros(self.n, np.uint64)
        self.out = np.zeros((self.n, self.rec), np.uint8)
        self.out32 = self.out.view(np.int32)
        self.out16 = self.out.view(np.int16)
        self.out_len = np.zeros(self.n, np.int64)
        self.out_kind = np.zeros(self.n, np.int64)
        self.out_reason = np.zeros(self.n, np.int64)
        self._out = memoryview(self.out).cast("B")

    def answer(self, i: int) -> memoryview:
        """The message the kernel built for packet ``i``."""
        return self._out[i * self.rec:i * self.rec + int(self.out_len[i])]


#: The model's handling of packet i of the batch (the slow path): its verdict, or None when
#: something else answered it.
SlowPath = Callable[[int], "Verdict | None"]


class FastPath:
    """The kernel's jobs and the batch driver. Not thread-safe: the caller serialises it with the
    model's registry changes."""

    def __init__(self) -> None:
        self.jobs: dict[int, FastJob] = {}

    def add_job(self, model: AggregatorModel, job: int, files=None) -> None:
        self.jobs[job] = FastJob(model, job, files)

    def remove_job(self, job: int) -> None:
        fj = self.jobs.pop(job, None)
        if fj is not None:
            fj.close()

    def refresh(self, job: int) -> None:
        fj = self.jobs.get(job)
        if fj is not None:
            fj.refresh()

    def sync(self, job: int | None = None) -> None:
        """Bring the model's objects up to date (every job, or one)."""
        for j, fj in self.jobs.items():
            if job is None or j == job:
                fj.sync()

    def process(self, batch: Batch, n: int, slow: SlowPath) -> dict[int, Verdict | None]:
        """Decide packets 0..n-1 of ``batch`` in order: the kernel's in ``batch.out_kind`` (SLOW for
        the others), the slow path's verdicts by packet index."""
        verdicts: dict[int, Verdict | None] = {}
        kind, stage, sizes = batch.out_kind, batch.stage, batch.sizes
        kind[:n] = SLOW
        i = 0
        while i < n:
            job = (int(stage[i, O_JOB]) << 8 | int(stage[i, O_JOB + 1])) if sizes[i] >= O_JOB + 2 else None
            fj = self.jobs.get(job)
            # An observer sees the model's releases; a job with members declared gone releases by
            # the model's rule 0 (Bank.settled), which the kernel does not have.
            # A rack job forwards complete rounds upwards (the model's rule), which the kernel does not.
            if fj is not None and fj.model.on_release is None and fj.state.awaited == (1 << fj.state.cfg.world) - 1 \
                    and fj.state.cfg.upstream is None and not fj.slow_only \
                    and fj.state.cfg.bound is None and fj.state.cfg.norm_bound is None:
                # (a bounded job's values are checked by the model)
                nxt = run(stage, batch.stage32, batch.stage16, batch.stage8, sizes, batch.names, batch.nows, i, n, job,
                          fj.state.cfg.world, fj.state.cfg.max_chunks, fj.model.served_flags,
                          int(fj.state.cfg.precision), fj.member_ip, fj.member_port, fj.member_tag,
                          fj.table, fj.bi, fj.bu, fj.steps, fj.pending, fj.shared, fj.late_ranks, fj.values,
                          fj.counters, fj.drops, fj.dirty, fj.members,
                          batch.out, batch.out32, batch.out16, batch.out_len, kind, batch.out_reason,
                          *fj.combine_args)
                if nxt > i:
                    i = nxt
                    continue
            s = self._slot_of(fj, stage[i], sizes[i])
            # (a slot the model has not made is made from the arrays if it reaches it; one it does
            # not reach -- a foreign packet's chunk, say -- costs nothing)
            if s is not None and fj.state.slots.is_made(s):
                fj.to_objects(s)
            try:
                verdicts[i] = slow(i)
            finally:
                if s is not None and fj.state.slots.is_made(s):
                    fj.to_arrays(s)
            i += 1
        return verdicts

    @staticmethod
    def _slot_of(fj: FastJob | None, p: np.ndarray, size: int) -> int | None:
        """The slot the model may touch for this packet of a fast job (its chunk's, if in range)."""
        if fj is None or size < O_CHUNK + 4:
            return None
        chunk = int.from_bytes(p[O_CHUNK:O_CHUNK + 4].tobytes(), "big")
        return chunk % fj.state.cfg.slots if chunk < fj.state.cfg.max_chunks else None

    def verdict(self, batch: Batch, i: int, src) -> Verdict:
        """The kernel's decision on packet ``i`` as the model's Verdict (for tests and diagnostics)."""
        k = int(batch.out_kind[i])
        job = int(batch.stage[i, O_JOB]) << 8 | int(batch.stage[i, O_JOB + 1])
        if k == ABSORBED:
            return Verdict("drop", job=job)
        if k == DROPPED:
            return Verdict("drop", DropReason(int(batch.out_reason[i])), job=job)
        out = bytes(batch.answer(i))
        if k == TO_GROUP:
            return Verdict("tx", None, out, "group", self.jobs[job].group, job)
        if k == TO_SENDER:
            return Verdict("tx", None, out, "sender", (src,), job)
        raise ValueError(f"packet {i} was not decided by the kernel")


def warm_up() -> None:
    """Compile (or load from the cache) the kernel for the arrays the server passes."""
    batch = Batch(1, HDR + 8)
    one = np.zeros(1, np.int64)
    run(batch.stage, batch.stage32, batch.stage16, batch.stage8, batch.sizes, batch.names, batch.nows, 0, 0, 0, 1, 1,
        0, 0, np.zeros(64, np.int64),
        np.zeros(64, np.int64), np.zeros(64, np.uint64), np.zeros((1, 5), np.int64), np.zeros((1, BANKS, NF), np.int64),
        np.zeros((1, BANKS, NU), np.uint64), np.zeros((1, BANKS, 64), np.uint8), np.zeros(1, np.uint64),
        np.zeros(1, np.uint8), np.zeros(1, np.uint64), np.zeros((1, BANKS, 2), np.int64),
        np.zeros(len(Counter), np.uint64), np.zeros(len(DropReason), np.uint64), np.zeros(1, np.uint8),
        np.zeros((64, 6), np.uint64), batch.out, batch.out32, batch.out16, one, batch.out_kind, batch.out_reason,
        0, 0, 0.05, *_NO_ROWS)
