"""aggd.training.loop.train: replicas that apply the same results stay bit-identical however a
member's results come in, including the race the lab runs hit (tests/faults/test_daemon_restarts.py):
a result arrives during ``must_wait()``'s poll, after ``apply_ready(block=False)`` found the round
unanswered, so the loop would send the next round with the answered one not yet applied.

The exchanges here are in-process fakes of an aggregator that sums every member into every round
(the exact float32 mean of their contributions), so these tests need no network and no daemon."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from aggd_client.protocol import StrategyKind
from aggd_client.strategy import StrategyInfo

from aggd.training.data import load_digits
from aggd.training.loop import TrainConfig, train

SYNC = StrategyInfo(StrategyKind.SYNC, 0, 0)
SSP1 = StrategyInfo(StrategyKind.SSP, 1, 0)


class FakeSync:
    """The aggregator: a round's result is the float32 mean of every member's contribution, there
    once the last member has contributed."""

    def __init__(self, world: int):
        self.world = world
        self.rounds: dict[int, dict[int, np.ndarray]] = {}
        self.results: dict[int, np.ndarray] = {}
        self.cv = threading.Condition()

    def contribute(self, round_: int, rank: int, x: np.ndarray) -> None:
        with self.cv:
            got = self.rounds.setdefault(round_, {})
            got[rank] = np.array(x, np.float32)
            if len(got) == self.world:
                self.results[round_] = (sum(got[r].astype(np.float64) for r in sorted(got)) /
                                        self.world).astype(np.float32)
                self.cv.notify_all()

    def wait(self, round_: int, timeout: float = 30.0) -> np.ndarray:
        with self.cv:
            if not self.cv.wait_for(lambda: round_ in self.results, timeout):
                raise TimeoutError(f"round {round_} not complete")
            return self.results[round_]


class Handle:
    def __init__(self, member: "Member", round_: int):
        self.member, self.round, self.strategy = member, round_, member.strategy
        self.n_contrib = np.array([member.agg.world])
        self.seen = False

    def done(self) -> bool:
        # a racy member learns of a result only in must_wait()'s poll (or by waiting)
        if not self.member.racy and self.round in self.member.agg.results:
            self.seen = True
        return self.seen

    def wait(self, timeout=None):
        self.seen = True
        return self.member.agg.wait(self.round)


class Member:
    """One member's exchange: ``racy``, a result that has come in is noticed by must_wait()
    first (the client's poll there receives it), as happened in the lab."""

    def __init__(self, agg: FakeSync, rank: int, racy: bool, strategy: StrategyInfo = SYNC):
        self.agg, self.rank, self.racy, self.strategy = agg, rank, racy, strategy
        self.round = 0
        self.handles: list[Handle] = []
        self.races = 0

    def allreduce_async(self, x: np.ndarray, op: str = "mean") -> Handle:
        assert op == "mean"
        h = Handle(self, self.round)
        self.agg.contribute(self.round, self.rank, x)
        self.round += 1
        self.handles.append(h)
        return h

    def must_wait(self) -> bool:
        waiting = [h for h in self.handles if h.round not in self.agg.results]
        for h in self.handles:
            if not h.seen and h.round in self.agg.results:
                h.seen = True      # received by this poll
                self.races += 1
        self.handles = waiting
        return len(waiting) >= self.strategy.max_outstanding


#: lr decays over the second half (a step then is no longer a float32 value times a power of
#: two), and the last round is a resync round (the model is the mean model plus the mean step)
CFG = TrainConfig(rounds=60, lr=0.5, lr_final=0.1, batch=16, hidden=16, compute_s=0.0, eval_every=1000,
                  resync_every=20)


def _run(racy: list[bool], cfg: TrainConfig = CFG, strategy: StrategyInfo = SYNC
         ) -> tuple[list[dict], list[Member]]:
    data = load_digits(seed=0)
    agg = FakeSync(len(racy))
    members = [Member(agg, r, racy[r], strategy) for r in range(len(racy))]
    out: list[dict | BaseException | None] = [None] * len(racy)

    def one(rank: int) -> None:
        try:
            # a racy member is the slower one: the others' contributions are in when it sends, so
            # its round is complete at once and must_wait() is the first to see it
            sleep = (lambda s: time.sleep(0.001)) if racy[rank] else (lambda s: None)
            out[rank] = train(members[rank], data, rank, len(racy), cfg, sleep=sleep)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(len(racy))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r, o in enumerate(out):
        if not isinstance(o, dict):
            raise AssertionError(f"member {r} did not finish: {o!r}")
    return out, members


def test_replicas_stay_identical_when_a_result_comes_in_during_must_wait():
    summaries, members = _run([False, True])
    assert members[1].races > 10, "the racy member never raced: the test tests nothing"
    assert [s["rounds"] for s in summaries] == [CFG.rounds] * 2
    assert summaries[0]["params_sha"] == summaries[1]["params_sha"], (
        f"replicas differ after {members[1].races} results seen first by must_wait()")


def test_a_result_seen_by_must_wait_is_applied_before_the_next_step():
    """Under sync every step starts from the model of every result so far: a member that sees a
    result in must_wait()'s poll trains exactly as one that sees it in done()."""
    calm, _ = _run([False])
    racy, members = _run([True])
    assert members[0].races > 10
    assert racy[0]["params_sha"] == calm[0]["params_sha"]


@pytest.mark.parametrize("racy", [[False, False], [True, False], [True, True]])
def test_sync_replicas_are_bit_identical(racy):
    summaries, _ = _run(racy)
    assert len({s["params_sha"] for s in summaries}) == 1


def test_ssp_replicas_end_identical_with_two_steps_outstanding():
    """ssp:1 sums every member into every round too, and a member keeps two rounds outstanding:
    once the last is answered, its unanswered steps are exactly none (not a float64 residue of
    adding and taking away the same steps), so the replicas end bit-identical."""
    summaries, _ = _run([False, False], strategy=SSP1)
    assert len({s["params_sha"] for s in summaries}) == 1
