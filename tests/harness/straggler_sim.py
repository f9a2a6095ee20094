"""A job played the way the XDP program counts it, for the straggler detector and the policy
(aggd.core.straggler, aggd.core.policy): ``simulate`` gives, per member, each round's chunks arriving
at once after that member's step time; under ``sync`` a round is released when the last member
arrives and every member's lag is its arrival minus the first one's; under ``quorum:k`` a round is
released at the k-th arrival, later arrivals are late (carried: counted, no lag) and their sender
starts its next step on the newest round. ``comm`` seconds of communication a call: a member's next
step starts that long after its call is answered (its round released, or at once by the newest
result when it is late). Snapshots of the cumulative counters are taken every ``poll`` seconds, as
the daemon does. ``const`` makes step times, ``run`` feeds a detector, ``follow`` plays a job whose
strategy follows the policy's decisions."""
from __future__ import annotations

import heapq
import random

from aggd.core.straggler import Detector, DetectorConfig, Snapshot


CHUNKS = 19


def simulate(world: int, step, *, rounds: int, strategy: str = "sync", k: int | None = None, jitter: float = 0.1,
             poll: float = 0.2, seed: int = 0, steps_per_round=None, comm: float = 0.0):
    """Snapshots of a job. ``step(rank, round) -> seconds`` of compute; ``strategy`` "sync" or
    "quorum" (release at the ``k``-th own contribution); ``steps_per_round(rank, round)``: wbsp's
    extra steps (sync only), spread over the time the fast members wait. ``comm``: seconds from a
    call's answer to its sender's next step (the result's way back, and everything else a round
    costs besides the compute), the same for a late call answered by the newest result."""
    rng = random.Random(seed)
    k = world if strategy == "sync" else k
    events = []  # (time, rank, contributions, lag_ns, late, round)
    heap = [(step(i, 0) * (1 + jitter * rng.random()), i) for i in range(world)]
    heapq.heapify(heap)
    target = [0] * world
    open_round, first, members = 0, None, []
    while heap and open_round < rounds:
        a, i = heapq.heappop(heap)
        if target[i] < open_round:  # its round was released without it: late, carried
            events.append((a, i, CHUNKS, 0, CHUNKS, target[i]))
            target[i] = open_round
            heapq.heappush(heap, (a + 0.001 + comm + step(i, open_round) * (1 + jitter * rng.random()), i))
            continue
        first = a if first is None else first
        members.append((a, i))
        if len(members) < k:
            continue
        for at, m in members:  # released at a: everybody in it gets the result and goes on
            n = steps_per_round(m, open_round) if steps_per_round else 1
            for s in range(n):
                t_s = at if n == 1 else first + (a - first) * s / (n - 1)
                # the data plane sums the lag of a call's start only: its step-0 chunk 0
                events.append((t_s, m, CHUNKS, int((t_s - first) * 1e9) if s == 0 else 0, 0, open_round))
            target[m] = open_round + 1
            heapq.heappush(heap, (a + 0.001 + comm + step(m, open_round + 1) * (1 + jitter * rng.random()), m))
        open_round, first, members = open_round + 1, None, []
    events.sort()
    snaps = []
    cum = [[0, 0, 0, None] for _ in range(world)]
    j = 0
    end = events[-1][0]
    t = poll
    while t <= end + poll:
        while j < len(events) and events[j][0] <= t:
            _, i, c, lag, late, rr = events[j]
            cum[i][0] += c
            cum[i][1] += lag
            cum[i][2] += late
            cum[i][3] = rr if cum[i][3] is None else max(cum[i][3], rr)
            j += 1
        snaps.append(Snapshot(t, tuple(x[0] for x in cum), tuple(x[1] for x in cum), tuple(x[2] for x in cum),
                              tuple(x[3] for x in cum)))
        t += poll
    return snaps


def run(snaps, world, **cfg):
    det = Detector(world, DetectorConfig(**cfg))
    return det, [o for o in (det.update(s) for s in snaps) if o is not None]


def const(fast: float, slow: float = 0.0, who: int = 3, start: int = 0, end: int | None = None):
    def step(i, r):
        if i == who and slow and r >= start and (end is None or r < end):
            return fast * slow
        return fast
    return step


def follow(world, step, decide, *, rounds: int, strategy: str = "sync", **kw):
    """A job whose strategy follows decisions: ``decide(snapshot) -> None`` or the strategy's text
    (``sync``, ``quorum:3:50ms``). The job is simulated under its strategy; at a decision it is
    simulated afresh under the new one from the next round on, its clock and counters carried on
    (every member starts that round's step at the decision). ``kw`` goes to ``simulate`` (``seed``
    moves on with each part). Returns the strategies in force as ``[(from_round, strategy)]``."""
    seed = kw.pop("seed", 0)
    base = Snapshot(0.0, (0,) * world, (0,) * world, (0,) * world, (None,) * world)
    r0, t0, part = 0, 0.0, 0
    history = [(0, strategy)]
    while r0 < rounds:
        kind = strategy.split(":")[0]
        k = int(strategy.split(":")[1]) if kind == "quorum" else None
        snaps = simulate(world, lambda i, r, r0=r0: step(i, r + r0), rounds=rounds - r0, strategy=kind, k=k,
                         seed=seed + part, **kw)
        part += 1
        for q in snaps:
            shifted = Snapshot(q.t + t0, tuple(a + b for a, b in zip(q.contributions, base.contributions)),
                               tuple(a + b for a, b in zip(q.lag_ns_sum, base.lag_ns_sum)),
                               tuple(a + b for a, b in zip(q.late, base.late)),
                               tuple(b if r is None else r + r0 for r, b in zip(q.last_round, base.last_round)))
            new = decide(shifted)
            if new is not None and new != strategy:
                strategy, base, t0, r0 = new, shifted, shifted.t, shifted.round + 1
                history.append((r0, strategy))
                break
        else:
            break
    return history
