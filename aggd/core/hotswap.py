"""Hot swap of a job's strategy on running data planes: the one swap path (the daemon's ``strategy
set``, the policy, ``aggctl bench swap`` and the tests all go through ``swap``).

The new version takes effect from a round no member has reached: ``from_round`` defaults to the
highest round the data plane has seen plus a margin, and the data plane is asked again after the
write. A member that raced past ``from_round`` in between would have opened a round of the new
version under the old one, so that is reported as an error rather than ignored. A job that has run
no round yet takes the new version from round 0, and it replaces every row of the table (none
has governed a round), so setting strategies before a job starts never fills the table.
"""
from __future__ import annotations

from typing import Callable

from aggd_client.protocol import STRATEGY_VERSIONS

from aggd.core.strategy import Strategy, StrategyError, StrategyTable

#: Rounds between the highest one seen and the first under a new version: covers members that
#: are ahead (ssp/async keep up to 3 rounds open) plus the time the write takes.
SWAP_MARGIN = 8
#: Rounds a member may trail the highest round seen (a slot keeps 4 rounds).
MAX_TRAIL = 4


class SwapRaced(StrategyError):
    """A member reached the new version's first round while it was being installed."""


class RoundPast(StrategyError):
    """The round asked for has been reached already."""


class TableFull(StrategyError):
    """Every version slot is taken and the oldest may still govern open rounds: retry later."""


def next_from_round(max_round: int | None, table: StrategyTable, margin: int = SWAP_MARGIN) -> int:
    """The first round a new version may govern: 0 before any round (it replaces the table)."""
    if max_round is None:
        return 0
    return max(table.entries[-1][1] + 1, max_round + margin)


def plan(table: StrategyTable, seen: int | None, from_round: int | None = None,
         margin: int = SWAP_MARGIN) -> int:
    """The first round of a new version of ``table`` when the job has reached round ``seen``
    (None: no round yet): ``from_round``, checked, or the default. Raises RoundPast or TableFull."""
    if from_round is None:
        from_round = next_from_round(seen, table, margin)
    elif seen is not None and from_round <= seen:
        raise RoundPast(f"round {from_round} is already past (the job has reached round {seen})")
    if len(table.entries) == STRATEGY_VERSIONS and from_round > 0:
        # installing drops the oldest entry: only once no round it governs can still be open
        retiring_until = table.entries[1][1]
        if seen is None or seen - MAX_TRAIL < retiring_until:
            raise TableFull(f"the strategy table is full and version {table.entries[0][0]} may still "
                            f"govern open rounds (until round {retiring_until}); try again later")
    return from_round


def swap(table: StrategyTable, strategy: Strategy, world: int, *, seen: Callable[[], int | None],
         install: Callable[[int, int], None], from_round: int | None = None,
         margin: int = SWAP_MARGIN) -> tuple[int, int]:
    """The one hot swap: install ``strategy`` as the next version of ``table``. ``seen()`` is the
    highest round the job's data planes have seen (None: none yet); ``install(version,
    from_round)`` writes the new version everywhere it must go (the table, the registry, the data
    planes), raising, with nothing changed, if it cannot. After the write the rounds are read again:
    a member that reached ``from_round`` meanwhile ran it under the old version, which is reported
    (SwapRaced) rather than ignored. Returns (version, from_round). Raises StrategyError (nothing
    changed) for a strategy that cannot hold, a round already past or a full table."""
    strategy.validate(world)
    from_round = plan(table, seen(), from_round, margin)
    version = table.entries[-1][0] + 1
    install(version, from_round)
    after = seen()
    if after is not None and after >= from_round:
        raise SwapRaced(f"a member reached round {after} while version {version} was installed "
                        f"from round {from_round}: use a larger margin")
    return version, from_round


def swap_on(dp, job: int, table: StrategyTable, strategy: Strategy, world: int,
            from_round: int | None = None, margin: int = SWAP_MARGIN) -> tuple[int, int]:
    """``swap`` on one data plane ``dp`` (``max_round``, ``set_strategy``), ``table`` updated in place."""
    def install(version: int, first: int) -> None:
        new = StrategyTable(table.entries[0][2])
        new.entries = list(table.entries)
        new.install(version, first, strategy)
        dp.set_strategy(job, new.table_entries())
        table.entries = new.entries

    return swap(table, strategy, world, seen=lambda: dp.max_round(job), install=install,
                from_round=from_round, margin=margin)
