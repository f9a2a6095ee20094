"""Hot swaps between every ordered pair of strategies while 4 real workers train through the real
daemon: the run must finish with the accuracy of an undisturbed run, within a point.

The swaps follow an Eulerian circuit of the complete directed graph on the five strategies, so one
run of 21 strategies takes each of the 20 ordered pairs once (``ssp:2 -> wbsp`` among them, which
killed every worker with an overflow two rounds after the swap)."""
from __future__ import annotations

import pytest

from aggd.training.labtrain import RunParams, run

pytestmark = pytest.mark.root

STRATEGIES = ("sync", "quorum:3", "ssp:2", "wbsp", "async")
EVERY = 15          #: rounds between swaps (each new version starts 8 rounds after it is set)
ROUNDS = 20 * EVERY + 60

#: the last worker 2x slower: under ssp the others run ahead, under wbsp they push local steps
SCENARIO = "slow2x"


#: evaluations (every 5 rounds, at the end of training with the learning rate decayed) averaged
SETTLED = 4


def settled(res) -> float:
    return sum(acc for _, acc in res.curve[-SETTLED:]) / len(res.curve[-SETTLED:])


def circuit(nodes=STRATEGIES) -> list[str]:
    """Every ordered pair of ``nodes`` once, as one walk from nodes[0] back to it (Hierholzer)."""
    out = {a: [b for b in nodes if b != a] for a in nodes}
    stack, walk = [nodes[0]], []
    while stack:
        if out[stack[-1]]:
            stack.append(out[stack[-1]].pop(0))
        else:
            walk.append(stack.pop())
    return walk[::-1]


def test_the_circuit_takes_every_ordered_pair_once():
    walk = circuit()
    pairs = list(zip(walk, walk[1:]))
    assert len(pairs) == len(set(pairs)) == 20 and ("ssp:2", "wbsp") in pairs


def test_every_ordered_pair_of_strategies_swapped_under_training(lab_daemon):
    lab, d = lab_daemon(4)
    params = RunParams(rounds=ROUNDS, compute_ms=8.0, target=0.9, timeout_s=240)
    undisturbed = run(lab, d, "sync", SCENARIO, params, tag="-base")

    walk, job, applied = circuit()[1:], {}, []

    def swap(rank, rec):
        next_at = 20 + EVERY * len(applied)
        if rank == 0 and job and walk[len(applied):] and rec.get("round", -1) >= next_at:
            text = walk[len(applied)]
            shown = d.call("strategy.set", job=job["name"], strategy=text)
            applied.append((text, shown["versions"][-1]["from_round"]))

    res = run(lab, d, "sync", SCENARIO, params, on_job=job.update, on_record=swap, tag="-swaps")
    assert [t for t, _ in applied] == walk, applied
    seen = [s for _, s in res.strategies_seen]
    assert len(seen) >= 15, seen                       # rank 0 saw most strategies in force
    assert len(res.workers) == 4 and all(w["drained"] is True and w["rounds"] >= ROUNDS for w in res.workers), \
        res.workers
    # the trained accuracy: rank 0's last SETTLED evaluations averaged (one evaluation varies by about
    # half a point between runs of the same training, undisturbed ones included)
    got, base = settled(res), settled(undisturbed)
    assert got >= base - 0.01, (got, base, res.final_accuracy, undisturbed.final_accuracy)
