"""Reference model of the aggregator: the per-packet behaviour of docs/protocol.md as pure logic.

No I/O, no clock. ``AggregatorModel.process(udp_payload, sender, now_ns)`` returns a ``Verdict``
(what the XDP program does with the packet: drop / transmit / pass to user space, and the exact bytes
it sends) and updates per-job counters the way the kernel's counter maps must. The XDP program is
compared against this model packet by packet (tests/bpf/test_model_equivalence.py), the P4 backend's
tests are driven by it, and the user-space server (``aggd.dataplane.userspace.server``) runs it with the numba kernels
as its arithmetic. The slot rules below follow the numbering of docs/protocol.md, "Strategies".

Points docs/protocol.md leaves open, fixed here (every data plane must follow them):

Header checks and counters
* Order: too_short, bad_magic, bad_version, JOIN (passed up uncounted, kernel mode only), bad_type,
  bad_count, unknown_job (NACK), bad_rank (NACK NOT_MEMBER), not_member (NACK NOT_MEMBER), bad_tag
  (the ``contributors`` field is not the rank's member tag: silent, so a forger cannot make the real
  member's client give up by a NACK sent to its address), bad_precision (``code`` is not the job's
  Precision), bad_chunk,
  then the hand-off to user space of a payload that is not exactly a packet of the job's
  precision (``values_per_packet``: ``elements``, twice that for int8) (``pass``, Counter.TO_USERSPACE), then, for a contribution of a job with a ``bound`` or a
  ``norm_bound``, out_of_bounds (a value or the L2 norm beyond it: the member's ``offences``
  counted), then, for a robust job's contribution with ``step > 0``, bad_step, then the slot rules.
  Malformed or foreign packets are refused by the kernel. (The P4 programs do not know a job's precision: they pass any ``code`` but
  0 up, where user space refuses a wrong one.)
  ``bad_count`` counts the values' bytes in the precision the packet's ``code`` names (int32 if it
  names none): a contribution's type for contributions and re-reads, a result's for results.
* Drops before the job lookup succeeds (too_short .. unknown_job) count under the ``NO_JOB`` bucket.
  RX_PACKETS, RX_BYTES (the UDP payload) and RETRANSMITS (Flag.RETRANSMIT) count every packet whose
  job is known, including those dropped later. CONTRIBUTIONS / ELEMENTS (``count``) count
  every contribution added, carried ones included; OVERFLOWS every result sent with Flag.OVERFLOW
  (re-sends and async running sums included); CARRIED counts carried contributions; RELEASED
  counts every bank that becomes released (complete or quorum deadline);
  TIMEOUTS the deadline releases; REREADS every result sent back to one sender as a re-send (flag
  REREAD: re-reads, retransmissions of counted contributions, answers to late contributions);
  PARTIALS the async running sums (unicast, no REREAD flag). A counter the protocol definition does
  not have yet is kept by name in the model only (``JobState.pending``, shown by ``stats()``).
* A NACK is a bare header: magic, version, type, job, rank, round, chunk, code and flags (only the
  ``served_flags`` of this aggregator); every other field 0 (``strategy`` and ``param`` included).
  Only unknown_job, bad_rank and not_member are NACKed; everything else is a silent drop.

Results
* A result carries the *bank's* key as ``round``/``chunk`` (the packet's own key except for the answer
  to a late contribution), the bank's ``count`` (its round's: see ``Bank.count``), rank 0xFFFF, the bank's ``version``, ``kind`` (as
  ``strategy``), ``param``, ``exponent``, ``bitmap`` (as ``contributors``, carried senders not in it),
  ``n_contrib``, and flags ``bank.flags`` (CARRIED) | OVERFLOW when a value of the sum does not fit
  int32 | REREAD for re-sends | served_flags.
  ``code`` is the job's Precision, ``step`` and ``skip`` are 0. All of a packet's values are sent
  (padding included), in the precision's result type (int32; int16 for int8 contributions); a sum
  that does not fit it goes out as its low bits with Flag.OVERFLOW. An int16 result's range is the
  symmetric [-32767, 32767], and one of more than INT8_MAX_CONTRIBUTIONS contributions (``n_contrib``)
  is flagged whatever its values: the kernel adds an 8-bit packet's values four to a u64 lane, in
  16-bit fields that do not carry into each other only within those bounds.
* The whole payload is added (a constant trip count in the kernel), not only ``count`` elements.
  A bank holds exact sums (int64; the kernel keeps them biased in u64 lanes), so the order of
  contributions never matters. Aligning to a smaller exponent shifts the sum right by at most 63 and
  an int32 contribution by at most 31 (both exact floor divisions). Overflow is decided per result
  sent: a sum outside int32 goes out as its low 32 bits with Flag.OVERFLOW; a later result of the
  same bank is flagged only if its own values do not fit (an async running sum can come back).

Strategy table
* ``set_strategy`` takes 1..STRATEGY_VERSIONS rows in any order. A round is governed by the row with
  the largest ``(from_round, version)`` among those with ``from_round <= round``; when there is none
  (a round older than every row kept), by the row with the smallest ``from_round`` (ties: largest
  version) -- what ``aggd.core.strategy.StrategyTable.governing`` does.

Slot rules (numbers as in docs/protocol.md)
* Keys ``(round, chunk)`` compare as unsigned tuples (the kernel's ``round << 32 | chunk``), no wrap.
  Time is u64 ns: rule 0 tests ``(now - t_first) mod 2**64 >= timeout_us * 1000``. A bank's
  ``t_first`` is the time it opened. Rule 0 runs for every packet that reaches the slot rules,
  re-reads included, before anything else; the expired banks send nothing themselves, but the
  first answer taken from such a bank afterwards (re-read, re-send, late answer) goes to the group
  as a plain result (no REREAD flag, not counted in REREADS): every member sees the release once.
* Counted test: every strategy deduplicates contributions by (member, step): each bank keeps a
  bitmask of steps 0..7 per member (``steps[X]``); step ``s`` is counted when ``s >= 8`` or bit
  ``s`` is set. Rule 1 drops a counted one as ``duplicate``, otherwise adds it (sets bit ``s``, and X in
  the bitmap when ``s`` is 0); rule 2 re-sends when it is counted, otherwise it is late. A carry
  marks the (member, step) counted in its origin B too, so its retransmission is answered and a
  later wbsp step of the same member to B is carried as well.
* Rule 3 order: the chunk order (when the slot holds non-holding banks of K's chunk, K.round must
  be at most their largest round + 1 + the packet's ``skip``, or at least that with ``skip`` = SKIP_MAX:
  ``follows``), then the chunk's holding bank if it has one (adopted: re-keyed to K, its strategy
  fields set from the entry governing K.round, no admission test), else admission of that entry,
  then the bank: the first empty one, else the released one with the smallest key if a new round
  may take it (``Slot.reusable``: a new round that quorum does not govern takes an ``ssp`` or
  ``async`` bank only once every awaited member is in its ``held``; when it is kept, none. Every
  contribution or re-read that reaches the slot rules first marks its sender in ``held`` of each
  non-empty bank whose round it is at least RESULT_WINDOW past, or, at step 0, whose round it
  shares with a larger chunk, or whose round it is past when that bank's chunk or K's is
  ``slots`` or beyond or the packet has Flag.ORDERED; ``open`` and ``adopt`` clear it); any refusal is ``busy``. Before
  all this, a key above the slot's ``pending`` is refused ``busy``; any other key rule 3 refuses
  becomes ``pending`` if ``ssp`` or ``async`` governs its round (it is not above a pending one,
  which would have refused it); a bank holding the pending key (opened, adopted or a carry's
  holding bank) clears it, checked before the rules; rule 1 refuses ``busy`` a member's own
  contribution to a holding bank whose key is above the pending one (it would become the
  newest). The bank records version,
  kind, param, timeout_us, t_first = now; bitmap, late, steps, flags, n_contrib start at 0.
  ssp:s admission is ``open.round + s >= K.round`` for every open bank (no unsigned underflow);
  async admits while fewer than 3 banks are open (nothing is ever overwritten unreleased).
* Rule 4: the late contribution is refused ``stale`` if it is in no bank and is a copy: it has
  Flag.RETRANSMIT, or it is step 0 of a round a strategy other than quorum governs (such a round
  released with every awaited member, so its first copy was counted), unless the slot's
  LateMemory of the member holds it: refused ``busy`` before (carried now, as below), or carried
  before with no result to answer with (answered now with the newest released result of its
  chunk, or dropped ``not_ready`` while there is none). The memory holds step-0
  contributions of one round per member and slot, by ``chunk // slots`` below 64; a refusal or
  an unanswered carry for a newer round replaces it; a carry clears the refusal bit. Otherwise its target is the open bank of the same chunk with the smallest round above
  K.round that is not *full* (quorum governs it and it holds ``world`` carries: ``Bank.carried``);
  else a holding bank ``(R + 1, chunk)`` is opened (its round a placeholder until the
  chunk's next round adopts it; a chunk may have several, adopted smallest first), R the largest round of that chunk among the slot's non-empty
  banks, holding ones included (K.round if none), moved past the slot's newest key when it is not above it,
  if that round fits 32 bits and another bank stays free for the rounds in progress; else the
  packet is dropped ``busy`` (answered uncarried, as in a shared slot, when a full bank was
  passed over: refused, a straggler's call could wait on a round that waits on it).
  A carry adds the values into the target (n_contrib + 1, flag CARRIED; bitmap and steps of the
  target unchanged; no release test: the bitmap did not change), then, if the origin bank B still
  holds K -- the new round may have taken it -- sets X in B.late and bit ``s`` in B.steps[X]. The answer is chosen *after* the
  carry: the released bank of that chunk with the
  largest round, sent to X as a re-send; with no such bank the packet is absorbed (XDP_DROP,
  nothing counted but the contribution).
* Re-read: K released -> re-send (whoever asks); K open, or newer than the newest key, or the slot
  empty -> ``not_ready``; otherwise ``stale``.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import numpy as np

from aggd_client.protocol import (HEADER_SIZE, INT8_MAX_CONTRIBUTIONS, LANES, MAGIC, MAX_JOBS, MAX_MEMBERS,
                                  PAYLOAD_DTYPE, RESULT_WINDOW, SKIP_MAX, STRATEGY_VERSIONS, VERSION, ZERO_EXPONENT, Counter,
                                  DropReason, Flag, Header, MsgType, NackCode, Precision, StrategyKind,
                                  payload_dtype, values_per_packet)
from aggd_client.protocol.definition import DEFAULT_ELEMENTS

from aggd.core.robust import SUM, Combine, check_strategy, combine_rows, score_terms
from aggd.core.strategy import SYNC, Strategy, StrategyTable, TableEntry, governing, to_entry  # noqa: F401 (re-exported)

Addr = tuple[str, int]
Key = tuple[int, int]   #: (round, chunk)

#: Drop-counter bucket for packets dropped before their job is known (row MAX_JOBS of a C array).
NO_JOB = MAX_JOBS
RESULT_RANK = 0xFFFF
INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
U32_MAX = (1 << 32) - 1
MAX_SHIFT = 31        #: an int32 contribution is shifted by at most this (its sign by then)
MAX_SUM_SHIFT = 63    #: a bank's int64 sum is shifted by at most this
#: Banks a slot holds (docs/protocol.md, "Slot state").
BANKS = 4
#: async opens a round only while fewer banks than this are open (one released bank stays).
ASYNC_MAX_OPEN = BANKS - 1
#: Steps a member can push into one round (0..7, wbsp); a larger step number counts as a duplicate.
STEPS = 8
#: Strategies whose members run rounds apart: a released bank of theirs is kept from new rounds
#: until every awaited member is known to hold its result (``Slot.reusable``), or a result lost on
#: its way would be gone for good while the others run ahead.
KEPT_KINDS = (StrategyKind.SSP, StrategyKind.ASYNC)
#: ... and in a slot that has served several chunk indices, or been sent Flag.ORDERED, quorum's
#: too, from every new round (``Slot.shared``).
SHARED_KEPT_KINDS = KEPT_KINDS + (StrategyKind.QUORUM,)

#: The strategies the model (and so the user-space path) runs, with what sets each apart.
RULES: dict[StrategyKind, str] = {
    StrategyKind.SYNC: "release when every member contributed; a new round only when none is open",
    StrategyKind.QUORUM: "release at k members or at the deadline; late contributions are carried",
    StrategyKind.SSP: "release when every member contributed; rounds open up to s ahead of the oldest",
    StrategyKind.ASYNC: "every contribution is answered with the running sum; up to 3 rounds open",
    StrategyKind.WBSP: "members push several steps into a round; release when every member did",
}
#: Counters the strategies add. Until the protocol definition has one, the model keeps it by name.
STRATEGY_COUNTERS = ("carried", "timeouts", "partials")


# --------------------------------------------------------------------------------------------
# Arithmetic: one interface, two implementations (numpy here, numba in aggd.dataplane.userspace.kernels).

def np_load(dst: np.ndarray, src: np.ndarray) -> None:
    """First contribution of a key: copy (into int64), zero-padding a short payload, ignoring
    extra elements."""
    n = min(len(src), len(dst))
    dst[:n] = src[:n]
    dst[n:] = 0


def np_accumulate(acc: np.ndarray, acc_exp: int, src: np.ndarray, src_exp: int) -> int:
    """Add int32 ``src`` into the exact int64 sums ``acc`` aligning to the smaller exponent; return
    the exponent. The finer operand is arithmetically shifted right by the exponent difference,
    clamped to 63 for the sum and 31 for the int32 contribution (both exact floor divisions)."""
    exp = min(acc_exp, src_exp)
    n = min(len(src), len(acc))
    acc >>= min(acc_exp - exp, MAX_SUM_SHIFT)
    acc[:n] += src[:n].astype(np.int64) >> min(src_exp - exp, MAX_SHIFT)
    return exp


def np_narrow(values: np.ndarray, dtype: np.dtype = PAYLOAD_DTYPE) -> tuple[np.ndarray, bool]:
    """The values a result carries in ``dtype`` (int32, or int16 for int8 contributions): the sums'
    low bits, and whether any did not fit."""
    info = np.iinfo(dtype)
    low = info.min if info.bits == 32 else -info.max      # int16: symmetric (module docstring)
    overflow = bool(len(values)) and bool(values.min() < low or values.max() > info.max)
    return values.astype(dtype), overflow


class Arithmetic(NamedTuple):
    load: Callable[[np.ndarray, np.ndarray], None]
    accumulate: Callable[[np.ndarray, int, np.ndarray, int], int]
    narrow: Callable[[np.ndarray, np.dtype], tuple[np.ndarray, bool]]
    #: a robust job's release: (rows, exponents, Combine) -> (int64 sums, exponent)
    combine: Callable[[np.ndarray, np.ndarray, Combine], tuple[np.ndarray, int]] = combine_rows


NUMPY_ARITHMETIC = Arithmetic(np_load, np_accumulate, np_narrow, combine_rows)


# --------------------------------------------------------------------------------------------
# Configuration.

class Bound(NamedTuple):
    """The largest magnitude a contribution's values may have, ``mant * 2**exp`` (``mant`` below
    2**25): a value ``q * 2**-e`` is within it when ``|q| <= mant * 2**(exp + e)``, which the kernel
    tests with one shift."""
    mant: int
    exp: int

    @classmethod
    def of(cls, max_abs: float) -> "Bound":
        """The smallest such bound at least ``max_abs`` (a positive finite number): 24 bits of it."""
        if not (isinstance(max_abs, (int, float)) and math.isfinite(max_abs) and max_abs > 0):
            raise ValueError(f"a bound must be a positive finite number, not {max_abs!r}")
        m, k = math.frexp(float(max_abs))           # max_abs = m * 2**k, 0.5 <= m < 1
        return cls(math.ceil(m * (1 << 24)), k - 24)

    @property
    def value(self) -> float:
        return math.ldexp(self.mant, self.exp)

    def limit(self, exponent: int) -> int | None:
        """The largest ``|q|`` a contribution of ``exponent`` may carry; None: any int32."""
        s = self.exp + int(exponent)
        if s >= BOUND_FREE_SHIFT:
            return None
        return self.mant << s if s >= 0 else (self.mant >> -s if s > -64 else 0)

    def beyond(self, values: np.ndarray, exponent: int) -> bool:
        limit = self.limit(exponent)
        if limit is None or not len(values):
            return False
        return int(np.abs(values.astype(np.int64)).max()) > limit

    # As a bound on the L2 norm of a contribution's values: sum(q**2) <= (mant * 2**(exp + e))**2.
    def norm_limit(self, exponent: int) -> int | None:
        """The largest ``sum(q**2)`` a contribution of ``exponent`` may carry (``mant**2`` shifted
        by ``2·(exp + e)``, floored); None: any (the limit would be 2**63 or more)."""
        s = 2 * (self.exp + int(exponent))
        m2 = self.mant * self.mant
        if s >= 63 or (s >= 0 and m2 >> (63 - s)):
            return None
        return m2 << s if s >= 0 else (m2 >> -s if s > -64 else 0)

    def beyond_norm(self, values: np.ndarray, exponent: int) -> bool:
        """Whether the values' sum of squares is beyond ``norm_limit`` (exact: a sum of up to
        2**13 squares of int32 is held in Python integers)."""
        limit = self.norm_limit(exponent)
        if limit is None or not len(values):
            return False
        squares = np.square(values.astype(np.int64))           # each below 2**62
        return int(squares.sum(dtype=object)) > limit


#: A bound's shift from this up lets any int32 through (mant << 40 exceeds 2**31).
BOUND_FREE_SHIFT = 40


@dataclass
class JobConfig:
    job: int
    world: int
    slots: int
    max_chunks: int
    members: dict[int, Addr]
    #: Results' multicast group and port; None = unicast fan-out to every member's address.
    group: Addr | None = None
    #: The job's packet size in int32 lanes (an int8 packet holds two values a lane,
    #: ``values_per_packet``); None = the aggregator's. The kernel has one size, so it must match.
    elements: int | None = None
    #: Installed as version 0 from round 0; ``set_strategy`` replaces the table later.
    strategy: Strategy = SYNC
    #: Each member's tag (given in its JOIN_ACK), which its contributions and re-reads carry in
    #: ``contributors``; a rank without one has tag 0.
    tags: dict[int, int] = field(default_factory=dict)
    #: A rack job: complete rounds go up to this aggregator as one contribution, and its results
    #: come back down to the members (docs/protocol.md, "Two levels"). None: results are final here.
    upstream: Upstream | None = None
    #: Contributions' width (docs/protocol.md, "Precision"): int8 and int16 are summed into wider
    #: results. Every contribution and re-read must say this precision in ``code``.
    precision: Precision = Precision.INT32
    #: Per-member bound on a contribution's values (docs/protocol.md, "Bounds"); None: unbounded.
    bound: Bound | None = None
    #: ... and on their L2 norm (the same ``Bound``, tested by ``beyond_norm``); None: unbounded.
    norm_bound: Bound | None = None
    #: How a round's contributions are combined (docs/protocol.md, "Robust jobs"): summed, or
    #: kept one row per member and released as their median or trimmed mean (times the rows).
    combine: Combine = SUM

    def __post_init__(self) -> None:
        if not 0 <= self.job < MAX_JOBS:
            raise ValueError(f"job {self.job} outside 0..{MAX_JOBS - 1}")
        if not 1 <= self.world <= MAX_MEMBERS:
            raise ValueError(f"world {self.world} outside 1..{MAX_MEMBERS}")
        if self.slots < 1 or self.max_chunks < 1:
            raise ValueError("slots and max_chunks must be positive")
        # Ranks may be registered later (set_member); an unregistered rank is "not a member".
        bad = [r for r in self.members if not 0 <= r < self.world]
        if bad:
            raise ValueError(f"member ranks {bad} outside 0..{self.world - 1}")
        self.members = {int(r): _addr(a) for r, a in self.members.items()}
        self.tags = {int(r): check_tag(t) for r, t in self.tags.items() if t}
        if self.group is not None:
            self.group = _addr(self.group)
        if self.upstream is not None:
            self.upstream = replace(self.upstream, addr=_addr(self.upstream.addr))
        self.precision = Precision(self.precision)
        if self.upstream is not None and self.precision != Precision.INT32:
            raise ValueError("a rack job forwards int32 sums: its precision must be int32")
        if self.upstream is not None and self.combine.robust:
            raise ValueError(f"a rack job forwards sums: it cannot combine by {self.combine}")

    @property
    def result_dtype(self) -> np.dtype:
        return payload_dtype(self.precision, result=True)


def _addr(a: Addr) -> Addr:
    return (str(a[0]), int(a[1]))


@dataclass(frozen=True)
class Upstream:
    """Where a rack job's sums go (docs/protocol.md, "Two levels"): the upper aggregator's address
    and, once the rack has joined the upper job there, that job's id and the rack's rank and member
    tag in it. Until then (``job`` None) a complete round waits, forwarded but unsent: the members'
    retransmissions send it once the link is up."""
    addr: Addr
    job: int | None = None
    rank: int = 0
    tag: int = 0

    @property
    def linked(self) -> bool:
        return self.job is not None


def check_upstream_table(job: int, entries: list[TableEntry]) -> None:
    """A rack job is ``sync`` at every level: a partial sum goes up once, when every member is in."""
    if any(StrategyKind(e.kind) != StrategyKind.SYNC for e in entries):
        raise ValueError(f"job {job} forwards its sums to an upper aggregator: only sync serves it")


def check_tag(tag: int) -> int:
    """A member tag: a u64 (0: none)."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 1 << 64:
        raise ValueError(f"a member tag is a 64-bit unsigned integer, not {tag!r}")
    return tag


def check_table(entries: list[TableEntry]) -> list[TableEntry]:
    """The rows a data plane can store: 1..STRATEGY_VERSIONS of them, every field in its C type."""
    entries = list(entries)
    if not 1 <= len(entries) <= STRATEGY_VERSIONS:
        raise ValueError(f"a strategy table has 1..{STRATEGY_VERSIONS} entries, not {len(entries)}")
    for e in entries:
        if e.kind not in StrategyKind.__members__.values():
            raise ValueError(f"unknown strategy kind {e.kind} in {e}")
        if not (0 <= e.version <= 0xFFFF and 0 <= e.from_round <= U32_MAX and 0 <= e.param <= 0xFF
                and 0 <= e.timeout_us <= U32_MAX):
            raise ValueError(f"strategy entry {e} does not fit the data planes' fields")
    return entries


# --------------------------------------------------------------------------------------------
# Slot state (docs/protocol.md, "Slot state").

class BankState(enum.IntEnum):
    EMPTY = 0
    OPEN = 1
    RELEASED = 2
    #: A rack job's round complete here and sent up as one contribution: its result is the upper
    #: aggregator's (docs/protocol.md, "Two levels"). Open for admission, not a bank to reuse.
    FORWARDED = 3


@dataclass
class Bank:
    values: np.ndarray                 #: int64[elements] exact sums, a view into the job's slot array
    state: BankState = BankState.EMPTY
    key: Key = (0, 0)                  #: (round, chunk); meaningless while EMPTY
    bitmap: int = 0                    #: members whose own contribution was added
    late: int = 0                      #: members whose late contribution to this round was carried
    n_contrib: int = 0                 #: everything added (carried and wbsp steps included), u16
    exponent: int = ZERO_EXPONENT
    flags: int = 0                     #: Flag bits every result of the bank carries (CARRIED)
    #: Late contributions carried into it (rule 4): a quorum round takes at most ``world``, so that
    #: it holds at most the ``2 * world`` terms its members quantise for
    carried: int = 0
    version: int = 0                   #: the governing table row, recorded when the bank opened
    kind: StrategyKind = StrategyKind.SYNC
    param: int = 0
    timeout_us: int = 0
    t_first: int = 0                   #: ns, when the bank opened
    skip: int = 0                      #: the opening packet's ``skip`` (a rack forwards it upwards)
    #: the round's ``count``: its opening packet's, or in a carry's holding bank its first own
    #: contribution's. Its results carry it (not the count of whatever packet triggers one: a
    #: late one may be another tensor's)
    count: int = 0
    unannounced: bool = False          #: released by its deadline, not yet sent to the group
    #: Opened by a carry and no member's own contribution yet: a holding area for late gradients
    #: that takes no part in the slot's key order or admission and whose deadline has not started.
    holding: bool = False
    steps: list[int] = field(default_factory=lambda: [0] * MAX_MEMBERS)  #: per member: steps taken, a bitmask
    #: Members known to hold this round's result since the bank took its key: each sent the slot,
    #: since then, a round at least RESULT_WINDOW later (a member sends round R + RESULT_WINDOW only
    #: once it has every result of round R), or step 0 of the same round and a later chunk (chunk
    #: ``c + slots`` is sent only once chunk ``c``'s result is in), or a later round when this chunk
    #: or the one sent is ``slots`` or beyond (where slots serve several chunk indices a member
    #: sends its next key of a slot only once its previous one there is answered: "What clients
    #: do"). ``Slot.note_sender`` marks them.
    held: int = 0
    #: A robust job's rows: int32[world, elements], each member's own contribution (views, as
    #: ``values``), and their exponents int64[world]; None in a summing job.
    rows: np.ndarray | None = None
    row_exp: np.ndarray | None = None

    def open(self, key: Key, entry: TableEntry, now: int, holding: bool = False, skip: int = 0,
             count: int = 0) -> None:
        self.state, self.key, self.t_first, self.holding = BankState.OPEN, key, now, holding
        self.skip, self.count = skip, count
        self.version, self.kind = entry.version, StrategyKind(entry.kind)
        self.param, self.timeout_us = entry.param, entry.timeout_us
        self.bitmap = self.late = self.n_contrib = self.flags = self.held = self.carried = 0
        self.unannounced = False
        self.exponent = ZERO_EXPONENT
        self.steps = [0] * MAX_MEMBERS

    def adopt(self, key: Key, entry: TableEntry, skip: int = 0) -> None:
        """A holding bank becomes the chunk's next round, ``key``, governed by ``entry`` (its
        carried sums, flags and counts stay; the rest, its ``count`` too, starts when the first own
        contribution lands: ``_contribute``)."""
        self.key, self.skip, self.held = key, skip, 0
        self.version, self.kind = entry.version, StrategyKind(entry.kind)
        self.param, self.timeout_us = entry.param, entry.timeout_us

    def full(self, world: int) -> bool:
        """Rule 4: a quorum round that holds ``world`` carried contributions takes no more."""
        return self.kind == StrategyKind.QUORUM and self.carried >= world

    def counted(self, rank: int, step: int) -> bool:
        """Has this contribution, (member, step), already been added to this round? Every
        strategy deduplicates so; only wbsp clients send steps > 0."""
        return step >= STEPS or bool(self.steps[rank] >> step & 1)

    def complete(self, awaited: int) -> bool:
        """The release test of rule 1: a quorum of members, or every member a round waits for
        (``awaited``: the job's members less those declared gone)."""
        if self.kind == StrategyKind.QUORUM:
            return self.bitmap.bit_count() >= self.param
        return self.bitmap & awaited == awaited

    def settled(self, awaited: int) -> bool:
        """Rule 0: an open round that waits for members no longer awaited (declared gone after it
        opened) and has every other one."""
        return (self.state == BankState.OPEN and self.kind != StrategyKind.QUORUM and not self.holding
                and self.bitmap & awaited == awaited)

    def expired(self, now: int) -> bool:
        """Rule 0: an open quorum bank past its deadline."""
        return (self.state == BankState.OPEN and self.kind == StrategyKind.QUORUM and not self.holding
                and (now - self.t_first) % (1 << 64) >= self.timeout_us * 1000)


#: Columns of ``JobState.members`` (the XDP program's ``struct member_stats``).
M_CONTRIBUTIONS, M_LAG_NS, M_LATE, M_LAST_ROUND, M_LAST_NS, M_OFFENCES = range(6)
#: Columns of ``JobState.scores`` (a robust job's, summed over its releases): a member's row
#: against the statistic, ``<x, m>`` and ``<x, x>``, and the statistic's ``<m, m>``.
S_DOT, S_NORM, S_REF = range(3)


def member_rows(members: np.ndarray, world: int, scores: np.ndarray | None = None) -> list[dict]:
    """``DataPlane.member_stats`` rows from a ``JobState.members`` array (and a robust job's
    ``JobState.scores``: each row's ``score_terms``)."""
    rows = [{"rank": r, "contributions": int(m[M_CONTRIBUTIONS]), "lag_ns_sum": int(m[M_LAG_NS]),
             "late": int(m[M_LATE]), "last_round": int(m[M_LAST_ROUND]) - 1 if m[M_LAST_ROUND] else None,
             "offences": int(m[M_OFFENCES]),
             "last_ns": int(m[M_LAST_NS])} for r, m in enumerate(members[:world])]
    if scores is not None:
        for row in rows:
            row["score_terms"] = tuple(float(x) for x in scores[row["rank"]])
    return rows


def check_awaited(awaited: int, world: int) -> int:
    """``awaited`` if it is a bitmap of some of ``world``'s ranks, at least one; ValueError if not."""
    if not 0 < awaited < 1 << world:
        raise ValueError(f"awaited members {awaited:#x} must be a non-empty bitmap of ranks 0..{world - 1}")
    return awaited


@dataclass
class LateMemory:
    """A member's late step-0 contributions to one round in one slot, by the chunk's index in the
    slot (``chunk // slots``, below 64): those refused ``busy`` (not counted: a retransmission is
    carried) and those carried with no result of their chunk to answer with (counted: a
    retransmission is answered once there is one). Lets a retransmission whose round's bank is
    gone be told apart from a copy of one already counted, which is stale."""
    round: int | None = None
    refused: int = 0
    carried: int = 0

    def at(self, round_: int) -> "LateMemory":
        if self.round != round_:   # a newer round's late contributions replace the older ones
            self.round, self.refused, self.carried = round_, 0, 0
        return self


class LateMemories(dict):
    """A slot's LateMemory per member (rank), made when a member first has one: most slots never
    see a late contribution, and a job has many slots."""

    def __missing__(self, rank: int) -> LateMemory:
        mem = self[rank] = LateMemory()
        return mem


@dataclass
class Slot:
    banks: list[Bank]
    late: LateMemories = field(default_factory=LateMemories)
    #: The smallest key rule 3 refused (``busy``: out of its chunk's order, not admitted, or no bank
    #: to take) whose round ``ssp`` or ``async`` governs, until a bank holds it: no later key opens
    #: before it. Else a later key, sent after it by a member running rounds ahead, could open first,
    #: and this one, older than the newest, would be late: carried, never released. Its senders send
    #: it again (their members make every round; under sync and wbsp a member starts a round only
    #: once the previous one is complete, and a quorum's straggler may skip one).
    pending: Key | None = None
    #: Whether a key of chunk ``slots`` or beyond has come to the slot: a round then had more
    #: chunks than slots, so the slot served several of its chunk indices, whose results take one
    #: another's banks within the round. Then a released quorum bank is kept as an ssp one is,
    #: from every new round, quorum's too (``reusable``): else the result a member lost, or a
    #: straggler's answer, was gone before it asked (and at a job's end for good). For good once
    #: set: with tensors of several sizes a small tensor's round is followed by a large one's,
    #: whose first keys take the slot's banks before its key of chunk ``slots`` or beyond comes.
    #: A packet with Flag.ORDERED sets it too: a member whose calls have had more than one size
    #: says so under ``quorum``, since there the chunk's newest result may be another tensor's and
    #: only its own round's answers it.
    shared: bool = False

    def bank_of(self, key: Key) -> Bank | None:
        return next((b for b in self.banks if b.state != BankState.EMPTY and b.key == key), None)

    def newest(self) -> Key | None:
        """The largest key of the non-empty banks, holding ones aside; None while there is none."""
        return max((b.key for b in self.banks if b.state != BankState.EMPTY and not b.holding), default=None)

    def open_banks(self, holding: bool = False) -> list[Bank]:
        """Banks still without a result (open, or forwarded to the upper aggregator); with
        ``holding``, the holding ones too."""
        return [b for b in self.banks if b.state in (BankState.OPEN, BankState.FORWARDED)
                and (holding or not b.holding)]

    def n_free(self, awaited: int, kind: StrategyKind) -> int:
        """Banks a new round that ``kind`` governs may take in turn: the empty ones, and the
        released ones unless the oldest is kept (``free_bank``)."""
        empty = sum(b.state == BankState.EMPTY for b in self.banks)
        oldest = self.oldest_released()
        if oldest is None or not self.reusable(oldest, awaited, kind):
            return empty
        return empty + sum(self.reusable(b, awaited, kind) for b in self.banks)

    def reusable(self, bank: Bank, awaited: int, kind: StrategyKind) -> bool:
        """May a new round that ``kind`` governs take this released bank? One of ``ssp`` or
        ``async`` only once every awaited member is known to hold its result (``Bank.held``),
        unless ``kind`` is quorum: a quorum goes on without its stragglers, whose late
        contributions are answered with the chunk's newest result. In a slot that has served
        several chunk indices that newest result may be gone as well, and where a member's
        tensors differ it may be another tensor's (both: ``shared``): there an ``ssp``, ``async``
        or ``quorum`` bank is kept from every new round until it is held."""
        if bank.state != BankState.RELEASED:
            return False
        if self.shared and bank.kind in SHARED_KEPT_KINDS:
            return bank.held & awaited == awaited
        return bank.kind not in KEPT_KINDS or kind == StrategyKind.QUORUM or bank.held & awaited == awaited

    def note_sender(self, rank: int, key: Key, step: int, slots: int, ordered: bool = False) -> None:
        """A member sent ``key``: mark it in ``held`` of every bank whose result it must hold by
        then (``Bank.held``), and note a key of a round with more chunks than slots, or an
        ``ordered`` one (``shared``).
        ``ordered``: the packet's Flag.ORDERED, the sender's word that it sends a slot's keys in
        order of answers, so any later round of it proves it holds the earlier ones."""
        wide = ordered or key[1] >= slots
        if wide:
            self.shared = True
        for b in self.banks:
            if b.state != BankState.EMPTY and (key[0] >= b.key[0] + RESULT_WINDOW
                                               or (step == 0 and key[0] == b.key[0] and key[1] > b.key[1])
                                               or (key[0] > b.key[0] and (wide or b.key[1] >= slots))):
                b.held |= 1 << rank

    def of_chunk(self, chunk: int, state: BankState | None = None) -> list[Bank]:
        return [b for b in self.banks if b.state != BankState.EMPTY and b.key[1] == chunk
                and (state is None or b.state == state)]

    def oldest_released(self) -> Bank | None:
        """The released bank with the smallest key: the only one a new round may take."""
        return min((b for b in self.banks if b.state == BankState.RELEASED), key=lambda b: b.key, default=None)

    def newest_released(self, chunk: int) -> Bank | None:
        """The released bank of ``chunk`` with the largest key: what answers a late contribution."""
        return max(self.of_chunk(chunk, BankState.RELEASED), key=lambda b: b.key, default=None)

    def holding_of(self, chunk: int) -> list[Bank]:
        return [b for b in self.banks if b.state == BankState.OPEN and b.holding and b.key[1] == chunk]

    def free_bank(self, awaited: int, kind: StrategyKind) -> Bank | None:
        """Rule 3's choice: an empty bank, else the released bank with the smallest key if it is
        reusable (none if it is kept). Released banks go strictly oldest first, so a chunk's
        older round never outlives its newer one in the slot, which rule 3's order test needs."""
        empty = [b for b in self.banks if b.state == BankState.EMPTY]
        if empty:
            return empty[0]
        oldest = self.oldest_released()
        return oldest if oldest is not None and self.reusable(oldest, awaited, kind) else None


def follows(round_: int, skip: int, previous: int) -> bool:
    """May ``round_``, whose packet says ``skip``, open after ``previous``, the chunk's newest round
    in the slot? ``skip`` counts the rounds in between that left the chunk out (SKIP_MAX: that
    many or more), so the sender's predecessor is ``round_ - 1 - skip``: it must have opened, that
    is be ``previous`` or older (a newer one than the sender knew of: a quorum straggler that
    missed a result, or whose quorum skipped a round it sent, counts from an older round)."""
    if skip >= SKIP_MAX:
        return round_ >= previous + 1 + SKIP_MAX
    return round_ <= previous + 1 + skip


def admits(entry: TableEntry, slot: Slot, round_: int) -> bool:
    """Rule 3's admission: may a round governed by ``entry`` open now?"""
    kind = StrategyKind(entry.kind)
    if kind == StrategyKind.ASYNC:  # holding banks count: one released bank stays for re-reads
        return len(slot.open_banks(holding=True)) < ASYNC_MAX_OPEN
    if kind == StrategyKind.SSP:
        return all(b.key[0] + entry.param >= round_ for b in slot.open_banks())
    return not slot.open_banks()


def new_slot(elements: int, rows: int = 0) -> Slot:
    """An empty slot of ``elements`` values a bank; with ``rows`` (a robust job's world), as many
    rows a bank."""
    values = np.zeros((BANKS, elements), np.int64)
    slot = Slot([Bank(values[b]) for b in range(BANKS)])
    if rows:
        kept, exps = np.zeros((BANKS, rows, elements), np.int32), np.zeros((BANKS, rows), np.int64)
        for b, bank in enumerate(slot.banks):
            bank.rows, bank.row_exp = kept[b], exps[b]
    return slot


class Slots:
    """A job's slots, each made when first used (``slots[s]``): an idle job costs no slot objects,
    however many slots it has. ``make(s)`` makes slot ``s`` (an empty one by default; the user-space
    fast path makes it from its arrays). ``len`` is the job's slot count; iterating yields only the
    slots made so far -- the others are empty, so whatever looks for non-empty banks sees the same."""

    def __init__(self, n: int, make: Callable[[int], Slot]) -> None:
        self.n, self.make = n, make
        self._made: dict[int, Slot] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: int) -> Slot:
        slot = self._made.get(s)
        if slot is None:
            if not 0 <= s < self.n:
                raise IndexError(f"slot {s} outside 0..{self.n - 1}")
            slot = self._made[s] = self.make(s)
        return slot

    def __iter__(self):
        return iter(list(self._made.values()))

    def made(self) -> dict[int, Slot]:
        """The slots made so far, by index."""
        return self._made

    def is_made(self, s: int) -> bool:
        return s in self._made


@dataclass
class JobState:
    cfg: JobConfig
    slots: Slots
    table: list[TableEntry]
    counters: np.ndarray = field(default_factory=lambda: np.zeros(len(Counter), np.uint64))
    #: The members a round waits for (set_awaited): every member unless some were declared gone.
    awaited: int = 0
    #: Per member (rank): contributions, lag_ns_sum, late, last round + 1 (0: none), last_ns,
    #: offences (contributions beyond the job's bound).
    members: np.ndarray = field(default_factory=lambda: np.zeros((MAX_MEMBERS, 6), np.uint64))
    #: A robust job's score terms per member (S_DOT, S_NORM, S_REF), summed over its releases.
    scores: np.ndarray = field(default_factory=lambda: np.zeros((MAX_MEMBERS, 3), np.float64))
    #: Counters the protocol definition does not have yet (STRATEGY_COUNTERS), by name.
    pending: dict[str, int] = field(default_factory=lambda: {n: 0 for n in STRATEGY_COUNTERS
                                                             if n.upper() not in Counter.__members__})

    def count_member(self, rank: int, round_: int, now: int, lag_ns: int, late: bool) -> None:
        """A contribution of ``rank`` added (its own, or a late one carried): the per-member
        counters the XDP program keeps in ``member_stats`` (the straggler detector's and the
        departure rules' input). ``lag_ns``: its arrival after its round's first, for the start of
        the member's call (its step-0 contribution to chunk 0), 0 for the others: the later chunks
        of a late member's call follow the others' answers, which wait for it, and come in step."""
        m = self.members[rank]
        m[M_CONTRIBUTIONS] += 1
        m[M_LAG_NS] += np.uint64(lag_ns % (1 << 64))
        m[M_LATE] += int(late)
        m[M_LAST_ROUND] = max(int(m[M_LAST_ROUND]), round_ + 1)
        m[M_LAST_NS] = now

    def count(self, name: str, n: int = 1) -> None:
        member = Counter.__members__.get(name.upper())
        if member is None:
            self.pending[name] += n
        else:
            self.counters[member] += n

    def counter(self, name: str) -> int:
        member = Counter.__members__.get(name.upper())
        return self.pending[name] if member is None else int(self.counters[member])


# --------------------------------------------------------------------------------------------
# Verdicts.

@dataclass(frozen=True)
class Verdict:
    """What the data plane does with one packet.

    ``action``: "drop", "tx" (``out`` goes to ``dest``) or "pass" (to user space). A NACK is a
    "tx" to the sender that also carries a drop ``reason``: the packet is counted as that drop.
    ``addrs`` resolves ``dest`` to UDP addresses (the group, every member in fan-out mode, or the
    sender); ``job`` is the counter bucket (a job id or NO_JOB). A contribution absorbed into a
    slot without an answer is ``Verdict("drop", None)``: XDP_DROP with no drop counted.
    """
    action: str
    reason: DropReason | None = None
    out: bytes | None = None
    dest: str | None = None
    addrs: tuple[Addr, ...] = ()
    job: int = NO_JOB

    @property
    def header(self) -> Header | None:
        return None if self.out is None else Header.unpack(self.out)


#: Called with (job, bank, cause) whenever a bank becomes released; cause is "complete" or
#: "timeout". For tests and diagnostics: the bank is live, copy what you keep.
ReleaseObserver = Callable[[int, Bank, str], None]
#: (job, the contribution's header, its values): a late quorum contribution answered, not added.
UncarriedObserver = Callable[[int, Header, np.ndarray], None]


# --------------------------------------------------------------------------------------------
# The model.

class AggregatorModel:
    """Per-packet aggregator logic shared by the reference model and the user-space server.

    ``userspace=True`` is the user-space path: payloads of any length that holds ``count`` are
    served (zero-padded), never passed on, and every message sent carries Flag.USERSPACE.
    ``frames_grow`` (the kernel path): whether a frame can grow to a narrow job's wider result (the
    XDP program in frames of one page; a multi-buffer frame cannot, ``XdpDataPlane.frags``).
    """

    def __init__(self, elements: int = DEFAULT_ELEMENTS, *, userspace: bool = False,
                 arithmetic: Arithmetic = NUMPY_ARITHMETIC, frames_grow: bool = True) -> None:
        self.elements = elements
        self.frames_grow = frames_grow
        self.userspace = userspace
        self.served_flags = int(Flag.USERSPACE) if userspace else 0
        self.arith = arithmetic
        self.jobs: dict[int, JobState] = {}
        self._drops: dict[int, np.ndarray] = {NO_JOB: _zero_drops()}
        self.on_release: ReleaseObserver | None = None
        self.on_uncarried: UncarriedObserver | None = None
        #: (upper job, upper address) -> the rack job whose results come from there
        self._downstream: dict[tuple[int, Addr], int] = {}

    # -- registry ------------------------------------------------------------------------------
    def add_job(self, cfg: JobConfig) -> None:
        if cfg.job in self.jobs:
            raise ValueError(f"job {cfg.job} already registered")
        if cfg.elements is not None and cfg.elements != self.elements:
            raise ValueError(f"job {cfg.job} wants {cfg.elements} elements a packet, "
                             f"the aggregator has {self.elements}")
        cfg = replace(cfg, members=dict(cfg.members), tags=dict(cfg.tags))  # ours to mutate (set_member)
        table = check_table([to_entry(cfg.strategy.validate(cfg.world), 0, 0)])
        if cfg.upstream is not None:
            check_upstream_table(cfg.job, table)
        check_strategy(cfg.combine, cfg.strategy.kind)
        elements, rows = values_per_packet(self.elements, cfg.precision), cfg.world if cfg.combine.robust else 0
        slots = Slots(cfg.slots, lambda s: new_slot(elements, rows))   # made as packets reach them
        self.jobs[cfg.job] = JobState(cfg, slots, table, awaited=(1 << cfg.world) - 1)
        self._drops[cfg.job] = _zero_drops()
        self._route_upstream(cfg.job)

    def remove_job(self, job: int) -> None:
        self.jobs.pop(job, None)
        self._drops.pop(job, None)
        self._route_upstream(job)

    def set_upstream(self, job: int, upstream: Upstream) -> None:
        """The rack job's link to its upper aggregator (``Upstream.job`` set once it has joined)."""
        cfg = self.jobs[job].cfg
        if cfg.upstream is None:
            raise ValueError(f"job {job} was not made a rack job (JobConfig.upstream)")
        cfg.upstream = replace(upstream, addr=_addr(upstream.addr))
        self._route_upstream(job)

    def relays(self, upper_job: int, src: Addr) -> bool:
        """Is a result of job ``upper_job`` from ``src`` one of our rack jobs' upper results?"""
        return (upper_job, _addr(src)) in self._downstream

    def _route_upstream(self, job: int) -> None:
        self._downstream = {k: j for k, j in self._downstream.items() if j != job}
        state = self.jobs.get(job)
        up = state.cfg.upstream if state is not None else None
        if up is not None and up.linked:
            self._downstream[(up.job, up.addr)] = job

    def set_member(self, job: int, rank: int, addr: Addr | None, tag: int = 0) -> None:
        """Register ``rank``'s address and tag (``addr`` None: unregister it)."""
        cfg = self.jobs[job].cfg
        if not 0 <= rank < cfg.world:
            raise ValueError(f"rank {rank} outside 0..{cfg.world - 1}")
        cfg.tags.pop(rank, None)
        if addr is None:
            cfg.members.pop(rank, None)
        else:
            cfg.members[rank] = _addr(addr)
            if check_tag(tag):
                cfg.tags[rank] = tag

    def set_awaited(self, job: int, awaited: int) -> None:
        """The members a round of ``job`` waits for (a bitmap of ranks): the job's world less the
        members declared gone. A round already open that has all of them is released by rule 0 at
        the next packet to its slot."""
        state = self.jobs[job]
        state.awaited = check_awaited(awaited, state.cfg.world)

    def set_strategy(self, job: int, entries: list[TableEntry]) -> None:
        """Replace the job's strategy table with exactly these rows (what the data planes store;
        ``StrategyTable.table_entries()`` makes them). Open banks keep the row they opened with."""
        entries = check_table(entries)
        if self.jobs[job].cfg.upstream is not None:
            check_upstream_table(job, entries)
        for e in entries:
            check_strategy(self.jobs[job].cfg.combine, e.kind)
        self.jobs[job].table = entries

    def strategy_table(self, job: int) -> list[TableEntry]:
        return list(self.jobs[job].table)

    # -- counters ------------------------------------------------------------------------------
    def counters(self, job: int) -> np.ndarray:
        """uint64[len(Counter)] for ``job`` (a copy)."""
        return self.jobs[job].counters.copy()

    def counter(self, job: int, name: str) -> int:
        """One counter by name, including those only the model has so far (STRATEGY_COUNTERS)."""
        return self.jobs[job].counter(name)

    def drops(self, job: int = NO_JOB) -> np.ndarray:
        """uint64[len(DropReason)] for ``job`` or the NO_JOB bucket (a copy)."""
        return self._drops[job].copy()

    def stats(self) -> dict:
        """Every counter by name: {"jobs": {job: {"counters": {...}, "drops": {...}}}, "no_job": {...}}."""
        def named(arr: np.ndarray, enum_: type[enum.IntEnum]) -> dict[str, int]:
            return {m.name.lower(): int(arr[m]) for m in enum_}
        return {"jobs": {j: {"counters": named(s.counters, Counter) | s.pending,
                             "drops": named(self._drops[j], DropReason)} for j, s in self.jobs.items()},
                "no_job": named(self._drops[NO_JOB], DropReason)}

    # -- the data path ---------------------------------------------------------------------------
    def process(self, data: bytes | bytearray | memoryview, src: Addr, now_ns: int = 0) -> Verdict:
        """One UDP payload (aggd header + int32 payload) from ``src`` at time ``now_ns`` (u64 ns,
        the data plane's clock); see the module docstring."""
        size = len(data)
        if size < HEADER_SIZE:
            return self._drop(NO_JOB, DropReason.TOO_SHORT)
        hdr = Header.unpack(data)
        if hdr.magic != MAGIC:
            return self._drop(NO_JOB, DropReason.BAD_MAGIC)
        if hdr.version != VERSION:
            return self._drop(NO_JOB, DropReason.BAD_VERSION)
        if hdr.type in (MsgType.JOIN, MsgType.JOIN_ACK, MsgType.SHARDS) and not self.userspace:
            return Verdict("pass")      # membership and shard maps are the daemon's business
        rack = self._downstream.get((hdr.job, _addr(src))) if hdr.type == MsgType.RESULT else None
        if hdr.type == MsgType.RESULT and rack is None and not self.userspace:
            return Verdict("pass")      # not ours: the daemon refuses it (bad_type)
        if hdr.type not in (MsgType.CONTRIB, MsgType.REREAD) and rack is None:
            return self._drop(NO_JOB, DropReason.BAD_TYPE)    # aggregators take results only from above
        # values the payload holds, in the type its ``code`` names (int32 if it names none)
        lanes = LANES.get(hdr.code, LANES[Precision.INT32])
        width = lanes.result_bytes if hdr.type == MsgType.RESULT else lanes.contrib_bytes
        held = (size - HEADER_SIZE) // width
        per_packet = self.elements * lanes.per_lane
        if hdr.count == 0 or hdr.count > per_packet or hdr.count > held:
            return self._drop(NO_JOB, DropReason.BAD_COUNT)
        if rack is not None:
            return self._from_upstream(self.jobs[rack], data, hdr, held)

        job = self.jobs.get(hdr.job)
        if job is None:
            return self._nack(NO_JOB, DropReason.UNKNOWN_JOB, NackCode.UNKNOWN_JOB, hdr, src)
        cfg = job.cfg
        job.count("rx_packets")
        job.count("rx_bytes", size)
        if hdr.flags & Flag.RETRANSMIT:
            job.count("retransmits")
        if hdr.rank >= cfg.world:
            return self._nack(cfg.job, DropReason.BAD_RANK, NackCode.NOT_MEMBER, hdr, src)
        if cfg.members.get(hdr.rank) != (src[0], src[1]):
            return self._nack(cfg.job, DropReason.NOT_MEMBER, NackCode.NOT_MEMBER, hdr, src)
        if hdr.contributors != cfg.tags.get(hdr.rank, 0):
            return self._drop(cfg.job, DropReason.BAD_TAG)
        if hdr.code != cfg.precision:
            return self._drop(cfg.job, DropReason.BAD_PRECISION)
        if hdr.chunk >= cfg.max_chunks:
            return self._drop(cfg.job, DropReason.BAD_CHUNK)
        if not self.userspace and size - HEADER_SIZE not in self._kernel_sizes(lanes):
            job.count("to_userspace")    # the kernel takes exactly its packet size of values
            return Verdict("pass", job=cfg.job)

        values = np.frombuffer(data, lanes.contrib, count=min(held, per_packet), offset=HEADER_SIZE)
        if hdr.type == MsgType.CONTRIB and (
                (cfg.bound is not None and cfg.bound.beyond(values, hdr.exponent))
                or (cfg.norm_bound is not None and cfg.norm_bound.beyond_norm(values, hdr.exponent))):
            job.members[hdr.rank, M_OFFENCES] += 1
            return self._drop(cfg.job, DropReason.OUT_OF_BOUNDS)
        if cfg.combine.robust and hdr.type == MsgType.CONTRIB and hdr.step:
            return self._drop(cfg.job, DropReason.BAD_STEP)     # one row a member
        return self._slot_rules(job, job.slots[hdr.chunk % cfg.slots], hdr, values, src, now_ns)

    def packet_sizes(self, job: int) -> tuple[int, int]:
        """The payload sizes ``job``'s members send (docs/protocol.md, "Payload"): its packet of
        contribution values, and the same with room for the result."""
        lanes = LANES[Precision(self.jobs[job].cfg.precision)]
        per_packet = self.elements * lanes.per_lane
        return (per_packet * lanes.contrib_bytes, per_packet * lanes.result_bytes)

    def _kernel_sizes(self, lanes) -> tuple[int, ...]:
        """Payload sizes the kernel takes: its packet size of contribution values, and for a narrow
        precision the same with room for the result (docs/protocol.md, "Precision"); where frames
        cannot grow, a narrow one only with the room."""
        per_packet = self.elements * lanes.per_lane
        room = per_packet * lanes.result_bytes
        if lanes.contrib_bytes == lanes.result_bytes or self.frames_grow:
            return (per_packet * lanes.contrib_bytes, room)
        return (room,)

    def _from_upstream(self, state: JobState, data, hdr: Header, held: int) -> Verdict:
        """A result of the upper aggregator for the rack job ``state`` (docs/protocol.md, "Two
        levels"), its count checked."""
        cfg = state.cfg
        state.count("rx_packets")
        state.count("rx_bytes", len(data))
        if hdr.code != cfg.precision:
            return self._drop(cfg.job, DropReason.BAD_PRECISION)
        if hdr.chunk >= cfg.max_chunks:
            return self._drop(cfg.job, DropReason.BAD_CHUNK)
        if not self.userspace and len(data) - HEADER_SIZE != self.elements * 4:
            state.count("to_userspace")
            return Verdict("pass", job=cfg.job)
        values = np.frombuffer(data, PAYLOAD_DTYPE, count=min(held, self.elements), offset=HEADER_SIZE)
        return self._relay(state, state.slots[hdr.chunk % cfg.slots], hdr, values, data)

    def _slot_rules(self, job: JobState, slot: Slot, hdr: Header, values: np.ndarray, src: Addr,
                    now: int) -> Verdict:
        """docs/protocol.md, "Per contribution K = (round, chunk) from member X"."""
        for bank in slot.banks:                                                  # rule 0
            if bank.expired(now):
                job.count("timeouts")
                bank.unannounced = True
                self._release(job, bank, "timeout")
            elif bank.settled(job.awaited) and job.cfg.upstream is not None:
                bank.state = BankState.FORWARDED   # sent up by the next retransmission into it
            elif bank.settled(job.awaited):
                bank.unannounced = True
                self._release(job, bank, "complete")
        key = (hdr.round, hdr.chunk)
        slot.note_sender(hdr.rank, key, hdr.step, job.cfg.slots, bool(hdr.flags & Flag.ORDERED))
        if slot.pending is not None and slot.bank_of(slot.pending) is not None:
            slot.pending = None             # (a carry's holding bank took it, or it opened)
        bank, newest = slot.bank_of(key), slot.newest()
        if hdr.type == MsgType.REREAD:
            if bank is not None and bank.state == BankState.RELEASED:
                return self._resend(job, bank, hdr, src)
            if bank is not None or newest is None or key > newest:
                return self._drop(job.cfg.job, DropReason.NOT_READY)
            return self._drop(job.cfg.job, DropReason.STALE)

        if bank is not None and bank.state == BankState.OPEN:                  # rule 1
            if bank.counted(hdr.rank, hdr.step):
                return self._drop(job.cfg.job, DropReason.DUPLICATE)
            if bank.holding and slot.pending is not None and key > slot.pending:
                return self._drop(job.cfg.job, DropReason.BUSY)    # a round proper after the pending key
            return self._contribute(job, bank, hdr, values, src, fresh=False, now=now)
        if bank is not None:                                                     # rule 2
            if bank.counted(hdr.rank, hdr.step):     # carried ones are marked counted in B too
                if bank.state == BankState.FORWARDED:   # the upper lost it, or we its answer
                    return self._forward(job, bank, hdr, retransmit=True)
                return self._resend(job, bank, hdr, src)
            return self._late(job, slot, bank, hdr, values, src, now)
        if newest is None or key > newest:                                       # rule 3
            bank = self._open(job, slot, key, hdr.skip, hdr.count, now)
            if bank is None:
                return self._drop(job.cfg.job, DropReason.BUSY)
            return self._contribute(job, bank, hdr, values, src, fresh=not bank.holding, now=now)
        return self._late(job, slot, None, hdr, values, src, now)                # rule 4

    def _hold(self, job: JobState, slot: Slot, round_: int, chunk: int, count: int, now: int) -> Bank | None:
        """Rule 4's new round for a carry: a holding bank for the next round of ``chunk`` (after its
        newest bank, and after the slot's newest key, so its members will still come to it),
        if another bank stays free for the rounds in progress; None means busy."""
        r2 = max((b.key[0] for b in slot.of_chunk(chunk)), default=round_) + 1   # full holding ones too
        newest = slot.newest()
        if newest is not None and (r2, chunk) <= newest:
            r2 = newest[0] + (chunk <= newest[1])   # (newest round, chunk) is later iff chunk is
        if r2 > U32_MAX:
            return None
        entry = governing(job.table, r2)
        if slot.n_free(job.awaited, entry.kind) < 2:
            return None
        bank = slot.free_bank(job.awaited, entry.kind)
        bank.open((r2, chunk), entry, now, holding=True, count=count)
        return bank

    def _open(self, job: JobState, slot: Slot, key: Key, skip: int, count: int, now: int) -> Bank | None:
        """Rule 3: open a bank for a new round if no key before it was refused (``pending``), it
        is the next round of its chunk (the packet's ``skip`` says which round that follows) and
        its strategy admits it; the chunk's holding bank, if any, becomes that round. None means busy."""
        if slot.pending is not None and key > slot.pending:
            return None
        entry = governing(job.table, key[0])
        bank = self._open_in_order(job, slot, key, skip, count, entry, now)
        if bank is None and entry.kind in KEPT_KINDS:
            slot.pending = key
        elif bank is not None and key == slot.pending:
            # only a bank holding it clears it: refused again under a strategy swapped in that
            # keeps no pending key (sync), it still goes first
            slot.pending = None
        return bank

    def _open_in_order(self, job: JobState, slot: Slot, key: Key, skip: int, count: int, entry: TableEntry,
                       now: int) -> Bank | None:
        rounds = [b.key[0] for b in slot.of_chunk(key[1]) if not b.holding]
        if rounds and not follows(key[0], skip, max(rounds)):
            return None           # a round whose predecessor was refused must not open first
        held = min(slot.holding_of(key[1]), key=lambda b: b.key, default=None)
        if held is not None:      # the carries wait for the chunk's next round: this one
            held.adopt(key, entry, skip)
            return held
        if not admits(entry, slot, key[0]):
            return None
        bank = slot.free_bank(job.awaited, entry.kind)
        if bank is None:
            return None
        bank.open(key, entry, now, skip=skip, count=count)
        return bank

    def _contribute(self, job: JobState, bank: Bank, hdr: Header, values: np.ndarray, src: Addr,
                    fresh: bool, now: int) -> Verdict:
        """Rule 1 after the duplicate test: the member's own contribution to an open round."""
        self._add(job, bank, hdr, values, fresh)
        # lag: the start of the member's call only (its step-0 chunk 0; JobState.count_member)
        job.count_member(hdr.rank, hdr.round, now, now - bank.t_first if hdr.chunk == 0 and hdr.step == 0 else 0,
                         late=False)
        if bank.holding:           # the round proper starts: its order, admission, deadline and count
            bank.holding, bank.t_first, bank.count = False, now, hdr.count
        if hdr.step == 0:          # a later step must not stand in for the member's own (step 0)
            bank.bitmap |= 1 << hdr.rank
        bank.steps[hdr.rank] |= 1 << hdr.step
        if bank.complete(job.awaited):
            if job.cfg.upstream is not None:      # a rack job's sum goes up, not out
                bank.state = BankState.FORWARDED
                return self._forward(job, bank, hdr, retransmit=False)
            self._release(job, bank, "complete")
            return self._to_group(job, self._result(job, bank, hdr))
        if bank.kind == StrategyKind.ASYNC:
            job.count("partials")
            return self._to_sender(job, self._result(job, bank, hdr), src)
        return Verdict("drop", job=job.cfg.job)     # absorbed: counted as a contribution

    def _late(self, job: JobState, slot: Slot, origin: Bank | None, hdr: Header, values: np.ndarray,
              src: Addr, now: int) -> Verdict:
        """Rule 4: carry a late contribution into the next round of its chunk, answer with the
        newest released result of that chunk. ``origin`` is K's released bank, if any."""
        if not job.awaited >> hdr.rank & 1 or job.cfg.combine.robust:
            # declared gone: answered, never carried (its own contribution may be in the next round);
            # a robust job's round has one row a member: its own
            newest = slot.newest_released(hdr.chunk)
            if newest is None:
                return self._drop(job.cfg.job, DropReason.STALE)
            return self._resend(job, newest, hdr, src)
        key = (hdr.round, hdr.chunk)
        k = hdr.chunk // job.cfg.slots
        remembered = hdr.step == 0 and k < 64         # what the slot's LateMemory can hold
        mem = slot.late[hdr.rank]
        known = remembered and mem.round == hdr.round
        # a copy, not a late contribution: retransmitted, or a first copy of step 0 whose round a
        # strategy other than quorum governed (it released with every awaited member, this one's
        # copy counted: a delayed packet, carried, would add it twice)
        copy = hdr.flags & Flag.RETRANSMIT or (
            hdr.step == 0 and governing(job.table, hdr.round).kind != StrategyKind.QUORUM)
        if origin is None and copy and not (known and mem.refused >> k & 1):
            if known and mem.carried >> k & 1:         # counted, not answered yet
                answer = slot.newest_released(hdr.chunk)
                if answer is None:
                    return self._drop(job.cfg.job, DropReason.NOT_READY)
                return self._resend(job, answer, hdr, src)
            answer = slot.newest_released(hdr.chunk)
            if answer is not None and answer.kind == StrategyKind.QUORUM:
                # a quorum went on without the sender, its round gone: the quorum's newest result
                # of the chunk, as a quorum answers its stragglers (never carried: it may be a copy
                # of one counted)
                return self._resend(job, answer, hdr, src)
            return self._drop(job.cfg.job, DropReason.STALE)   # cannot be told from a duplicate
        later = [b for b in slot.of_chunk(hdr.chunk, BankState.OPEN) if b.key[0] > hdr.round]
        # a quorum round full of carries (stragglers rounds behind carry each late round into the
        # same next one) takes no more: its terms would pass what its members quantise for. The
        # carry goes on to a later round; with no bank for one it is answered uncarried, as below
        # (refused, the straggler's call could wait on a round that waits on it)
        roomy = [b for b in later if not b.full(job.cfg.world)]
        full = len(roomy) < len(later)
        target = min(roomy, key=lambda b: b.key, default=None)
        fresh = target is None
        if fresh:
            target = self._hold(job, slot, hdr.round, hdr.chunk, hdr.count, now)
            # its quorum round, kept for it, or (its round gone: a straggler more rounds behind
            # than the slot has banks, say once the slot came to serve several chunk indices) the
            # chunk's newest quorum result
            answer = origin if origin is not None else slot.newest_released(hdr.chunk)
            if (target is None and (slot.shared or full) and answer is not None and answer.state == BankState.RELEASED
                    and answer.kind == StrategyKind.QUORUM):
                # answers it even with no bank to carry its values into (they are dropped, as a
                # quorum may): refused, it would come back to a slot whose banks are kept for it,
                # for good
                job.count("uncarried")
                if self.on_uncarried is not None:
                    self.on_uncarried(job.cfg.job, hdr, values)
                if origin is not None:
                    origin.steps[hdr.rank] |= 1 << hdr.step     # its retransmission: answered (rule 2)
                return self._resend(job, answer, hdr, src)
            if target is None:
                if remembered:
                    mem.at(hdr.round).refused |= 1 << k
                return self._drop(job.cfg.job, DropReason.BUSY)
        if known:
            mem.refused &= ~(1 << k)
        self._add(job, target, hdr, values, fresh)
        job.count_member(hdr.rank, hdr.round, now, 0, late=True)
        target.flags |= Flag.CARRIED
        target.carried += 1
        job.count("carried")
        if origin is not None and origin.state != BankState.EMPTY and origin.key == key:
            origin.late |= 1 << hdr.rank
            # per (member, step): its retransmission is answered; a later wbsp step is carried too
            origin.steps[hdr.rank] |= 1 << hdr.step
        if origin is not None and origin.state == BankState.RELEASED and origin.key == key:
            # its own round's result, still in its bank: a later round of the chunk may hold
            # another tensor (tensors of several sizes), whose values would answer the wrong call
            answer = origin
        else:
            answer = slot.newest_released(hdr.chunk)   # after the carry: it may have taken a bank
        if answer is None:
            if remembered:                             # its retransmission will be answered
                mem.at(hdr.round).carried |= 1 << k
            return Verdict("drop", job=job.cfg.job)
        return self._resend(job, answer, hdr, src)

    # -- helpers -----------------------------------------------------------------------------------
    def _add(self, job: JobState, bank: Bank, hdr: Header, values: np.ndarray, fresh: bool) -> None:
        """Add one contribution's values into a bank (the first one of a fresh bank is copied); a
        robust job's is kept as its member's row, combined at the release."""
        if bank.rows is not None:
            self.arith.load(bank.rows[hdr.rank], values)
            bank.row_exp[hdr.rank] = hdr.exponent
        elif fresh:
            self.arith.load(bank.values, values)
            bank.exponent = hdr.exponent
        else:
            bank.exponent = self.arith.accumulate(bank.values, bank.exponent, values, hdr.exponent)
        # a rack aggregator's partial sum counts as the contributions it holds (0: a worker's one)
        bank.n_contrib = (bank.n_contrib + max(1, hdr.n_contrib)) & 0xFFFF
        job.count("contributions")
        job.count("elements", hdr.count)

    def _release(self, job: JobState, bank: Bank, cause: str) -> None:
        if bank.rows is not None:
            self._combine(job, bank)
        bank.state = BankState.RELEASED
        job.count("released")
        if self.on_release is not None:
            self.on_release(job.cfg.job, bank, cause)

    def _combine(self, job: JobState, bank: Bank) -> None:
        """A robust job's release: the rows of the members who contributed, combined into the
        bank's sums, and each one's score terms added to its member's."""
        ranks = [r for r in range(job.cfg.world) if bank.bitmap >> r & 1]
        rows, exps = bank.rows[ranks], bank.row_exp[ranks]
        values, bank.exponent = self.arith.combine(rows, exps, job.cfg.combine)
        bank.values[:] = values
        terms, ref = score_terms(rows, exps, bank.values, bank.exponent)
        job.scores[ranks, :2] += terms
        job.scores[ranks, S_REF] += ref

    def refuse(self, bucket: int, reason: DropReason) -> Verdict:
        """A packet its caller drops for ``reason`` before the rules (the daemon's own checks),
        counted with this model's drops."""
        return self._drop(bucket, reason)

    def _drop(self, bucket: int, reason: DropReason) -> Verdict:
        self._drops[bucket][reason] += 1
        return Verdict("drop", reason, job=bucket)

    def _nack(self, bucket: int, reason: DropReason, code: NackCode, hdr: Header, src: Addr) -> Verdict:
        self._drops[bucket][reason] += 1
        out = Header(type=MsgType.NACK, job=hdr.job, rank=hdr.rank, round=hdr.round, chunk=hdr.chunk,
                     flags=self.served_flags, code=code).pack()
        return Verdict("tx", reason, out, "sender", (_addr(src),), bucket)

    def _result(self, job: JobState, bank: Bank, hdr: Header, extra_flags: int = 0,
                payload: bytes | None = None, as_came: Header | None = None) -> bytes:
        """A result of ``bank`` answering ``hdr``; ``payload``: its values as given (int32 bytes),
        not the bank's narrowed; ``as_came``: an upper result whose exponent, n_contrib and
        overflow/carried flags go with that payload instead of the bank's."""
        if payload is None:
            values, overflow = self.arith.narrow(bank.values, job.cfg.result_dtype)
            payload = values.tobytes()
            if overflow or (job.cfg.precision == Precision.INT8 and bank.n_contrib > INT8_MAX_CONTRIBUTIONS):
                extra_flags |= Flag.OVERFLOW
        flags, exponent, n_contrib = bank.flags | extra_flags, bank.exponent, bank.n_contrib
        if as_came is not None:
            upper = Flag.OVERFLOW | Flag.CARRIED
            flags = flags & ~upper | as_came.flags & upper
            exponent, n_contrib = as_came.exponent, as_came.n_contrib
        if flags & Flag.OVERFLOW:   # (a rack's bank may hold the upper's flag)
            job.count("overflows")
        out = Header(type=MsgType.RESULT, job=hdr.job, rank=RESULT_RANK, round=bank.key[0],
                     chunk=bank.key[1], count=bank.count, strategy_version=bank.version,
                     exponent=exponent, flags=flags | self.served_flags,
                     contributors=bank.bitmap, n_contrib=n_contrib, strategy=bank.kind,
                     param=bank.param, code=job.cfg.precision)
        return out.pack() + payload

    def _forward(self, job: JobState, bank: Bank, hdr: Header, retransmit: bool) -> Verdict:
        """A rack job's complete round, up to its upper aggregator as one contribution that holds
        ``n_contrib`` of them (again, flagged retransmit, when a member retransmits into it)."""
        up = job.cfg.upstream
        if up is None or not up.linked:
            return Verdict("drop", job=job.cfg.job)      # kept: sent once the rack has joined
        values, overflow = self.arith.narrow(bank.values, PAYLOAD_DTYPE)
        if overflow:
            bank.flags |= Flag.OVERFLOW                  # the members learn it from the result
        out = Header(type=MsgType.CONTRIB, job=up.job, rank=up.rank, round=bank.key[0], chunk=bank.key[1],
                     count=bank.count, exponent=bank.exponent, flags=Flag.RETRANSMIT if retransmit else 0,
                     contributors=up.tag, n_contrib=bank.n_contrib, skip=bank.skip).pack()
        job.count("forwarded")
        return Verdict("tx", None, out + values.tobytes(), "upstream", (up.addr,), job.cfg.job)

    def _relay(self, job: JobState, slot: Slot, hdr: Header, values: np.ndarray, data) -> Verdict:
        """The upper aggregator's result of a forwarded round: kept in its bank (the members' re-reads
        and retransmissions are answered from it) and sent to the rack's members; a second copy
        (the answer to a re-send) goes to them again."""
        bank = slot.bank_of((hdr.round, hdr.chunk))
        if bank is None or bank.state not in (BankState.FORWARDED, BankState.RELEASED):
            return self._drop(job.cfg.job, DropReason.STALE)
        fresh = bank.state == BankState.FORWARDED
        if fresh:
            self.arith.load(bank.values, values)
            bank.exponent, bank.n_contrib = hdr.exponent, hdr.n_contrib
            bank.flags |= hdr.flags & (Flag.OVERFLOW | Flag.CARRIED)
            self._release(job, bank, "complete")
        job.count("relayed")
        if fresh:
            return self._to_group(job, self._result(job, bank, replace(hdr, job=job.cfg.job)))
        # an upper result of a round relayed before (the answer to a re-send; under async a newer
        # running sum, or the round's release once a running sum was relayed) goes on as it came:
        # its values with its own exponent, n_contrib and overflow/carried flags, which the bank's
        # (the first result's) would mislabel
        again = bytes(data[HEADER_SIZE:HEADER_SIZE + 4 * len(bank.values)]).ljust(4 * len(bank.values), b"\0")
        return self._to_group(job, self._result(job, bank, replace(hdr, job=job.cfg.job), payload=again,
                                                as_came=hdr))

    def _to_group(self, job: JobState, out: bytes) -> Verdict:
        cfg = job.cfg
        addrs = (cfg.group,) if cfg.group is not None else tuple(cfg.members[r] for r in sorted(cfg.members))
        return Verdict("tx", None, out, "group", addrs, cfg.job)

    def _to_sender(self, job: JobState, out: bytes, src: Addr) -> Verdict:
        return Verdict("tx", None, out, "sender", (_addr(src),), job.cfg.job)

    def _resend(self, job: JobState, bank: Bank, hdr: Header, src: Addr) -> Verdict:
        """Send a released result back: to the sender as a re-send, except the first answer from a
        round released by its deadline, which announces it to the whole group."""
        if bank.unannounced:
            bank.unannounced = False
            return self._to_group(job, self._result(job, bank, hdr))
        job.count("rereads")
        return self._to_sender(job, self._result(job, bank, hdr, Flag.REREAD), src)


def _zero_drops() -> np.ndarray:
    return np.zeros(len(DropReason), np.uint64)
