"""Every strategy, and hot swaps between them, with 4 real workers in a lab and the XDP aggregator.

Workers send integer-valued gradients (exact after quantisation), so sums are compared exactly. An
observer in a fifth namespace records every release multicast to the job's group.
"""
from __future__ import annotations

import random
import threading
import time

import pytest

from aggd.core import strategy as strat
from aggd.core.hotswap import swap_on
from aggd.lab.runner import LabJob, StrategyRun, xdp_aggregator
from aggd_client.protocol import Flag, StrategyKind

pytestmark = pytest.mark.root
WORLD, OBSERVER, STRAGGLER = 4, 4, 3


def run(make_lab, text, *, steps, delay, slow=None, jitter=0.0, during=None, slow_steps="", loss=0.0,
        sizes=None, give_up_after=30.0, slots=16):
    lab = make_lab(WORLD + 1, loss_percent=loss)
    with xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=list(range(WORLD)), slots=slots)
        dp.install_job(job.config(lab))
        table = strat.StrategyTable(strat.parse(text).validate(WORLD))
        dp.set_strategy(1, table.table_entries())
        r = StrategyRun(lab, job, OBSERVER, steps=steps, delay=delay, slow=slow, jitter=jitter,
                        slow_steps=slow_steps, sizes=sizes, give_up_after=give_up_after).start()
        extra = during(dp, table, r) if during else None
        records, releases, errors = r.finish(timeout=600)
        stats = dp.job_stats(1)
        stats.pending = dp.pending_sum(1)
    assert not errors, errors
    finals = {rank: recs[-1] for rank, recs in records.items()}
    assert all(f.get("final") for f in finals.values()), finals
    handles = {rank: recs[:-1] for rank, recs in records.items()}
    return handles, finals, releases, stats, extra


def total_sent(finals):
    return sum(f["sent_sum"] for f in finals.values())


def test_quorum_releases_without_the_straggler_and_keeps_its_gradient(make_lab):
    # slow in a middle phase: afterwards every member is even again, so rounds holding carried
    # gradients are released too and the sums can be compared exactly
    handles, finals, releases, stats, _ = run(make_lab, "quorum:3:300ms", steps=16, delay=0.02,
                                              slow={STRAGGLER: 4.0}, slow_steps="2:8")
    without = [r for r in releases if not r["contributors"] >> STRAGGLER & 1]
    assert without, "no round was released without the straggler"
    # The straggler's gradients are not lost: each lands in a later round, either carried into it
    # (flag CARRIED) or, once its client has caught up, as its own contribution to that round.
    assert any(r["flags"] & Flag.CARRIED or r["contributors"] >> STRAGGLER & 1 for r in releases)
    assert all(r["n_contrib"] >= 1 for r in releases)
    # nothing lost: released, or still held by a round nobody was left to complete
    assert abs(sum(rel["sum"] for rel in releases) + stats.pending - total_sent(finals)) < 1e-6


def test_ssp_lets_a_fast_worker_run_two_rounds_ahead_and_no_further(make_lab):
    handles, finals, releases, stats, _ = run(make_lab, "ssp:2", steps=12, delay=0.02, slow={STRAGGLER: 4.0})
    fast = [finals[r]["max_outstanding"] for r in range(WORLD) if r != STRAGGLER]
    assert max(fast) == 3, fast                       # rounds r, r+1, r+2 outstanding: two ahead
    assert all(rel["n_contrib"] == WORLD for rel in releases)  # every round still sums every member
    assert abs(sum(rel["sum"] for rel in releases) - total_sent(finals)) < 1e-6


def test_async_answers_at_once_with_the_running_sum(make_lab):
    handles, finals, releases, stats, _ = run(make_lab, "async", steps=10, delay=0.02, slow={STRAGGLER: 4.0})
    fast = [h for r in range(WORLD) if r != STRAGGLER for h in handles[r]]
    partial = [h for h in fast if min(h["n_contrib"]) < WORLD]
    assert partial, "no fast worker got a running sum before the round was complete"
    assert min(h["seconds"] for h in partial) < 0.02 * 4  # answered before the straggler computed
    assert stats.counters["partials"] > 0
    assert abs(sum(rel["sum"] for rel in releases) - total_sent(finals)) < 1e-6


def test_wbsp_releases_on_the_slowest_and_counts_extra_steps(make_lab):
    handles, finals, releases, stats, _ = run(make_lab, "wbsp", steps=12, delay=0.02, slow={STRAGGLER: 3.0})
    assert any(rel["n_contrib"] > WORLD for rel in releases), "fast workers' extra steps were not counted"
    assert all(rel["contributors"] == 0b1111 for rel in releases)  # released only with the slowest
    assert abs(sum(rel["sum"] for rel in releases) - total_sent(finals)) < 1e-6
    for r in range(WORLD):
        for h in handles[r]:
            assert h["n_contrib"] == [rel["n_contrib"] for rel in releases if rel["round"] == h["round"]]


@pytest.mark.parametrize("text,sizes", [("ssp:2", "300,3000"), ("async", "300")])
def test_a_lost_result_is_kept_while_the_others_run_ahead(make_lab, text, sizes):
    """5% loss both ways: a member that lost a result re-reads it while the others run up to two
    rounds ahead of it. The aggregator keeps that round's bank until every member sent the slot a
    round RESULT_WINDOW later (before, the others' new rounds took it, the re-read was dropped
    `stale` and the member gave up: 'rounds 0, 20: 2 of 4 chunks answered'). ssp with tensors of
    300 and 3000 values in turn (2 and 12 chunks on 16 slots); async with one size from round 0
    (its round 1 once overtook round 0 in a slot: the client now answers a round that sent a chunk
    index for the first time before it starts the next)."""
    handles, finals, releases, stats, _ = run(make_lab, text, steps=60, delay=0.004, slow={STRAGGLER: 2.0},
                                              jitter=0.5, loss=5.0, sizes=sizes, give_up_after=15.0)
    assert stats.counters["retransmits"] > 0 and stats.counters["rereads"] > 0
    rounds = {}
    for r in range(WORLD):
        assert [h["round"] for h in handles[r]] == list(range(60)), r     # every round answered, in order
        for h in handles[r]:
            rounds.setdefault(h["round"], set()).add(h["sum"] if text == "ssp:2" else None)
    if text == "ssp:2":     # every member got the same sum of every member's gradient, every round
        assert all(len(v) == 1 for v in rounds.values())
        assert abs(sum(next(iter(v)) for v in rounds.values()) - total_sent(finals)) < 1e-6



@pytest.mark.parametrize("text,sizes", [("ssp:2", "300,5000"), ("async", "300,5000")])
def test_rounds_in_parallel_with_more_chunks_than_slots_under_loss(make_lab, text, sizes):
    """12 chunks on 4 slots (three chunk indices a slot), 5% loss both ways, rounds in parallel. A
    member whose copies of (R, c + 4) were lost, or were on their way, sent its round R + 1 of slot c
    (the slot's next key) and that one opened first: (R, c + 4) was late, carried, never released,
    and the job stopped at that chunk. Now a member sends a slot's key of a later round only once
    its key of another chunk index before it in that slot is answered (docs/protocol.md, "What
    clients do")."""
    handles, finals, releases, stats, _ = run(make_lab, text, steps=40, delay=0.004, slow={STRAGGLER: 2.0},
                                              jitter=0.5, loss=5.0, sizes=sizes, give_up_after=15.0, slots=4)
    assert stats.counters["retransmits"] > 0
    rounds = {}
    for r in range(WORLD):
        assert [h["round"] for h in handles[r]] == list(range(40)), r     # every round answered, in order
        for h in handles[r]:
            rounds.setdefault(h["round"], set()).add(h["sum"])
    if text == "ssp:2":     # every member got the same sum of every member's gradient, every round
        assert all(len(v) == 1 for v in rounds.values())
        assert abs(sum(next(iter(v)) for v in rounds.values()) - total_sent(finals)) < 1e-6



@pytest.mark.parametrize("sizes", ["5000", "300,5000"])
def test_quorum_with_more_chunks_than_slots_under_loss(make_lab, sizes):
    """quorum:3 with a straggler, 20 chunks on 4 slots (and tensors of 2 and 20 chunks in turn), 5%
    loss both ways. Each slot serves five chunk indices a round, more than its banks: a round's
    results take one another's banks within the round, so a member that lost one, or the straggler
    late for it, found none left to be answered with (members gave up at the job's end: "19 of 20
    chunks"; with two sizes a straggler was answered with another tensor's round). A quorum round
    of such slots is now kept until every member holds it (docs/protocol.md, rule 3)."""
    handles, finals, releases, stats, _ = run(make_lab, "quorum:3:200ms", steps=40, delay=0.004,
                                              slow={STRAGGLER: 2.0}, jitter=0.5, loss=5.0, sizes=sizes,
                                              give_up_after=15.0, slots=4)
    assert stats.counters["retransmits"] > 0
    for r in range(WORLD):
        assert [h["round"] for h in handles[r]] == list(range(40)), r     # every call answered, by its round
    # nothing counted twice: what was released or is still held is at most what was sent (a quorum
    # drops late values it cannot carry, and never adds a retransmission whose round is gone)
    assert sum(rel["sum"] for rel in releases) + stats.pending <= total_sent(finals) + 1e-6


SEQUENCE = ["quorum:3:200ms", "ssp:2", "async", "wbsp", "sync"]


def test_hot_swap_300_rounds_nothing_lost_nothing_twice(make_lab):
    rng = random.Random(5)
    swaps = []

    def during(dp, table, run_):
        # random moments, measured in rounds so the test does not depend on the machine's speed
        moments = sorted(rng.sample(range(10, 230, 20), len(SEQUENCE)))
        moments = [m + rng.randrange(0, 15) for m in moments]

        def swapper():
            for text, moment in zip(SEQUENCE, moments):
                while run_.running() and (dp.max_round(1) or 0) < moment:
                    time.sleep(0.002)
                while run_.running():
                    try:
                        version, first = swap_on(dp, 1, table, strat.parse(text), WORLD)
                    except strat.StrategyError as exc:               # table full: retry shortly
                        assert "table is full" in str(exc), exc
                        time.sleep(0.01)
                        continue
                    swaps.append((version, first, text))
                    break
        t = threading.Thread(target=swapper)
        t.start()
        return t

    handles, finals, releases, stats, thread = run(make_lab, "sync", steps=300, delay=0.002, jitter=2.0,
                                                   during=during)
    thread.join()
    assert len(swaps) == len(SEQUENCE), swaps      # every swap happened while the workers ran
    kinds = {0: StrategyKind.SYNC, **{v: strat.parse(t).kind for v, _, t in swaps}}
    # every round is governed by exactly one strategy: one version per round, the one the table says
    versions: dict[int, set] = {}
    for rel in releases:
        versions.setdefault(rel["round"], set()).add(rel["version"])
        assert rel["kind"] == kinds[rel["version"]]
    assert all(len(v) == 1 for v in versions.values()), {r: v for r, v in versions.items() if len(v) > 1}
    table = [(0, 0)] + [(v, f) for v, f, _ in swaps]
    for rnd, (v,) in versions.items():
        assert v == max(ver for ver, first in table if first <= rnd), (rnd, v, swaps)
    # nothing lost, nothing twice: everything sent was released exactly once (or is still held
    # by a round its members had no reason to complete)
    assert abs(sum(rel["sum"] for rel in releases) + stats.pending - total_sent(finals)) < 1e-6
