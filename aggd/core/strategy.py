"""Synchronization strategies: the objects, their text form, validation, and the one translation
to data-plane table entries (the XDP strategy ring and the P4 strategy table both take
:class:`TableEntry`). Pure logic, no I/O.

Text form (config files, ``aggctl strategy set``): ``sync``, ``quorum:K`` or ``quorum:K:TIMEOUT``
(``quorum:3:20ms``), ``ssp:S``, ``async``, ``wbsp``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from aggd_client.protocol import MAX_MEMBERS, RESULT_WINDOW, STRATEGY_VERSIONS, StrategyKind

DEFAULT_QUORUM_TIMEOUT_US = 50_000
#: ssp:s lets a member have s + 1 rounds outstanding: at most the protocol's RESULT_WINDOW (a slot's
#: banks hold s + 1 open rounds and one released round kept for re-reads).
MAX_STALENESS = RESULT_WINDOW - 1


class StrategyError(ValueError):
    """A strategy that cannot hold for a job; the message says why."""


@dataclass(frozen=True)
class Strategy:
    kind: StrategyKind = StrategyKind.SYNC
    k: int = 0              #: quorum size (QUORUM)
    staleness: int = 0      #: rounds a worker may run ahead of the slowest (SSP)
    timeout_us: int = 0     #: release deadline after a round's first contribution (QUORUM)

    def __str__(self) -> str:
        if self.kind == StrategyKind.QUORUM:
            # exact, so the registry's saved text parses back to the same deadline
            t = self.timeout_us
            return f"quorum:{self.k}:{t // 1000}ms" if t % 1000 == 0 else f"quorum:{self.k}:{t}us"
        if self.kind == StrategyKind.SSP:
            return f"ssp:{self.staleness}"
        return self.kind.name.lower()

    def validate(self, world: int) -> "Strategy":
        """Raise :class:`StrategyError` unless this strategy can hold for a job of ``world``."""
        if self.kind == StrategyKind.QUORUM:
            if not 1 <= self.k <= world:
                raise StrategyError(f"quorum k={self.k} must be between 1 and the world size {world}")
            if self.timeout_us <= 0:
                raise StrategyError("a quorum needs a positive timeout")
        if self.kind == StrategyKind.SSP and not 0 <= self.staleness <= MAX_STALENESS:
            raise StrategyError(f"ssp staleness {self.staleness} must be between 0 and {MAX_STALENESS} "
                                f"(slots keep {MAX_STALENESS + 2} rounds)")
        if not 1 <= world <= MAX_MEMBERS:
            raise StrategyError(f"world size {world} outside 1..{MAX_MEMBERS}")
        return self


SYNC = Strategy()
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")


def parse_duration_us(text: str) -> int:
    m = _DURATION.match(text.strip())
    if not m:
        raise StrategyError(f"{text!r} is not a duration like 20ms, 500us or 1s")
    return int(float(m.group(1)) * {"us": 1, "ms": 1_000, "s": 1_000_000}[m.group(2)])


def parse(text: str) -> Strategy:
    """``"quorum:3:20ms"`` -> Strategy(QUORUM, k=3, timeout_us=20000); errors say what is wrong."""
    parts = text.strip().lower().split(":")
    name, args = parts[0], parts[1:]
    try:
        kind = StrategyKind[name.upper()]
    except KeyError:
        names = ", ".join(k.name.lower() for k in StrategyKind)
        raise StrategyError(f"unknown strategy {name!r}: use one of {names}") from None

    def integer(arg: str, what: str) -> int:
        if not re.fullmatch(r"-?\d+", arg):
            raise StrategyError(f"{what} must be an integer, not {arg!r}")
        return int(arg)

    if kind == StrategyKind.QUORUM:
        if len(args) not in (1, 2):
            raise StrategyError("quorum takes quorum:K or quorum:K:TIMEOUT (e.g. quorum:3:20ms)")
        timeout = parse_duration_us(args[1]) if len(args) == 2 else DEFAULT_QUORUM_TIMEOUT_US
        return Strategy(kind, k=integer(args[0], "quorum k"), timeout_us=timeout)
    if kind == StrategyKind.SSP:
        if len(args) != 1:
            raise StrategyError("ssp takes ssp:S (rounds a worker may run ahead)")
        s = integer(args[0], "ssp staleness")
        if s < 0:
            raise StrategyError(f"ssp staleness cannot be negative ({s})")
        return Strategy(kind, staleness=s)
    if args:
        raise StrategyError(f"{name} takes no arguments")
    return Strategy(kind)


@dataclass(frozen=True)
class TableEntry:
    """One row of a job's strategy table, as every data plane stores it."""
    version: int
    from_round: int
    kind: int
    param: int        #: quorum k, or ssp staleness
    timeout_us: int


def to_entry(strategy: Strategy, version: int, from_round: int) -> TableEntry:
    param = strategy.k if strategy.kind == StrategyKind.QUORUM else strategy.staleness
    return TableEntry(version, from_round, int(strategy.kind), param, strategy.timeout_us)


def from_entry(entry: TableEntry) -> Strategy:
    kind = StrategyKind(entry.kind)
    if kind == StrategyKind.QUORUM:
        return Strategy(kind, k=entry.param, timeout_us=entry.timeout_us)
    if kind == StrategyKind.SSP:
        return Strategy(kind, staleness=entry.param)
    return Strategy(kind)


def governing(entries: list[TableEntry], round_: int) -> TableEntry:
    """The row that governs ``round_``: the one with the largest ``(from_round, version)`` among
    those whose ``from_round`` is reached; before any (a round older than every row kept), the
    row with the smallest ``from_round`` (ties: the largest version). The one statement of this
    rule: the reference model, the registry's tables and the metrics use it, and the XDP, P4 and
    numba data planes are tested equal to the model."""
    reached = [e for e in entries if e.from_round <= round_]
    if reached:
        return max(reached, key=lambda e: (e.from_round, e.version))
    first = min(e.from_round for e in entries)
    return max((e for e in entries if e.from_round == first), key=lambda e: e.version)


class StrategyTable:
    """A job's versioned strategies: a ring of STRATEGY_VERSIONS entries (version, from_round, rule).

    Each round is governed by the entry with the highest ``from_round`` not above it, so a hot swap
    installs a new version that takes effect from a stated round.
    """

    def __init__(self, strategy: Strategy) -> None:
        self.entries: list[tuple[int, int, Strategy]] = [(0, 0, strategy)]

    def install(self, version: int, from_round: int, strategy: Strategy) -> None:
        """Add a version governing rounds from ``from_round`` on; from round 0 (a job that has run
        no round) it replaces every row."""
        if version <= self.entries[-1][0] or 0 < from_round < self.entries[-1][1]:
            raise StrategyError("strategy versions and their first rounds must increase")
        if from_round == 0:
            self.entries = [(version, 0, strategy)]
            return
        self.entries = (self.entries + [(version, from_round, strategy)])[-STRATEGY_VERSIONS:]

    def governing(self, round_: int) -> tuple[int, Strategy]:
        version = governing(self.table_entries(), round_).version
        return version, next(s for v, _, s in self.entries if v == version)

    def table_entries(self) -> list[TableEntry]:
        return [to_entry(s, v, r) for v, r, s in self.entries]
