"""The job registry: jobs, their tokens and members, strategy versions and where their slots live.

Pure logic, no I/O: the daemon (``aggd.daemon.service``) applies what the registry decides to the data
planes and persists :meth:`Registry.to_json` after every change. Time and randomness come in as
arguments (``now``, ``token_factory``, ``tag_factory``) so tests are deterministic.

Placement. A job's pool has ``slots`` slots; chunk ``c`` uses slot ``c % slots``. Slots
``[0, kernel_slots)`` live in the kernel (a contiguous range of the kernel's slot array, first fit
within the memory budget), slots ``[kernel_slots, slots)`` in the daemon's user-space path. The
XDP program passes packets for user-space slots up (Counter.TO_USERSPACE), so every chunk has
exactly one home and no slot state is shared between the two paths. A job whose packet size differs
from the kernel's is served wholly in user space (as is a job of int8 or int16 contributions where
the kernel program does not add them: ``Limits.narrow_in_kernel``).
"""
from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

from aggd_client.protocol import (MAX_ELEMENTS, MAX_JOBS, MAX_MEMBERS, PRECISION_OF_BITS, NackCode, Precision,
                                  values_per_packet)
from aggd_client.quant import HEADROOM, MAX_HEADROOM, MAX_SPAN

from aggd.core import robust
from aggd.core import strategy as strat

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")   # the whole name (fullmatch: no trailing newline)
# A token given by the operator (the same job on several aggregator hosts): at least 128 bits' worth
# of the characters a generated one uses, no more than a JOIN carries (membership.MAX_TOKEN).
_TOKEN = re.compile(r"[A-Za-z0-9_-]{32,128}")
STATE_VERSION = 1

Addr = tuple[str, int]


class RegistryError(ValueError):
    """A request the registry refuses; ``kind`` is a stable word for scripts (``unknown_job``...)."""

    def __init__(self, message: str, kind: str = "refused"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Limits:
    """What the registry needs to know about the aggregator it describes."""
    kernel_budget: int                #: kernel slots new jobs may use (from the memory budget)
    elements: int                     #: the kernel program's packet size
    port: int                         #: aggd port (kernel path; user space behind it)
    userspace_port: int               #: port for jobs whose packets the kernel cannot take
    result_port: int
    group_base: str = "239.77.0.0"
    default_slots: int = 1024
    max_slots: int = 1 << 14          #: most slots a job may ask for ([jobs] max_slots)
    max_job_memory: int = 256 << 20   #: most bytes of sums a job's slots may take ([jobs] max_job_memory)
    max_chunks: int = 1 << 24
    gso: bool = True                  #: workers may send with UDP GSO (false in generic mode)
    #: the fast data plane forwards a rack job's rounds itself (XDP does; the P4 programs do not, so
    #: there a rack job is served in user space)
    forwards_in_kernel: bool = True
    #: the fast data plane adds int8 and int16 contributions itself (the XDP program in a page's
    #: frame; the P4 programs do not): otherwise a job of those is served in user space
    narrow_in_kernel: bool = True
    #: ... and checks per-member bounds (the XDP program up to native XDP's largest packet; the P4
    #: programs do not): otherwise a bounded job is served in user space
    bounds_in_kernel: bool = True
    #: the fast data plane answers a narrow contribution in its own frame but cannot grow a frame to
    #: the wider result (native XDP on veth or in multi-buffer frames): workers of narrow jobs send
    #: contributions with room for it (the JOIN_ACK's ``room``), or each goes through the daemon
    #: ([dataplane] narrow_room)
    narrow_room: bool = False


@dataclass(frozen=True)
class UpstreamSpec:
    """A rack job's upper aggregator (docs/hierarchy.md): the job ``job`` (name or id) on the aggd at
    ``server``, joined with ``token`` as rank ``rank``; ``span`` is every worker under the top, whose
    contributions one result holds (the rack's members quantise for them)."""
    server: Addr
    job: str
    token: str
    rank: int
    span: int

    def to_json(self) -> dict:
        return {"server": list(self.server), "job": self.job, "token": self.token, "rank": self.rank,
                "span": self.span}

    def describe(self) -> dict:
        """What operators see: everything but the token."""
        d = self.to_json()
        d.pop("token")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "UpstreamSpec":
        return cls((str(d["server"][0]), int(d["server"][1])), str(d["job"]), str(d["token"]), int(d["rank"]),
                   int(d["span"]))


def upstream_spec(d, world: int) -> UpstreamSpec:
    """The ``upstream`` of a job-create request, checked: RegistryError naming the key and why."""
    if not isinstance(d, dict):
        raise RegistryError(f"upstream must be an object with server, job, token, rank and span, not {d!r}",
                            "bad_request")
    missing = [k for k in ("server", "job", "token", "rank", "span") if k not in d]
    if missing:
        raise RegistryError(f"upstream: missing {', '.join(missing)}", "bad_request")
    server = d["server"]
    if isinstance(server, str):
        host, _, port = server.rpartition(":")
        server = [host, int(port)] if port.isdigit() else [server, None]
    try:
        ipaddress.IPv4Address(server[0])
        ok = len(server) == 2 and _is_int(server[1]) and 0 < server[1] < 65536
    except (ValueError, TypeError, IndexError, KeyError):
        ok = False
    if not ok:
        raise RegistryError(f"upstream.server must be IPV4:PORT, not {d['server']!r}", "bad_request")
    if not isinstance(d["job"], str) or not (_NAME.fullmatch(d["job"]) or d["job"].isdigit()):
        raise RegistryError(f"upstream.job must be the upper job's name or id, not {d['job']!r}", "bad_request")
    if not isinstance(d["token"], str) or not 1 <= len(d["token"]) <= 128:
        raise RegistryError("upstream.token must be the upper job's token (1 to 128 characters)", "bad_request")
    if not _is_int(d["rank"]) or not 0 <= d["rank"] < MAX_MEMBERS:
        raise RegistryError(f"upstream.rank must be 0..{MAX_MEMBERS - 1}, not {d['rank']!r}", "bad_request")
    if not _is_int(d["span"]) or not world <= d["span"] <= MAX_SPAN:
        raise RegistryError(f"upstream.span (workers under the top aggregator) must be {world}..{MAX_SPAN}, "
                            f"not {d['span']!r}", "bad_request")
    return UpstreamSpec((str(server[0]), int(server[1])), d["job"], d["token"], int(d["rank"]), int(d["span"]))


@dataclass
class Member:
    rank: int
    address: Addr
    joined_at: float
    #: The secret its packets carry (docs/protocol.md, "Member tags"): given in its JOIN_ACK, new
    #: for every new address; 0 for a member that has none.
    tag: int = 0

    def to_json(self) -> dict:
        return {"rank": self.rank, "address": list(self.address), "joined_at": self.joined_at, "tag": self.tag}

    def describe(self) -> dict:
        """What operators see: everything but the tag."""
        return {"rank": self.rank, "address": list(self.address), "joined_at": self.joined_at}

    @classmethod
    def from_json(cls, d: dict) -> "Member":
        return cls(int(d["rank"]), (str(d["address"][0]), int(d["address"][1])), float(d["joined_at"]),
                   int(d.get("tag", 0)))


#: A robust job's default weight of |x|^2 in its Zeno score: an honest member scores about
#: 1 - rho·(1 + noise/signal), so it stays above 0 with gradient noise up to ~19x the signal.
DEFAULT_SCORE_RHO = 0.05


@dataclass
class Job:
    name: str
    id: int
    token: str
    world: int
    slots: int
    max_chunks: int
    elements: int
    group: Addr
    port: int                          #: where workers send (the aggd port or the user-space port)
    kernel_base: int = 0
    kernel_slots: int = 0
    #: strategy versions, oldest first: (version, from_round, text); the last STRATEGY_VERSIONS kept
    strategies: list[tuple[int, int, str]] = field(default_factory=list)
    members: dict[int, Member] = field(default_factory=dict)
    created_at: float = 0.0
    #: Contributions per member every round is quantised for (JOIN_ACK ``headroom``; docs/protocol.md,
    #: "Quantisation and the error bound"): fixed for the job's life, so that a round sent under one
    #: strategy and governed by another never holds more than its senders left room for.
    headroom: int = MAX_HEADROOM
    #: Members declared gone (silent, removed by hand, restarted): rank -> {"since": time,
    #: "reason": why, "round": the job's round then (or the round it rejoined at)}. Rounds stop
    #: waiting for them (``awaited``) until they keep pace again.
    gone: dict[int, dict] = field(default_factory=dict)
    #: A rack job: its complete rounds go up to this aggregator (docs/hierarchy.md); None: a flat job.
    upstream: UpstreamSpec | None = None
    #: Bits of a contribution value: 32, 16 or 8 (docs/protocol.md, "Precision"; JOIN_ACK ``precision``).
    precision_bits: int = 32
    #: The largest magnitude a member's contribution may have (docs/protocol.md, "Bounds"); None: any.
    max_abs: float | None = None
    #: The largest L2 norm a member's contribution (one packet's values) may have; None: any.
    max_norm: float | None = None
    #: How many contributions beyond a bound make the policy quarantine a member (0: never).
    quarantine_after: int = 0
    #: How a round's contributions are combined: "sum", "median", "trimmed:t", "zeno" (docs/protocol.md,
    #: "Robust jobs"); a robust job is served in user space.
    combine: str = "sum"
    #: A robust job's Zeno score weight of ``|x|^2`` (aggd.core.departures.zeno_score).
    score_rho: float = DEFAULT_SCORE_RHO
    #: Policy windows in a row with a score below -0.5 (departures.SUSPECT_SCORE) that quarantine a member (0: never).
    score_after: int = 0
    #: The round after the newest any member had sent when the daemon last stopped: a data plane
    #: that lost its rounds (a reboot, --reset-kernel-state) must not start the job's rounds again
    #: below it, where the strategy table's versions and the members' records are
    resume_round: int = 0

    def round_floor(self) -> int:
        """The lowest round a restart of every member may go on from: past what the daemon saw
        before it stopped, and at least the newest strategy version's first round (an earlier one
        would run under versions the table has moved past, and leave no room for a new one)."""
        return max([self.resume_round] + [r for _, r, _ in self.strategies])

    @property
    def precision(self) -> Precision:
        return PRECISION_OF_BITS[self.precision_bits]

    @property
    def values_per_packet(self) -> int:
        """Values a packet of the job carries: ``elements`` (int32 lanes), two a lane at 8 bits."""
        return values_per_packet(self.elements, self.precision)

    @property
    def combine_rule(self) -> robust.Combine:
        return robust.parse_combine(self.combine, self.score_rho)

    def quarantined(self, rank: int) -> bool:
        """Whether ``rank`` is gone as quarantined: no member until readmitted by hand."""
        return bool(self.gone.get(rank, {}).get("quarantined"))

    # -- derived ---------------------------------------------------------------------------------
    @property
    def userspace_slots(self) -> int:
        return self.slots - self.kernel_slots

    @property
    def span(self) -> int:
        """Workers whose contributions one result holds: the tree's for a rack job."""
        return self.upstream.span if self.upstream is not None else self.world

    @property
    def strategy(self) -> strat.Strategy:
        return strat.parse(self.strategies[-1][2])

    @property
    def awaited(self) -> int:
        """The members a round waits for, as a bitmap of ranks: all but those declared gone."""
        return ((1 << self.world) - 1) & ~sum(1 << r for r in self.gone)

    @property
    def strategy_version(self) -> int:
        return self.strategies[-1][0]

    def strategy_table(self) -> strat.StrategyTable:
        first = self.strategies[0]
        table = strat.StrategyTable(strat.parse(first[2]))
        table.entries = [(v, r, strat.parse(t)) for v, r, t in self.strategies]
        return table

    def placement(self) -> dict:
        """Which slots (so which chunks) each path serves."""
        k = self.kernel_slots
        return {
            "rule": f"chunk c uses slot c % {self.slots}",
            "kernel": {"slots": [0, k], "array": [self.kernel_base, self.kernel_base + k] if k else None},
            "userspace": {"slots": [k, self.slots]},
        }

    def join_info(self) -> dict:
        """The job's parameters a worker needs (the JOIN_ACK payload, see docs/protocol.md)."""
        return {"job": self.id, "name": self.name, "world": self.world,
                "group": list(self.group) if self.group else None,
                "port": self.port, "elements": self.values_per_packet, "slots": self.slots,
                "max_chunks": self.max_chunks, "strategy": str(self.strategy),
                "strategy_version": self.strategy_version, "headroom": self.headroom, "span": self.span,
                "precision": self.precision_bits, "combine": self.combine}

    def describe(self, with_token: bool = True) -> dict:
        d = {"name": self.name, "id": self.id, "world": self.world, "slots": self.slots,
             "max_chunks": self.max_chunks, "elements": self.elements,
             "values_per_packet": self.values_per_packet, "group": list(self.group),
             "port": self.port, "strategy": str(self.strategy), "strategy_version": self.strategy_version,
             "headroom": self.headroom, "precision": self.precision_bits, "max_abs": self.max_abs,
             "max_norm": self.max_norm, "quarantine_after": self.quarantine_after, "combine": self.combine,
             "score_rho": self.score_rho, "score_after": self.score_after, "resume_round": self.resume_round,
             "strategies": [{"version": v, "from_round": r, "strategy": t} for v, r, t in self.strategies],
             "kernel_slots": self.kernel_slots, "userspace_slots": self.userspace_slots,
             "placement": self.placement(),
             "members": {str(r): m.describe() for r, m in sorted(self.members.items())},
             "joined": len(self.members), "created_at": self.created_at,
             "gone": {str(r): dict(g) for r, g in sorted(self.gone.items())},
             "upstream": self.upstream.describe() if self.upstream is not None else None}
        if with_token:
            d["token"] = self.token
        return d

    def to_json(self) -> dict:
        d = self.describe()
        for derived in ("strategy", "strategy_version", "userspace_slots", "placement", "joined"):
            d.pop(derived)
        d["kernel_base"] = self.kernel_base
        d["strategies"] = [list(e) for e in self.strategies]
        d["members"] = [m.to_json() for _, m in sorted(self.members.items())]
        d["upstream"] = self.upstream.to_json() if self.upstream is not None else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Job":
        job = cls(name=d["name"], id=int(d["id"]), token=d["token"], world=int(d["world"]),
                  slots=int(d["slots"]), max_chunks=int(d["max_chunks"]), elements=int(d["elements"]),
                  group=(str(d["group"][0]), int(d["group"][1])), port=int(d["port"]),
                  kernel_base=int(d["kernel_base"]), kernel_slots=int(d["kernel_slots"]),
                  strategies=[(int(v), int(r), str(t)) for v, r, t in d["strategies"]],
                  created_at=float(d.get("created_at", 0.0)), headroom=int(d.get("headroom", MAX_HEADROOM)),
                  precision_bits=int(d.get("precision", 32)),
                  max_abs=None if d.get("max_abs") is None else float(d["max_abs"]),
                  max_norm=None if d.get("max_norm") is None else float(d["max_norm"]),
                  quarantine_after=int(d.get("quarantine_after", 0)), combine=str(d.get("combine", "sum")),
                  score_rho=float(d.get("score_rho", DEFAULT_SCORE_RHO)), score_after=int(d.get("score_after", 0)),
                  resume_round=int(d.get("resume_round", 0)))
        job.members = {m.rank: m for m in map(Member.from_json, d["members"])}
        job.gone = {int(r): {"since": float(g["since"]), "reason": str(g["reason"]), "round": int(g["round"]),
                             "quarantined": bool(g.get("quarantined", False))}
                    for r, g in d.get("gone", {}).items()}
        if d.get("upstream"):
            job.upstream = UpstreamSpec.from_json(d["upstream"])
        return job


@dataclass(frozen=True)
class JoinOutcome:
    """The answer to a JOIN: ``code`` NONE means accepted (``job`` set, ``changed`` if the member
    address is new); otherwise ``message`` says why it was refused."""
    code: NackCode
    message: str
    job: Job | None = None
    changed: bool = False
    #: the rank had joined before: a restarted worker (a live client never joins twice)
    rejoined: bool = False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)   # true is not a world size


#: Banks a slot holds (``aggd.core.model.BANKS``; the registry does not import the model).
BANKS = 4
#: Bytes a value takes in a slot: BANKS banks of 64-bit sums.
SUM_BYTES = BANKS * 8


def slots_bytes(slots: int, elements: int, rows: int = 0) -> int:
    """Bytes of sums ``slots`` slots of ``elements`` values take where every slot of a job is held
    (the user-space path's arrays), and a robust job's ``rows`` (its world) of int32 a bank."""
    return slots * elements * (SUM_BYTES + BANKS * rows * 4)


def _valid_strategy(strategy: str | strat.Strategy, world: int, headroom: int = MAX_HEADROOM) -> strat.Strategy:
    """``strategy`` parsed (unless it is a Strategy already) and checked for a job of ``world`` whose
    rounds are quantised for ``headroom`` contributions per member; RegistryError (bad_strategy)
    saying why not."""
    if not isinstance(strategy, (str, strat.Strategy)):
        raise RegistryError(f"strategy must be text such as 'quorum:3', not {strategy!r}", "bad_strategy")
    shown = strategy if isinstance(strategy, str) else str(strategy)
    try:
        parsed = strat.parse(strategy) if isinstance(strategy, str) else strategy
        parsed = parsed.validate(world)
    except strat.StrategyError as exc:
        raise RegistryError(f"bad strategy {shown!r}: {exc}", "bad_strategy") from None
    needs = HEADROOM.get(parsed.kind, 1)
    if needs > headroom:
        raise RegistryError(f"strategy {shown!r} puts up to {needs} contributions per member in a round; the "
                            f"job's rounds leave room for {headroom} (its headroom, set at creation)", "bad_strategy")
    return parsed


def _check_positive(key: str, value, what: str) -> None:
    """RegistryError unless ``value`` is None or a positive finite number (``what`` it is)."""
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and 0 < value < float("inf")):
        raise RegistryError(f"{key} must be a positive number ({what}), not {value!r}", "bad_request")


def _count(key: str, value, unit: str) -> int:
    """``value`` (None: 0) if it is 0 or more; RegistryError naming ``key`` otherwise."""
    value = 0 if value is None else value
    if not _is_int(value) or value < 0:
        raise RegistryError(f"{key} must be 0 (never) or a number of {unit}, not {value!r}", "bad_request")
    return value


def _check_combine(rule: robust.Combine, strategy: strat.Strategy, kernel_slots, upstream) -> None:
    """The job's combine rule against its other keys; RegistryError naming the key."""
    if not rule.robust:
        return
    try:
        robust.check_strategy(rule, strategy.kind)
    except ValueError as exc:
        raise RegistryError(f"strategy {str(strategy)!r}: {exc}", "bad_strategy") from None
    if kernel_slots:
        raise RegistryError(f"kernel_slots {kernel_slots}: a {rule} job is served in user space (its rows are "
                            f"kept apart there): leave kernel_slots out or 0", "bad_request")
    if upstream is not None:
        raise RegistryError(f"combine {rule}: a rack job (upstream) forwards sums", "bad_request")


class Registry:
    def __init__(self, limits: Limits, *, token_factory: Callable[[], str] = lambda: secrets.token_hex(16),
                 tag_factory: Callable[[], int] = lambda: secrets.randbits(64) or 1):
        self.limits = limits
        self.jobs: dict[int, Job] = {}
        self._token = token_factory
        self._tag = tag_factory

    # -- lookup ------------------------------------------------------------------------------------
    def get(self, ref: str | int) -> Job:
        """A job by name or id (an int, or a string of digits)."""
        if _is_int(ref) or (isinstance(ref, str) and ref.isascii() and ref.isdigit() and len(ref) < 20):
            job = self.jobs.get(int(ref))
        else:
            job = next((j for j in self.jobs.values() if j.name == ref), None)
        if job is None:
            raise RegistryError(f"no job {ref!r}", "unknown_job")
        return job

    def list(self) -> list[Job]:
        return [self.jobs[i] for i in sorted(self.jobs)]

    # -- kernel slots ---------------------------------------------------------------------------
    def kernel_used(self) -> int:
        return sum(j.kernel_slots for j in self.jobs.values())

    def _free_runs(self) -> list[tuple[int, int]]:
        """Free (base, length) runs of kernel slots within the budget, in address order."""
        used = sorted((j.kernel_base, j.kernel_slots) for j in self.jobs.values() if j.kernel_slots)
        runs, at = [], 0
        for base, n in used:
            if base > at:
                runs.append((at, min(base, self.limits.kernel_budget) - at))
            at = max(at, base + n)
        if at < self.limits.kernel_budget:
            runs.append((at, self.limits.kernel_budget - at))
        return [(b, n) for b, n in runs if n > 0]

    def largest_free_run(self) -> int:
        return max((n for _, n in self._free_runs()), default=0)

    def _place(self, want: int) -> tuple[int, int]:
        """(base, count) for up to ``want`` kernel slots: first fit of the largest count that fits.
        First fit over the same used set is what the XDP loader's allocator does too, so both
        agree on the base."""
        count = min(want, self.largest_free_run())
        if count <= 0:
            return 0, 0
        base = next(b for b, n in self._free_runs() if n >= count)
        return base, count

    # -- jobs ------------------------------------------------------------------------------------
    def create(self, name: str, world: int, *, strategy: str = "sync", slots: int | None = None,
               elements: int | None = None, kernel_slots: int | None = None, headroom: int | None = None,
               token: str | None = None, upstream: dict | None = None, precision: int | None = None,
               max_abs: float | None = None, max_norm: float | None = None, quarantine_after: int | None = None,
               combine: str | None = None,
               score_rho: float | None = None, score_after: int | None = None, now: float = 0.0) -> Job:
        """A new job. ``kernel_slots`` caps the slots held in the kernel (None: as many as fit);
        ``headroom``: contributions per member its rounds are quantised for (None: room for every
        strategy; less gives finer sums but refuses the strategies that need more); ``token``: the
        job's token (None: a new one), so a job sharded over several aggregator hosts has one;
        ``upstream``: makes it a rack job (``upstream_spec``: server, job, token, rank, span);
        ``precision``: bits of a contribution value, 32 (None), 16 or 8; ``max_abs``: the largest
        magnitude a member's contribution may have (None: any), ``max_norm`` the largest L2 norm of
        one packet's values (None: any), ``quarantine_after``: contributions beyond either that
        quarantine the member (None or 0: never); ``combine``: "sum" (None), "median",
        "trimmed:t" or "zeno" (a robust job, served in user space); ``score_rho`` and ``score_after``: a
        robust job's score weight and the policy windows with a score below -0.5 that quarantine a
        member (None or 0: never)."""
        lim = self.limits
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RegistryError(f"job name {name!r}: start with a letter; letters, digits, '_', '.', '-'; "
                                f"at most 64 characters", "bad_request")
        if any(j.name == name for j in self.jobs.values()):
            raise RegistryError(f"a job named {name!r} exists already", "exists")
        if not _is_int(world) or not 1 <= world <= MAX_MEMBERS:
            raise RegistryError(f"world must be 1..{MAX_MEMBERS}, not {world!r}", "bad_request")
        slots = lim.default_slots if slots is None else slots
        if not _is_int(slots) or slots < 1:
            raise RegistryError(f"slots must be a positive integer, not {slots!r}", "bad_request")
        if slots > lim.max_slots:
            raise RegistryError(f"slots {slots} is more than the {lim.max_slots} a job may have "
                                f"([jobs] max_slots)", "too_large")
        elements = lim.elements if elements is None else elements
        if not _is_int(elements) or not 1 <= elements <= MAX_ELEMENTS:
            raise RegistryError(f"elements must be 1..{MAX_ELEMENTS}, not {elements!r}", "bad_request")
        try:
            rule = robust.parse_combine("sum" if combine is None else combine)
        except ValueError as exc:
            raise RegistryError(str(exc), "bad_request") from None
        rows = world if rule.robust else 0
        precision = 32 if precision is None else precision
        if not _is_int(precision) or precision not in PRECISION_OF_BITS:
            raise RegistryError(f"precision must be one of 32, 16, 8 (bits of a contribution value), "
                                f"not {precision!r}", "bad_request")
        per_packet = values_per_packet(elements, PRECISION_OF_BITS[precision])
        if slots_bytes(slots, per_packet, rows) > lim.max_job_memory:
            raise RegistryError(f"{slots} slots of {per_packet} values take {slots_bytes(slots, per_packet, rows)} bytes"
                                f"{f' (with a row a member: combine {combine})' if rows else ''}, "
                                f"more than the {lim.max_job_memory} a job may have ([jobs] max_job_memory)",
                                "too_large")
        if kernel_slots is not None and (not _is_int(kernel_slots) or kernel_slots < 0):
            raise RegistryError(f"kernel_slots must be 0 or more, not {kernel_slots!r}", "bad_request")
        headroom = MAX_HEADROOM if headroom is None else headroom
        if not _is_int(headroom) or not 1 <= headroom <= MAX_HEADROOM:
            raise RegistryError(f"headroom must be 1..{MAX_HEADROOM}, not {headroom!r}", "bad_request")
        parsed = _valid_strategy(strategy, world, headroom)
        _check_positive("max_abs", max_abs, "the largest magnitude a member's contribution may have")
        _check_positive("max_norm", max_norm, "the largest L2 norm of a member's contribution, one packet's values")
        quarantine_after = _count("quarantine_after", quarantine_after, "contributions")
        if quarantine_after and max_abs is None and max_norm is None:
            raise RegistryError("quarantine_after needs max_abs or max_norm (the bound whose offences it counts)",
                                "bad_request")
        _check_combine(rule, parsed, kernel_slots, upstream)
        score_rho = DEFAULT_SCORE_RHO if score_rho is None else score_rho
        if not (isinstance(score_rho, (int, float)) and not isinstance(score_rho, bool) and 0 <= score_rho < 1e6):
            raise RegistryError(f"score_rho must be a number, 0 or more (the score's weight of |x|^2), not "
                                f"{score_rho!r}", "bad_request")
        score_after = _count("score_after", score_after, "policy windows")
        if score_after and not rule.robust:
            raise RegistryError("score_after needs a robust combine (median, trimmed:t or zeno): a summing job "
                                "scores nobody", "bad_request")
        spec = None if upstream is None else upstream_spec(upstream, world)
        if spec is not None and precision != 32:
            raise RegistryError(f"precision {precision}: a rack job (upstream) forwards int32 sums, so its "
                                f"precision is 32", "bad_request")
        if spec is not None and parsed.kind != strat.StrategyKind.SYNC:
            raise RegistryError(f"strategy {str(parsed)!r}: a rack job (upstream) is sync only", "bad_strategy")
        if token is not None and not (isinstance(token, str) and _TOKEN.fullmatch(token)):
            raise RegistryError("token must be 32 to 128 letters, digits, '_' or '-' (the token of the "
                                "same job on another aggregator host)", "bad_request")
        free_ids = [i for i in range(1, MAX_JOBS) if i not in self.jobs] + ([0] if 0 not in self.jobs else [])
        if not free_ids:
            raise RegistryError(f"all {MAX_JOBS} job ids are in use", "full")
        job_id = free_ids[0]
        # The kernel program takes exactly `elements` values a packet; it passes shorter payloads
        # up, and larger ones go to the user-space port. Either way such a job holds no kernel slot.
        same_size = elements == lim.elements and (spec is None or lim.forwards_in_kernel) and \
            (precision == 32 or lim.narrow_in_kernel) and \
            (max_abs is None and max_norm is None or lim.bounds_in_kernel) and \
            not rule.robust
        want = min(slots, kernel_slots if kernel_slots is not None else slots) if same_size else 0
        base, count = self._place(want)
        group = (str(_ip_add(lim.group_base, job_id)), lim.result_port)
        job = Job(name=name, id=job_id, token=self._token() if token is None else token, world=world, slots=slots,
                  max_chunks=lim.max_chunks, elements=elements, group=group,
                  port=lim.port if elements <= lim.elements else lim.userspace_port,
                  kernel_base=base, kernel_slots=count, strategies=[(0, 0, str(parsed))], created_at=now,
                  headroom=headroom, upstream=spec, precision_bits=precision,
                  max_abs=None if max_abs is None else float(max_abs),
                  max_norm=None if max_norm is None else float(max_norm), quarantine_after=quarantine_after,
                  combine=str(rule), score_rho=float(score_rho), score_after=score_after)
        self.jobs[job_id] = job
        return job

    def delete(self, ref: str | int) -> Job:
        """Remove a job; its kernel slots return to the budget."""
        job = self.get(ref)
        del self.jobs[job.id]
        return job

    # -- membership -------------------------------------------------------------------------------
    def join(self, ref: str | int, rank: int, token: str, address: Addr, now: float = 0.0) -> JoinOutcome:
        """A worker asks to be ``rank`` of a job from ``address`` with the job's token.

        Checks in order: the job exists (UNKNOWN_JOB), the token matches (BAD_TOKEN), the rank is
        below the world size (NOT_MEMBER). Accepted, ``address`` becomes the rank's registered
        address, replacing an earlier one (a restarted worker rejoins from a new port), with a new
        tag; a JOIN repeated from the same address (its answer was lost) gets the same tag."""
        try:
            job = self.get(ref)
        except RegistryError as exc:
            return JoinOutcome(NackCode.UNKNOWN_JOB, str(exc))
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), job.token.encode()):
            return JoinOutcome(NackCode.BAD_TOKEN, f"the token for job {job.name!r} was refused")
        if not isinstance(rank, int) or not 0 <= rank < job.world:
            return JoinOutcome(NackCode.NOT_MEMBER,
                               f"rank {rank} is not a member of job {job.name!r} (world {job.world}: "
                               f"ranks 0..{job.world - 1})", job)
        if job.quarantined(rank):
            return JoinOutcome(NackCode.NOT_MEMBER,
                               f"rank {rank} of job {job.name!r} is quarantined ({job.gone[rank]['reason']}): "
                               f"aggctl workers readmit lets it back", job)
        address = (str(address[0]), int(address[1]))
        for other in job.members.values():
            if other.rank != rank and other.address == address:
                return JoinOutcome(NackCode.NOT_MEMBER,
                                   f"{address[0]}:{address[1]} is rank {other.rank} of job {job.name!r} "
                                   f"already; one address per rank", job)
        old = job.members.get(rank)
        changed = old is None or old.address != address
        if changed:
            job.members[rank] = Member(rank, address, now, self._tag())
        return JoinOutcome(NackCode.NONE, "joined", job, changed, rejoined=old is not None)

    def depart(self, ref: str | int, rank: int, reason: str, now: float = 0.0, at_round: int = 0,
               quarantined: bool = False) -> Job:
        """Declare ``rank`` of a job gone at round ``at_round``: rounds stop waiting for it (and,
        ``quarantined``, it is no member until readmitted by hand: its packets and JOINs are
        refused). Refused for a rank outside the world, one gone already, or the last member awaited."""
        job = self.get(ref)
        if not _is_int(rank) or not 0 <= rank < job.world:
            raise RegistryError(f"rank {rank!r} is not a member of job {job.name!r} (ranks 0..{job.world - 1})",
                                "bad_rank")
        if rank in job.gone:
            raise RegistryError(f"rank {rank} of job {job.name!r} is gone already "
                                f"({job.gone[rank]['reason']})", "already_gone")
        if job.awaited == 1 << rank:
            raise RegistryError(f"rank {rank} is the last member job {job.name!r} waits for", "last_member")
        job.gone[rank] = {"since": float(now), "reason": str(reason), "round": int(at_round),
                          "quarantined": bool(quarantined)}
        return job

    def readmit(self, ref: str | int, rank: int) -> Job:
        """Rounds wait for ``rank`` again (it keeps pace once more)."""
        job = self.get(ref)
        if not _is_int(rank) or job.gone.pop(rank, None) is None:
            raise RegistryError(f"rank {rank} of job {job.name!r} is not gone", "not_gone")
        return job

    def leave(self, ref: str | int, rank: int) -> Job:
        job = self.get(ref)
        job.members.pop(rank, None)
        return job

    # -- strategies --------------------------------------------------------------------------------
    def set_strategy(self, ref: str | int, strategy: str | strat.Strategy,
                     from_round: int) -> tuple[Job, strat.StrategyTable]:
        """Record a new strategy version (text, or a Strategy its caller parsed already) that governs
        rounds from ``from_round`` on (from round 0, for a job that has run no round, it replaces
        every version). Returns the job and its table (whose ``table_entries()`` the data planes
        install). Nothing changes if the strategy or the round is refused."""
        job = self.get(ref)
        parsed = _valid_strategy(strategy, job.world, job.headroom)
        try:
            robust.check_strategy(job.combine_rule, parsed.kind)
        except ValueError as exc:
            raise RegistryError(f"strategy {str(parsed)!r}: {exc}", "bad_strategy") from None
        if not _is_int(from_round) or not 0 <= from_round < 1 << 32:
            raise RegistryError(f"from_round must be a round number, not {from_round!r}", "bad_request")
        version, first, _ = job.strategies[-1]
        if 0 < from_round <= first:
            raise RegistryError(f"strategy version {version} of job {job.name!r} governs from round {first}; "
                                f"a new version must start after it", "bad_round")
        table = job.strategy_table()
        try:
            table.install(version + 1, from_round, parsed)
        except strat.StrategyError as exc:
            raise RegistryError(str(exc), "bad_round") from None
        job.strategies = [(v, r, str(s)) for v, r, s in table.entries]
        return job, table

    # -- persistence ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"version": STATE_VERSION, "jobs": [j.to_json() for j in self.list()]}

    def load_json(self, data: dict) -> None:
        """Replace the registry's jobs with a saved state (from :meth:`to_json`)."""
        if data.get("version") != STATE_VERSION:
            raise RegistryError(f"state version {data.get('version')!r} is not {STATE_VERSION}", "bad_state")
        self.jobs = {j.id: j for j in map(Job.from_json, data["jobs"])}

    def with_limits(self, limits: Limits) -> None:
        """New limits (a reload): existing jobs keep their placement; new jobs use the new ones."""
        self.limits = limits


def answer_join(registry: Registry, data: bytes | memoryview, src: Addr, now: float = 0.0,
                round_of: Callable[[JoinOutcome, int], int] = lambda outcome, rank: 0
                ) -> tuple[bytes | None, JoinOutcome | None]:
    """A JOIN message from ``src`` -> (the JOIN_ACK to send back, the registry's outcome).
    ``round_of(outcome, rank)``: the round the accepted member starts at (0 for a new job's
    members; the job's next round for one that restarted or was declared gone).

    A malformed payload is refused (NackCode.BAD_REQUEST, the reason in one line); (None, None)
    when not even the header can be read (it may not come from an aggd client). The caller
    applies an accepted outcome with ``changed`` to the data planes."""
    from aggd_client.membership import decode_join, encode_join_ack
    from aggd_client.protocol import HEADER_SIZE, Header

    if len(data) < HEADER_SIZE:
        return None, None
    try:
        hdr, ref, token = decode_join(data)
    except ValueError as exc:
        hdr = Header.unpack(data)
        outcome = JoinOutcome(NackCode.BAD_REQUEST, str(exc))
        return encode_join_ack(hdr.job, hdr.rank, outcome.code, {"error": outcome.message}), outcome
    outcome = registry.join(ref, hdr.rank, token, src, now)
    if outcome.code != NackCode.NONE:
        job_id = outcome.job.id if outcome.job else hdr.job
        return encode_join_ack(job_id, hdr.rank, outcome.code, {"error": outcome.message}), outcome
    body = outcome.job.join_info()
    body["gso"] = registry.limits.gso
    job = outcome.job
    if registry.limits.narrow_room and job.precision_bits != 32 and job.kernel_slots:
        body["room"] = True
    body["round"] = int(round_of(outcome, hdr.rank))
    body["tag"] = f"{outcome.job.members[hdr.rank].tag:016x}"
    return encode_join_ack(outcome.job.id, hdr.rank, 0, body), outcome


def _ip_add(base: str, n: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(base) + n
