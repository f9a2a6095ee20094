"""Strategy table entries of the P4 ``strategy`` table, and how a change is written.

Strategy rows (:class:`aggd.core.strategy.TableEntry`) become entries matching (job exact, round
range): one entry per distinct ``from_round``, covering ``[from_round, next from_round - 1]``, the
first one from round 0 (the reference model's fallback). A change is written so that every
intermediate state maps each round either as before or as after it (new entries at a higher
priority first, then the old ones removed, then the new ones moved down): docs/p4.md, "Hot swap".
Pure logic, no I/O.
"""
from __future__ import annotations

from typing import Iterable

from aggd.core.strategy import TableEntry
from aggd.dataplane.p4 import P4Error

U32_MAX = (1 << 32) - 1
#: Priorities of strategy entries: settled entries and those of a change in progress.
PRIO_SETTLED, PRIO_NEW = 1, 2

Segment = tuple[int, int, TableEntry]    #: (first round, last round, the row that governs them)


def strategy_segments(entries: Iterable[TableEntry]) -> list[Segment]:
    """Non-overlapping round ranges that govern every round as ``aggd.core.strategy.governing`` does: the
    row with the largest (from_round, version) not above the round, and below every row the row
    with the smallest from_round (largest version among equals)."""
    best: dict[int, TableEntry] = {}
    for e in entries:
        if e.from_round not in best or e.version > best[e.from_round].version:
            best[e.from_round] = e
    starts = sorted(best)
    if not starts:
        raise P4Error("a strategy table needs at least one row")
    segs = []
    for i, start in enumerate(starts):
        lo = 0 if i == 0 else start
        hi = starts[i + 1] - 1 if i + 1 < len(starts) else U32_MAX
        segs.append((lo, hi, best[start]))
    return segs


def strategy_plan(old: Iterable[Segment], new: Iterable[Segment]) -> list[list[tuple[str, Segment, int]]]:
    """Write batches (each a list of (INSERT|DELETE, segment, priority)) turning the settled entries
    ``old`` into ``new``. After each batch every round maps to its old or its new row, and a round
    whose row does not change keeps it throughout:
    1. the new segments that are not already there, at priority 2 (they win where they overlap);
    2. the old segments that are not kept, removed;
    3. the new segments moved down to priority 1 (inserted, then the priority-2 copies removed).
    """
    old, new = set(old), list(new)
    added = [s for s in new if s not in old]
    batches = [[("INSERT", s, PRIO_NEW) for s in added],
               [("DELETE", s, PRIO_SETTLED) for s in sorted(old - set(new), key=lambda s: s[0])],
               [("INSERT", s, PRIO_SETTLED) for s in added],
               [("DELETE", s, PRIO_NEW) for s in added]]
    return [b for b in batches if b]
