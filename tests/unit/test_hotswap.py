"""aggd.core.hotswap's planning: the first round of a new version, a table that is full while its
oldest row may govern open rounds, and a job that has run no round (each version replaces the
table, so it never fills)."""
from __future__ import annotations

import pytest

from aggd.core import hotswap
from aggd.core.strategy import StrategyTable, parse


def table(*rows) -> StrategyTable:
    t = StrategyTable(parse("sync"))
    for version, first, text in rows:
        t.install(version, first, parse(text))
    return t


def test_a_running_job_swaps_after_the_margin_and_a_full_table_waits():
    t = table((1, 10, "quorum:3"), (2, 20, "ssp:1"), (3, 30, "sync"))
    assert hotswap.plan(t, 100) == 100 + hotswap.SWAP_MARGIN
    assert hotswap.plan(table(), 5, from_round=40) == 40
    with pytest.raises(hotswap.RoundPast):
        hotswap.plan(table(), 5, from_round=5)
    with pytest.raises(hotswap.TableFull):      # version 0 may govern rounds up to 10 still open
        hotswap.plan(t, 12)


def test_before_the_first_round_each_version_replaces_the_table():
    t = table()
    for version, text in enumerate(("sync", "sync", "sync", "quorum:2", "wbsp", "async"), start=1):
        v, first = hotswap.swap(t, parse(text), 4, seen=lambda: None,
                                install=lambda v, r: t.install(v, r, parse(text)))
        assert (v, first) == (version, 0)
        assert t.entries == [(version, 0, parse(text))]
    # once rounds run, versions are added again
    v, first = hotswap.swap(t, parse("sync"), 4, seen=lambda: 3, install=lambda v, r: t.install(v, r, parse("sync")))
    assert [e[0] for e in t.entries] == [6, 7] and first == 3 + hotswap.SWAP_MARGIN
