"""The reference model's strategies (docs/protocol.md, "Strategies"): the fixture tables of
tests/fixtures/scenarios.py, and properties over the randomised traffic of tests/fixtures/traffic.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggd.core.model import BANKS, AggregatorModel, BankState, TableEntry, check_table, governing
from aggd.core.strategy import StrategyTable, parse
from aggd_client.protocol import HEADER_SIZE, Counter, DropReason, Flag, MsgType
from tests.fixtures.scenarios import (ASYNC, E, JOB, Q3, QUORUM, SCENARIOS, SSP, SYNC, Scenario,
    Depart, Swap, T0_NS, addr, c, check, entry, job_config, rr, scenario_model)
from tests.fixtures.traffic import (STRATEGY_TEXTS, Traffic, layout_of, swap_table)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    sc = SCENARIOS[name]
    m = scenario_model(sc)
    for i, step in enumerate(sc.steps):
        if isinstance(step, Swap):
            m.set_strategy(JOB, list(step.entries))
            continue
        if isinstance(step, Depart):
            m.set_awaited(JOB, step.awaited)
            continue
        t_us, p, exp = step
        check(m.process(p.build(E), addr(p.rank), T0_NS + t_us * 1000), exp, where=f"step {i}: {p}")
    for counter, value in sc.counters.items():
        assert m.counter(JOB, counter) == value, counter


def test_without_a_clock_nothing_expires():
    m = scenario_model(Scenario((entry("quorum:3:1us"),), ()))
    assert m.process(c(0, 0).build(E), addr(0)).action == "drop"
    assert m.process(rr(0, 0).build(E), addr(0)).reason == DropReason.NOT_READY   # now 0 - t_first 0
    assert m.process(rr(0, 0).build(E), addr(0), now_ns=1000).action == "tx"      # 1 µs later


def test_time_is_unsigned():
    """A clock that moved backwards looks like a huge interval (u64 subtraction), as in C."""
    m = scenario_model(Scenario((entry("quorum:3:1s"),), ()))
    m.process(c(0, 0).build(E), addr(0), now_ns=5000)
    assert m.process(rr(0, 0).build(E), addr(0), now_ns=4999).action == "tx"
    assert m.counter(JOB, "timeouts") == 1


def test_model_only_counters_are_named_in_stats():
    m = scenario_model(SCENARIOS["quorum timeout releases a round with fewer than k on the next packet to the slot"])
    counters = m.stats()["jobs"][JOB]["counters"]
    for name in ("carried", "timeouts", "partials"):
        assert name in counters
    assert len(m.counters(JOB)) == len(Counter)


def test_governing_row():
    rows = [TableEntry(3, 20, SYNC, 0, 0), TableEntry(1, 10, SSP, 1, 0), TableEntry(2, 10, ASYNC, 0, 0)]
    assert governing(rows, 25).version == 3
    assert governing(rows, 15).version == 2          # equal from_round: the larger version
    assert governing(rows, 5).version == 2           # before every row: the oldest from_round
    t = StrategyTable(parse("sync"))
    for v, r in ((1, 10), (2, 20), (3, 30), (4, 40)):
        t.install(v, r, parse("ssp:1"))
    assert [e.version for e in t.table_entries()] == [1, 2, 3, 4]
    assert governing(t.table_entries(), 5) == t.table_entries()[0]


def test_strategy_tables_are_checked():
    m = scenario_model(Scenario((Q3,), ()))
    for bad in ([], [Q3] * 5, [TableEntry(0, 0, 9, 0, 0)], [TableEntry(0, 0, QUORUM, 300, 1)],
                [TableEntry(70000, 0, SYNC, 0, 0)], [TableEntry(0, -1, SYNC, 0, 0)]):
        with pytest.raises(ValueError):
            m.set_strategy(JOB, bad)
    assert m.strategy_table(JOB) == [Q3]
    with pytest.raises(ValueError):
        check_table([TableEntry(0, 0, QUORUM, 3, 2**32)])


def test_release_observer_and_slot_layout():
    sc = SCENARIOS["quorum timeout releases a round with fewer than k on the next packet to the slot"]
    m = scenario_model(sc)
    seen = []
    m.on_release = lambda job, bank, cause: seen.append((job, bank.key, bank.n_contrib, cause))
    for t_us, p, _ in sc.steps:
        m.process(p.build(E), addr(p.rank), T0_NS + t_us * 1000)
    assert seen == [(JOB, (0, 0), 2, "timeout"), (JOB, (1, 0), 3, "timeout")]
    banks = m.jobs[JOB].slots[0].banks
    assert len(banks) == BANKS
    assert [b.state for b in banks] == [BankState.RELEASED, BankState.RELEASED, BankState.OPEN, BankState.EMPTY]


ops_lists = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_lists, shape=st.integers(0, 2**16 - 1),
       swaps=st.lists(st.tuples(st.integers(0, 79), st.sampled_from(STRATEGY_TEXTS), st.integers(0, 2)),
                      max_size=5))
def test_property_conservation_with_swaps(ops, shape, swaps):
    """Over any run, with strategy swaps at round boundaries: every contribution added is in exactly
    one bank's sum (released, or still open), each contribution (rank, round, chunk, step) is added at
    most once, and n_contrib accounts for every one."""
    world = 1 + shape % 4
    slots = 1 + (shape >> 2) % 2
    traffic = Traffic(world=world, slots=slots, chunks=layout_of(shape, 1 + (shape >> 3) % 4), max_chunks=8,
                      window=1 + (shape >> 5) % 3, elements=E, exact=True)
    m = AggregatorModel(E)
    m.add_job(job_config(world, slots, 8))
    table = StrategyTable(parse(STRATEGY_TEXTS[(shape >> 7) % len(STRATEGY_TEXTS)]))
    m.set_strategy(JOB, table.table_entries())
    rows = {e.version: e for e in table.table_entries()}
    releases: list[tuple[np.ndarray, int, int]] = []
    m.on_release = lambda job, bank, cause: releases.append((bank.values.astype(np.int64), bank.n_contrib,
                                                             bank.version))
    added_sum = np.zeros(E, np.int64)
    added: set[tuple] = set()
    n_added = 0
    pending = sorted(swaps)
    for i, op in enumerate(ops):
        while pending and pending[0][0] <= i:
            _, text, ahead = pending.pop(0)
            for e in swap_table(table, len(rows), m, traffic, text, ahead):
                rows[e.version] = e
            m.set_strategy(JOB, table.table_entries())
        sent = traffic.next(op)
        before = m.counter(JOB, "contributions")
        v = m.process(sent.data, sent.src, sent.now_ns)
        if m.counter(JOB, "contributions") > before:
            assert sent.contribution is not None and sent.contribution not in added, (i, sent.contribution)
            added.add(sent.contribution)
            n_added += 1
            added_sum += np.frombuffer(sent.data, "<i4", offset=HEADER_SIZE)
        traffic.observe(sent, v)
        if v.action == "tx" and v.header.type == MsgType.RESULT:
            hdr = v.header
            row = rows[hdr.strategy_version]
            assert (hdr.strategy, hdr.param) == (row.kind, row.param)
    open_banks = [b for s in m.jobs[JOB].slots for b in s.banks if b.state == BankState.OPEN]
    total = sum((vals for vals, _, _ in releases), np.zeros(E, np.int64))
    total += sum((b.values.astype(np.int64) for b in open_banks), np.zeros(E, np.int64))
    assert total.tolist() == added_sum.tolist()
    assert sum(n for _, n, _ in releases) + sum(b.n_contrib for b in open_banks) == n_added
    assert m.counter(JOB, "contributions") == n_added
    assert m.counter(JOB, "released") == len(releases)
    for _, _, version in releases:
        assert version in rows


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_lists, text=st.sampled_from(STRATEGY_TEXTS))
def test_property_every_packet_counted_once(ops, text):
    """Each packet of a known job is one of: a counted drop, a hand-off, an absorbed contribution, or
    one message sent (counted as a release, a re-send or a running sum)."""
    traffic = Traffic(world=4, slots=2, chunks=4, max_chunks=8, window=2, elements=E)
    m = AggregatorModel(E)
    m.add_job(job_config(4, 2, 8))
    m.set_strategy(JOB, [entry(text)])
    for op in ops:
        sent = traffic.next(op)
        before, drops_before = m.stats()["jobs"][JOB]["counters"], m.drops(JOB).sum()
        v = m.process(sent.data, sent.src, sent.now_ns)
        traffic.observe(sent, v)
        after = m.stats()["jobs"][JOB]["counters"]
        d = {k: after[k] - before[k] for k in after}
        if v.job != JOB:
            assert d["rx_packets"] == 0
            continue
        assert d["rx_packets"] == 1
        drops = m.drops(JOB).sum() - drops_before
        if v.reason is not None:
            assert drops == 1 and d["contributions"] == 0
        elif v.action == "pass":
            assert d["to_userspace"] == 1 and drops == 0
        elif v.action == "drop":
            assert d["contributions"] == 1 and drops == 0                    # absorbed
        elif v.dest == "group":            # a release, or the announcement of a deadline release
            assert d["rereads"] == d["partials"] == 0 and not v.header.flags & Flag.REREAD
        elif v.header.flags & Flag.REREAD:
            assert d["rereads"] == 1 and d["partials"] == 0
        else:
            assert d["partials"] == 1 and d["contributions"] == 1
