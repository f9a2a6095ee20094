"""Tensors of different sizes in one job, as DDP's unequal buckets: chunks sit out rounds.

Real workers in lab namespaces through the real XDP program. ``aggd.lab.worker --interleave``
reduces every size in turn each round and checks each result against the exact sum and the
documented error bound; the strategy runs (``aggd.lab.strategy_worker --sizes``) check that every
gradient sent is released exactly once. Before the ``skip`` header field a chunk that sat out a
round was refused ``busy`` in its next one and the job hung (512, 256, 512 hung on the third call;
buckets of 362 and 2048 values on the fourth).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from aggd.core import strategy as strat
from aggd.lab.runner import LabJob, StrategyRun, run_workers, xdp_aggregator
from aggd_client.protocol import DEFAULT_ELEMENTS, Flag

from tests.harness.lab_runs import assert_all_right

pytestmark = pytest.mark.root
WORLD = 4


def interleaved(lab, dp, job, sizes: str, rounds: int):
    dp.install_job(job.config(lab))
    runs = run_workers(lab, job, timeout=300, extra=["--sizes", sizes, "--interleave", "--rounds", str(rounds),
                                                     "--give-up-after", "20"])
    assert_all_right(runs, rounds * len(sizes.split(",")), dp)
    return dp.job_stats(job.job)


@pytest.mark.parametrize("mode", ["native", "generic"])
def test_512_256_512_and_ddp_buckets(make_lab, mode):
    lab = make_lab(WORLD)
    with xdp_aggregator(lab, mode=mode) as dp:
        job = LabJob(job=1, workers=list(range(WORLD)))
        stats = interleaved(lab, dp, job, "512,256", 3)       # 512, 256, 512, 256, 512, 256
        assert stats.drops["stale"] == 0
        stats = interleaved(lab, dp, job, "362,2048", 4)      # DDP-like buckets
        assert stats.counters["released"] == 4 * (2 + 8)


def test_one_value_shrinking_growing_more_chunks_than_slots(make_lab):
    lab = make_lab(WORLD)
    with xdp_aggregator(lab) as dp:
        # 4 slots: chunk c uses slot c % 4, so chunks of the 5000-value tensor share slots
        job = LabJob(job=1, workers=list(range(WORLD)), slots=4)
        interleaved(lab, dp, job, "1,2048,300,5000,1,700", 2)


SIZES = "362,2048,1,700"
TOTAL = sum(int(s) for s in SIZES.split(","))


@dataclass
class Outcome:
    """A strategy run's: the workers' finals and handles, what the aggregator released and still
    holds."""
    finals: dict
    handles: dict
    releases: list
    pending: float
    stats: object

    @property
    def sent(self) -> float:
        return sum(f["sent_sum"] for f in self.finals.values())


def strategy_run(make_lab, text: str, slots: int, **run) -> Outcome:
    """``WORLD`` training-loop-shaped workers (``StrategyRun`` options ``run``) on one XDP aggregator
    under ``text``; every worker ends without an error."""
    lab = make_lab(WORLD + 1)
    with xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=list(range(WORLD)), slots=slots)
        dp.install_job(job.config(lab))
        dp.set_strategy(1, strat.StrategyTable(strat.parse(text).validate(WORLD)).table_entries())
        records, releases, errors = StrategyRun(lab, job, WORLD, **run).start().finish(timeout=300)
        pending, stats = dp.pending_sum(1), dp.job_stats(1)
    assert not errors, errors
    return Outcome({rank: recs[-1] for rank, recs in records.items()},
                   {rank: recs[:-1] for rank, recs in records.items()}, releases, pending, stats)


@pytest.mark.parametrize("text", ["sync", "ssp:2", "async", "wbsp", "quorum:3:200ms"])
def test_every_strategy_with_unequal_buckets(make_lab, text):
    """Training-loop-shaped workers cycle through four tensor sizes; one is slower for a while. Every
    gradient sent is released exactly once (or is still held by a round nobody had to finish, or,
    under quorum, is counted as dropped: ``uncarried``)."""
    # slow in a middle phase: afterwards the members are even, so every round is released
    out = strategy_run(make_lab, text, 16, steps=20, delay=0.01, slow={WORLD - 1: 3.0}, slow_steps="2:10",
                       sizes=SIZES)
    assert all(f.get("final") for f in out.finals.values()), out.finals
    if text.startswith("quorum"):
        # The straggler's late gradients are carried into its chunks' next rounds, which here
        # hold other tensors: summed (the whole payload), beyond the count of a smaller one
        # (docs/protocol.md, "Tensors of different sizes").
        released = sum(rel["sum_all"] for rel in out.releases)
        assert any(rel["flags"] & Flag.CARRIED for rel in out.releases)
    else:
        released = sum(rel["sum"] for rel in out.releases)
    counters = {k: out.stats.counters.get(k) for k in ("released", "carried", "uncarried", "retransmits")}
    lost = out.sent - released - out.pending
    if counters["uncarried"]:
        # A quorum round full of carries takes no more (rule 4's cap), and with no bank free for a
        # later one the straggler's gradient is answered but dropped, as a quorum may, and counted.
        # Seen on a loaded host, the straggler five rounds behind. Each one is a chunk of at most
        # DEFAULT_ELEMENTS values of |x| <= 1000 (strategy_worker.gradient).
        assert -1e-6 < lost <= counters["uncarried"] * DEFAULT_ELEMENTS * 1000, (lost, counters, out.stats)
    else:
        assert abs(lost) < 1e-6, (released, out.pending, out.sent, counters, out.stats)


@pytest.mark.parametrize("text", ["ssp:2", "async"])
def test_ddp_sized_buckets_on_64_slots(make_lab, text):
    """Buckets of 527 and 218 chunks in turn on 64 slots (several chunk indices a slot), rounds in
    parallel, one worker slower: every gradient released exactly once. (A released round kept for
    re-reads from every later key once outlived its chunk's newer round, and rule 3's order test
    refused the chunk's next round for good: tests/client/test_client_async_userspace.py.)"""
    out = strategy_run(make_lab, text, 64, steps=8, delay=0.005, slow={WORLD - 1: 2.0}, jitter=0.5,
                       sizes="134912,55808")
    assert abs(sum(rel["sum"] for rel in out.releases) + out.pending - out.sent) < 1e-6, (out.pending, out.sent)


def test_a_quorum_straggler_with_small_and_large_tensors_in_shared_slots(make_lab):
    """quorum:3 of 4 on 16 slots, tensors of 1 to 70,001 values in turn (up to 274 chunks: each
    slot serves many chunk indices), the last worker slower: the straggler's late chunks are
    carried into holding banks for their chunks' next rounds, which leaves chunk 0's small rounds
    two banks a slot, each kept until every member holds it. Before members said Flag.ORDERED
    only a round three later proved that, and every member was refused ``busy`` for good."""
    out = strategy_run(make_lab, "quorum:3:50ms", 16, steps=12, delay=0.002, slow={WORLD - 1: 3.0},
                       jitter=0.5, sizes="1,256,257,20003,3,70001")
    assert all(f.get("final") for f in out.finals.values()), out.finals
    # At the end a straggler's late chunk no bank takes is refused until give_up_after (30 s):
    # close() gives it a second, not the 30 s it waited before
    assert max(f["close_seconds"] for f in out.finals.values()) < 10, out.finals
    # a late gradient is carried when a bank is free for it, else dropped (``uncarried``): what
    # is released never exceeds what was sent
    assert sum(rel["sum_all"] for rel in out.releases) + out.pending <= out.sent + 1e-6
    assert out.stats.counters["released"] >= 2 * (1 + 1 + 2 + 79 + 1 + 274), out.stats


def test_a_quorum_straggler_far_behind_is_answered_with_its_own_tensor(make_lab):
    """quorum:3 of 4 on 16 slots, tensors of 300 and 3000 values in turn (2 and 12 chunks, each
    slot serving one chunk index), the last worker 4x slower throughout: it falls more rounds
    behind than a slot has banks. Each of its calls gets its own round's sum. Before, its late
    chunks were answered with the chunk's newest result: chunk 0 is full in both tensors, so the
    other tensor's values passed as its own, and chunk 1's count failed the call. Now a member
    whose calls have had more than one size says ORDERED under quorum, and the aggregator keeps
    its round's result until it holds it (docs/protocol.md, "Tensors of different sizes")."""
    out = strategy_run(make_lab, "quorum:3:300ms", 16, steps=16, delay=0.02, slow={WORLD - 1: 4.0},
                       sizes="300,3000")
    assert all(f.get("final") for f in out.finals.values()), out.finals
    released: dict[int, dict[int, float]] = {}
    for rel in out.releases:      # the group sees each chunk's release once
        released.setdefault(rel["round"], {}).setdefault(rel["chunk"], rel["sum"])
    straggler = out.handles[WORLD - 1]
    assert [h["round"] for h in straggler] == list(range(16)), straggler   # its own calls, in order
    # it fell behind: some round was released without it
    assert any(rel["contributors"] >> (WORLD - 1) & 1 == 0 for rel in out.releases)
    for rank, handles in out.handles.items():
        for h in handles:
            assert h["sum"] == sum(released[h["round"]].values()), (rank, h, released[h["round"]])
