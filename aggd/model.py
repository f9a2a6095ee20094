"""Reference model of the aggregator: the per-packet behaviour of docs/protocol.md as pure logic.

No I/O. ``AggregatorModel.process(udp_payload, sender)`` returns a ``Verdict`` (what the XDP program
would do with the packet: drop / transmit / pass to user space, and the exact bytes it would send)
and updates per-job counters the way the kernel's counter maps must. The XDP program is compared
against this model packet by packet, the P4 backend's tests are driven by it, and the user-space
server (``aggd.userspace``) runs it with the numba kernels as its arithmetic.

Points docs/protocol.md leaves open, fixed here (the data planes must follow them):

* Order: too_short, bad_magic, bad_version, bad_type, bad_count, unknown_job (NACK), bad_rank
  (NACK NOT_MEMBER), not_member (NACK NOT_MEMBER), bad_chunk, then the hand-off to user space of a
  payload that is not exactly ``elements`` int32 (``pass``, Counter.TO_USERSPACE), then the slot
  rules. Malformed or foreign packets are therefore refused by the kernel itself, never passed up.
* Drops before the job lookup succeeds (too_short .. unknown_job) count under the ``NO_JOB`` bucket.
  RX_PACKETS, RX_BYTES (aggd message bytes, i.e. the UDP payload) and RETRANSMITS (packets with
  Flag.RETRANSMIT) count every packet whose job is known, including those dropped later.
  ELEMENTS counts ``count`` (data elements) per contribution added; OVERFLOWS counts contributions
  whose addition overflowed somewhere; REREADS counts results re-sent (case 2).
* The whole payload is added (a constant trip count in the kernel), not only ``count`` elements.
* An int32 overflow stores the wrapped value (what C does) and sets Flag.OVERFLOW on the bank, so
  the result carries the flag; the client refuses such a result ("never returned wrapped" without
  the flag).
* A re-sent result (case 2) goes by unicast to the sender, like a NACK (SwitchML does the same):
  the other members already have it. A NACK is a bare header: magic, version, type, job, rank,
  round, chunk, code and flags (only the ``served_flags`` of this aggregator); everything else 0.
* Only unknown_job, bad_rank and not_member are NACKed; bad_chunk and stale are silent drops
  (NackCode.BAD_CHUNK / STALE are reserved).
* A re-read never opens a bank: same key released -> re-send; same key open, or a newer key ->
  ``not_ready``; an older key matching no bank -> ``stale``.
* Keys ``(round, chunk)`` compare as unsigned tuples, no wrap-around. A slot starts with bank 0
  active and both banks EMPTY (a zeroed map value); a new key always flips the active bank first,
  so the first round of a slot lands in bank 1.
* The result header echoes the packet's job/round/chunk/count; rank 0xFFFF, code 0, step 0.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import numpy as np

from aggd_client.protocol import (HEADER_SIZE, MAGIC, MAX_JOBS, MAX_MEMBERS, PAYLOAD_DTYPE,
                                  STRATEGY_VERSIONS, VERSION, ZERO_EXPONENT, Counter, DropReason,
                                  Flag, Header, MsgType, NackCode, StrategyKind)
from aggd_client.protocol.definition import DEFAULT_ELEMENTS

from .strategy import SYNC, Strategy, StrategyTable

Addr = tuple[str, int]

#: Drop-counter bucket for packets dropped before their job is known (row MAX_JOBS of a C array).
NO_JOB = MAX_JOBS
RESULT_RANK = 0xFFFF
INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
MAX_SHIFT = 31


# --------------------------------------------------------------------------------------------
# Arithmetic: one interface, two implementations (numpy here, numba in aggd.kernels).

def np_load(dst: np.ndarray, src: np.ndarray) -> None:
    """First contribution of a key: copy, zero-padding a short payload, ignoring extra elements."""
    n = min(len(src), len(dst))
    dst[:n] = src[:n]
    dst[n:] = 0


def np_accumulate(acc: np.ndarray, acc_exp: int, src: np.ndarray, src_exp: int) -> tuple[int, bool]:
    """Add ``src`` into ``acc`` aligning to the smaller exponent; return (exponent, overflowed).

    The finer operand is arithmetically shifted right by the exponent difference, clamped to 31 (an
    int32 shifted by 31 is already its sign, so the clamp is exact). A sum outside int32 is stored
    wrapped, as C stores it, and reported.
    """
    exp = min(acc_exp, src_exp)
    n = min(len(src), len(acc))
    total = acc.astype(np.int64) >> min(acc_exp - exp, MAX_SHIFT)
    total[:n] += src[:n].astype(np.int64) >> min(src_exp - exp, MAX_SHIFT)
    overflow = bool(((total > INT32_MAX) | (total < INT32_MIN)).any())
    acc[:] = total.astype(np.int32)  # wraps modulo 2**32
    return exp, overflow


class Arithmetic(NamedTuple):
    load: Callable[[np.ndarray, np.ndarray], None]
    accumulate: Callable[[np.ndarray, int, np.ndarray, int], tuple[int, bool]]


NUMPY_ARITHMETIC = Arithmetic(np_load, np_accumulate)


# --------------------------------------------------------------------------------------------
# Configuration.



@dataclass
class JobConfig:
    job: int
    world: int
    slots: int
    max_chunks: int
    members: dict[int, Addr]
    #: Results' multicast group and port; None = unicast fan-out to every member's address.
    group: Addr | None = None
    #: The job's packet size; None = the aggregator's. The kernel has one size, so it must match.
    elements: int | None = None
    strategy: Strategy = SYNC

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
        if self.group is not None:
            self.group = _addr(self.group)


def _addr(a: Addr) -> Addr:
    return (str(a[0]), int(a[1]))


# --------------------------------------------------------------------------------------------
# Slot state (docs/protocol.md, "Aggregation semantics").

class BankState(enum.IntEnum):
    EMPTY = 0
    OPEN = 1
    RELEASED = 2


@dataclass
class Bank:
    values: np.ndarray                 #: int32[elements], a view into the job's slot array
    state: BankState = BankState.EMPTY
    key: tuple[int, int] = (0, 0)      #: (round, chunk); meaningless while EMPTY
    bitmap: int = 0                    #: ranks counted
    n_contrib: int = 0
    exponent: int = ZERO_EXPONENT
    flags: int = 0                     #: Flag bits the result carries (OVERFLOW, later CARRIED)
    version: int = 0                   #: strategy version that governs the bank's round

    def open(self, key: tuple[int, int], version: int) -> None:
        self.state, self.key, self.version = BankState.OPEN, key, version
        self.bitmap = self.n_contrib = self.flags = 0
        self.exponent = ZERO_EXPONENT


@dataclass
class Slot:
    """A slot's banks. Sync uses two (active + shadow); SSP will want ``staleness + 2``."""
    banks: list[Bank]
    active: int = 0

    def find(self, key: tuple[int, int], state: BankState) -> Bank | None:
        for bank in self.banks:
            if bank.state == state and bank.key == key:
                return bank
        return None


@dataclass
class JobState:
    cfg: JobConfig
    slots: list[Slot]
    strategies: StrategyTable
    counters: np.ndarray = field(default_factory=lambda: np.zeros(len(Counter), np.uint64))


# --------------------------------------------------------------------------------------------
# Verdicts.

@dataclass(frozen=True)
class Verdict:
    """What the data plane does with one packet.

    ``action``: "drop", "tx" (``out`` goes to ``dest``) or "pass" (to user space). A NACK is a
    "tx" to the sender that also carries a drop ``reason``: the packet is counted as that drop.
    ``addrs`` resolves ``dest`` to UDP addresses (the group, every member in fan-out mode, or the
    sender); ``job`` is the counter bucket (a job id or NO_JOB). A contribution absorbed into a
    slot without releasing it is ``Verdict("drop", None)``: XDP_DROP with no drop counted.
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


# --------------------------------------------------------------------------------------------
# The model.

class AggregatorModel:
    """Per-packet aggregator logic shared by the reference model and the user-space server.

    ``userspace=True`` is the user-space path: payloads of any length that holds ``count`` are
    served (zero-padded), never passed on, and every message sent carries Flag.USERSPACE.
    """

    def __init__(self, elements: int = DEFAULT_ELEMENTS, *, userspace: bool = False,
                 arithmetic: Arithmetic = NUMPY_ARITHMETIC) -> None:
        self.elements = elements
        self.userspace = userspace
        self.served_flags = int(Flag.USERSPACE) if userspace else 0
        self.arith = arithmetic
        self.jobs: dict[int, JobState] = {}
        self._drops: dict[int, np.ndarray] = {NO_JOB: _zero_drops()}

    # -- registry ------------------------------------------------------------------------------
    def add_job(self, cfg: JobConfig) -> None:
        if cfg.job in self.jobs:
            raise ValueError(f"job {cfg.job} already registered")
        if cfg.elements is not None and cfg.elements != self.elements:
            raise ValueError(f"job {cfg.job} wants {cfg.elements} elements a packet, "
                             f"the aggregator has {self.elements}")
        cfg = replace(cfg, members=dict(cfg.members))  # ours to mutate (set_member)
        rule = RULES.get(cfg.strategy.kind)
        if rule is None:
            raise NotImplementedError(f"strategy {cfg.strategy.kind.name} is not implemented yet")
        values = np.zeros((cfg.slots, rule.banks, self.elements), np.int32)
        slots = [Slot([Bank(values[s, b]) for b in range(rule.banks)]) for s in range(cfg.slots)]
        self.jobs[cfg.job] = JobState(cfg, slots, StrategyTable(cfg.strategy))
        self._drops[cfg.job] = _zero_drops()

    def remove_job(self, job: int) -> None:
        self.jobs.pop(job, None)
        self._drops.pop(job, None)

    def set_member(self, job: int, rank: int, addr: Addr | None) -> None:
        cfg = self.jobs[job].cfg
        if not 0 <= rank < cfg.world:
            raise ValueError(f"rank {rank} outside 0..{cfg.world - 1}")
        if addr is None:
            cfg.members.pop(rank, None)
        else:
            cfg.members[rank] = _addr(addr)

    # -- counters ------------------------------------------------------------------------------
    def counters(self, job: int) -> np.ndarray:
        """uint64[len(Counter)] for ``job`` (a copy)."""
        return self.jobs[job].counters.copy()

    def drops(self, job: int = NO_JOB) -> np.ndarray:
        """uint64[len(DropReason)] for ``job`` or the NO_JOB bucket (a copy)."""
        return self._drops[job].copy()

    def stats(self) -> dict:
        """Every counter by name: {"jobs": {job: {"counters": {...}, "drops": {...}}}, "no_job": {...}}."""
        def named(arr: np.ndarray, enum_: type[enum.IntEnum]) -> dict[str, int]:
            return {m.name.lower(): int(arr[m]) for m in enum_}
        return {"jobs": {j: {"counters": named(s.counters, Counter),
                             "drops": named(self._drops[j], DropReason)} for j, s in self.jobs.items()},
                "no_job": named(self._drops[NO_JOB], DropReason)}

    # -- the data path ---------------------------------------------------------------------------
    def process(self, data: bytes | bytearray | memoryview, src: Addr) -> Verdict:
        """One UDP payload (aggd header + int32 payload) from ``src``; see the module docstring."""
        size = len(data)
        if size < HEADER_SIZE:
            return self._drop(NO_JOB, DropReason.TOO_SHORT)
        hdr = Header.unpack(data)
        if hdr.magic != MAGIC:
            return self._drop(NO_JOB, DropReason.BAD_MAGIC)
        if hdr.version != VERSION:
            return self._drop(NO_JOB, DropReason.BAD_VERSION)
        if hdr.type not in (MsgType.CONTRIB, MsgType.REREAD):
            return self._drop(NO_JOB, DropReason.BAD_TYPE)
        held = (size - HEADER_SIZE) // 4
        if hdr.count == 0 or hdr.count > self.elements or hdr.count > held:
            return self._drop(NO_JOB, DropReason.BAD_COUNT)

        job = self.jobs.get(hdr.job)
        if job is None:
            return self._nack(NO_JOB, DropReason.UNKNOWN_JOB, NackCode.UNKNOWN_JOB, hdr, src)
        cfg, ctr = job.cfg, job.counters
        ctr[Counter.RX_PACKETS] += 1
        ctr[Counter.RX_BYTES] += size
        if hdr.flags & Flag.RETRANSMIT:
            ctr[Counter.RETRANSMITS] += 1
        if hdr.rank >= cfg.world:
            return self._nack(cfg.job, DropReason.BAD_RANK, NackCode.NOT_MEMBER, hdr, src)
        if cfg.members.get(hdr.rank) != (src[0], src[1]):
            return self._nack(cfg.job, DropReason.NOT_MEMBER, NackCode.NOT_MEMBER, hdr, src)
        if hdr.chunk >= cfg.max_chunks:
            return self._drop(cfg.job, DropReason.BAD_CHUNK)
        if not self.userspace and size - HEADER_SIZE != self.elements * 4:
            ctr[Counter.TO_USERSPACE] += 1
            return Verdict("pass", job=cfg.job)

        values = np.frombuffer(data, PAYLOAD_DTYPE, count=min(held, self.elements), offset=HEADER_SIZE)
        version, strategy = job.strategies.governing(hdr.round)
        slot = job.slots[hdr.chunk % cfg.slots]
        return RULES[strategy.kind].handle(self, job, slot, version, hdr, values, src)

    # -- helpers shared by the strategy rules ------------------------------------------------------
    def _drop(self, bucket: int, reason: DropReason) -> Verdict:
        self._drops[bucket][reason] += 1
        return Verdict("drop", reason, job=bucket)

    def _nack(self, bucket: int, reason: DropReason, code: NackCode, hdr: Header, src: Addr) -> Verdict:
        self._drops[bucket][reason] += 1
        out = Header(type=MsgType.NACK, job=hdr.job, rank=hdr.rank, round=hdr.round, chunk=hdr.chunk,
                     flags=self.served_flags, code=code).pack()
        return Verdict("tx", reason, out, "sender", (_addr(src),), bucket)

    def _result(self, job: JobState, bank: Bank, hdr: Header, extra_flags: int = 0) -> bytes:
        out = Header(type=MsgType.RESULT, job=hdr.job, rank=RESULT_RANK, round=hdr.round,
                     chunk=hdr.chunk, count=hdr.count, strategy_version=bank.version,
                     exponent=bank.exponent, flags=bank.flags | extra_flags | self.served_flags,
                     contributors=bank.bitmap, n_contrib=bank.n_contrib)
        return out.pack() + bank.values.astype(PAYLOAD_DTYPE, copy=False).tobytes()

    def _to_group(self, job: JobState, out: bytes) -> Verdict:
        cfg = job.cfg
        addrs = (cfg.group,) if cfg.group is not None else tuple(cfg.members[r] for r in sorted(cfg.members))
        return Verdict("tx", None, out, "group", addrs, cfg.job)

    def _resend(self, job: JobState, bank: Bank, hdr: Header, src: Addr) -> Verdict:
        job.counters[Counter.REREADS] += 1
        out = self._result(job, bank, hdr, Flag.REREAD)
        return Verdict("tx", None, out, "sender", (_addr(src),), job.cfg.job)

    def _add(self, job: JobState, bank: Bank, hdr: Header, values: np.ndarray) -> None:
        """Count one contribution into an open bank (the caller has checked it is not a duplicate)."""
        ctr = job.counters
        if bank.n_contrib == 0:
            self.arith.load(bank.values, values)
            bank.exponent = hdr.exponent
        else:
            bank.exponent, overflow = self.arith.accumulate(bank.values, bank.exponent, values, hdr.exponent)
            if overflow:
                bank.flags |= Flag.OVERFLOW
                ctr[Counter.OVERFLOWS] += 1
        bank.bitmap |= 1 << hdr.rank
        bank.n_contrib += 1
        ctr[Counter.CONTRIBUTIONS] += 1
        ctr[Counter.ELEMENTS] += hdr.count


def _zero_drops() -> np.ndarray:
    return np.zeros(len(DropReason), np.uint64)


# --------------------------------------------------------------------------------------------
# Strategy rules: the slot rules of one strategy, run after the header checks.

class SyncRule:
    """``sync`` (BSP): docs/protocol.md cases 1-4, release when every member has contributed."""
    banks = 2

    def handle(self, m: AggregatorModel, job: JobState, slot: Slot, version: int, hdr: Header,
               values: np.ndarray, src: Addr) -> Verdict:
        key = (hdr.round, hdr.chunk)
        active = slot.banks[slot.active]
        is_open = active.state == BankState.OPEN
        if is_open and active.key == key:                                   # case 1
            if hdr.type == MsgType.REREAD:
                return m._drop(job.cfg.job, DropReason.NOT_READY)
            if active.bitmap >> hdr.rank & 1:
                return m._drop(job.cfg.job, DropReason.DUPLICATE)
            m._add(job, active, hdr, values)
            if self.ready(job, active):
                active.state = BankState.RELEASED
                job.counters[Counter.RELEASED] += 1
                return m._to_group(job, m._result(job, active, hdr))
            return Verdict("drop", job=job.cfg.job)    # absorbed: counted as a contribution
        released = slot.find(key, BankState.RELEASED)
        if released is not None:                                            # case 2
            return m._resend(job, released, hdr, src)
        if active.state == BankState.EMPTY or key > active.key:            # case 3
            if hdr.type == MsgType.REREAD:
                return m._drop(job.cfg.job, DropReason.NOT_READY)
            if is_open:
                return m._drop(job.cfg.job, DropReason.BUSY)
            # The bank we reuse holds the result before last, which every member has.
            slot.active ^= 1
            bank = slot.banks[slot.active]
            bank.open(key, version)
            return self.handle(m, job, slot, version, hdr, values, src)
        return m._drop(job.cfg.job, DropReason.STALE)                       # case 4

    @staticmethod
    def ready(job: JobState, bank: Bank) -> bool:
        return bin(bank.bitmap).count("1") == job.cfg.world


#: Strategy kind -> rule. quorum/ssp/async/wbsp plug in here (each decides its bank count,
#: dedup key, release test and what a contribution to a released key does, e.g. carry it).
RULES: dict[StrategyKind, SyncRule] = {StrategyKind.SYNC: SyncRule()}
