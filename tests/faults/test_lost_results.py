"""Results lost on the way back while the others run ahead: 4 real training workers, one 2x slower,
5% packet loss both ways, every chunk in the daemon's user-space path.

Under ``ssp:2`` and ``async`` members run up to three rounds apart. A member whose result was lost
re-reads it; before, the others' new rounds took that round's bank meanwhile, the re-read was
dropped ``stale`` and the member gave up (``NoAnswerError ... rounds 0, 20: 2 of 4 chunks
answered``). Now a released ``ssp``/``async`` bank is kept until every awaited member is known to
hold its result (docs/protocol.md, rule 3; the XDP path: tests/netns/test_strategies.py)."""
from __future__ import annotations

import pytest

from aggd.training.labtrain import RunParams, run

pytestmark = pytest.mark.root
ROUNDS = 60


@pytest.mark.parametrize("strategy", ["ssp"])   # async: tests/netns/test_strategies.py
def test_every_member_gets_every_result_in_user_space(lab_daemon, strategy):
    lab, d = lab_daemon(4, loss=5.0)
    res = run(lab, d, strategy, "slow2x", RunParams(rounds=ROUNDS, compute_ms=5.0, target=0.8, timeout_s=240,
                                                    eval_every=10),
              kernel_slots=0)
    assert sorted(w["rank"] for w in res.workers) == [0, 1, 2, 3], res.workers
    assert all(w["steps"] == ROUNDS and w["drained"] is True for w in res.workers), res.workers
    assert res.final_accuracy >= 0.8


@pytest.mark.parametrize("strategy", ["ssp", "quorum"])
def test_slots_serving_several_chunk_indices_in_user_space(lab_daemon, strategy):
    """The same with 4 slots for the model's 19 chunks: each slot serves about five chunk indices a
    round, more than its banks, so a round's results take one another's banks within the round.
    A member that lost one, or a quorum's straggler late for its round, still gets it (a slot
    serving several chunk indices keeps its ssp, async and quorum rounds until every member holds
    them: docs/protocol.md, rule 3)."""
    lab, d = lab_daemon(4, loss=5.0)
    rounds = 20     # (the point is that every member makes every step; a loaded CI host is slow here)
    res = run(lab, d, strategy, "slow2x", RunParams(rounds=rounds, compute_ms=5.0, target=0.5, timeout_s=240,
                                                    eval_every=10),
              kernel_slots=0, job_options={"slots": 4})
    assert sorted(w["rank"] for w in res.workers) == [0, 1, 2, 3], res.workers
    assert all(w["steps"] == rounds and w["drained"] is True for w in res.workers), res.workers
    assert res.final_accuracy >= 0.5, res.final_accuracy      # and learns
