"""Straggler detection from the data plane's per-member counters. Pure logic, no I/O.

The XDP program keeps, per member of a job, a few cumulative counters in a per-CPU map
(``XdpDataPlane.member_stats``): ``contributions`` added, ``lag_ns_sum`` (the arrival of each call's start,
its step-0 chunk 0, minus its round's first arrival, summed), ``late`` (contributions that came after their round was
released: carried under ``quorum``), ``last_round`` and ``last_ns``. The kernel does the per-packet
work; the daemon reads the counters every few hundred milliseconds and hands the snapshots to a
:class:`Detector`, which turns the differences between successive snapshots into, per member:

* ``lag_ms``: how late it starts its rounds: the arrival of its first chunk (chunk 0, step 0)
  after the round's first, per round (EWMA over intervals). The data plane sums only that chunk's
  lag: a late member's other chunks follow the others' answers, which wait for it, so they come in
  step, and a mean over every contribution watered the lag down by the chunks a call (a 3x slow
  member of a job with 30 chunks a call looked 1.1x slow);
* ``slowdown``: how much longer its steps take than the median member's (1.0 = even; EWMA). Two
  views of the same thing, whichever the strategy in force lets the data plane see:

  - *lag*: under a barrier (``sync``, ``ssp``, ``wbsp``) everybody advances at the slowest member's
    pace, and the slow member's extra step time shows as lag. With round period ``P`` (interval /
    rounds the job advanced) and ``x`` its lag above the median member's, a member whose steps take
    ``S`` while the others take ``S - x = P - x`` is ``P / (P - x)`` times slower;
  - *rate*: where nobody waits for it (``quorum``, ``async``, and the extra steps of ``wbsp``'s fast
    members) a slow member simply contributes less often: ``median contributions / its own`` (one
    round's worth of contributions is forgiven: a snapshot may fall between members' sends). With
    ``n`` rounds an interval that reads a member ``R`` times slower as about ``n R / (n + R)``, low
    at few rounds an interval: the policy judges a return from a quorum on the counters over many
    rounds (``aggd.core.policy``).

  The larger of the two counts. An even job stays near 1 under every strategy;
* ``wait_s``: cumulative time it spent waiting for others at the barrier (Serene's waiting time):
  per round, the largest on-time lag of the job minus its own;
* ``late``, ``contributions``, ``last_round``: the counters themselves;
* ``flagged``: its slowdown is at least ``slow_factor``.

An interval is used only once it holds enough evidence (the job advanced ``min_rounds`` rounds and
the median member made ``min_contributions`` contributions); until then snapshots accumulate, so
the polling period does not matter. Counters that go backwards (a job re-created, maps reset)
restart the detector.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Mapping, Sequence


@dataclass(frozen=True)
class DetectorConfig:
    slow_factor: float = 1.5        #: flag a member whose steps take this many times the median's
    alpha: float = 0.4              #: EWMA weight of the newest interval
    min_lag_ms: float = 1.0         #: lag differences below this are noise (scheduling, network)
    min_rounds: int = 4             #: an interval must span this many rounds of the job ...
    min_contributions: int = 4      #: ... and this many contributions of the median member
    max_slowdown: float = 100.0     #: estimates are capped here (a member that stopped altogether)

    def __post_init__(self):
        if not self.slow_factor > 1.0:
            raise ValueError(f"slow_factor must be above 1, not {self.slow_factor}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], not {self.alpha}")
        if self.min_lag_ms < 0 or self.min_rounds < 1 or self.min_contributions < 1:
            raise ValueError("min_lag_ms must be >= 0, min_rounds and min_contributions >= 1")
        if not self.max_slowdown > self.slow_factor:
            raise ValueError("max_slowdown must be above slow_factor")


@dataclass(frozen=True)
class Snapshot:
    """What the data plane says at time ``t`` (seconds, any monotonic clock)."""
    t: float
    contributions: tuple[int, ...]
    lag_ns_sum: tuple[int, ...]
    late: tuple[int, ...]
    last_round: tuple[int | None, ...]

    @classmethod
    def from_rows(cls, t: float, rows: Sequence[Mapping]) -> "Snapshot":
        """From ``XdpDataPlane.member_stats`` rows (one dict per rank, in rank order)."""
        return cls(float(t), tuple(int(r["contributions"]) for r in rows),
                   tuple(int(r["lag_ns_sum"]) for r in rows), tuple(int(r["late"]) for r in rows),
                   tuple(None if r.get("last_round") is None else int(r["last_round"]) for r in rows))

    @property
    def round(self) -> int | None:
        known = [r for r in self.last_round if r is not None]
        return max(known) if known else None


@dataclass(frozen=True)
class WorkerState:
    rank: int
    lag_ms: float | None = None
    slowdown: float = 1.0
    wait_s: float = 0.0
    contributions: int = 0
    late: int = 0
    last_round: int | None = None
    flagged: bool = False
    gone: bool = False              #: declared gone (dead, removed, quarantined): rounds do not wait for it

    def to_json(self) -> dict:
        return {"rank": self.rank, "lag_ms": None if self.lag_ms is None else round(self.lag_ms, 3),
                "slowdown": round(self.slowdown, 3), "wait_s": round(self.wait_s, 3),
                "contributions": self.contributions, "late": self.late, "last_round": self.last_round,
                "straggler": self.flagged}


@dataclass(frozen=True)
class Observation:
    """One detector output: the state after an interval ``[t0, t]`` in which the job went from
    round ``round - rounds`` to ``round``."""
    t: float
    t0: float
    round: int
    rounds: int
    period_ms: float
    workers: tuple[WorkerState, ...]

    @property
    def stragglers(self) -> tuple[int, ...]:
        return tuple(w.rank for w in self.workers if w.flagged)

    @property
    def world(self) -> int:
        return len(self.workers)

    def to_json(self) -> dict:
        return {"t": self.t, "round": self.round, "rounds": self.rounds, "period_ms": round(self.period_ms, 3),
                "stragglers": list(self.stragglers), "workers": [w.to_json() for w in self.workers]}


@dataclass
class Detector:
    """Feed it snapshots of one job with :meth:`update`; it returns an :class:`Observation` whenever
    an interval with enough evidence closes (None otherwise)."""
    world: int
    config: DetectorConfig = field(default_factory=DetectorConfig)

    def __post_init__(self):
        if self.world < 1:
            raise ValueError(f"world must be at least 1, not {self.world}")
        self.reset()

    def reset(self) -> None:
        self._base: Snapshot | None = None
        self._state = [WorkerState(r) for r in range(self.world)]
        self.last: Observation | None = None
        self.intervals = 0

    @property
    def workers(self) -> tuple[WorkerState, ...]:
        return tuple(self._state)

    def update_rows(self, t: float, rows: Sequence[Mapping], absent: int = 0) -> Observation | None:
        return self.update(Snapshot.from_rows(t, rows), absent)

    def update(self, snap: Snapshot, absent: int = 0) -> Observation | None:
        """``absent``: a bitmap of the members declared gone. Rounds do not wait for them, so they
        slow nobody: never flagged, left out of the medians (a dead worker stayed a straggler, and
        the policy switched the job to a quorum for it)."""
        if len(snap.contributions) != self.world:
            raise ValueError(f"snapshot has {len(snap.contributions)} members, the job {self.world}")
        base = self._base
        if base is None:
            self._base = snap
            self._state = [replace(w, contributions=c, late=lt, last_round=lr) for w, c, lt, lr in
                           zip(self._state, snap.contributions, snap.late, snap.last_round)]
            return None
        dc = [a - b for a, b in zip(snap.contributions, base.contributions)]
        dl = [a - b for a, b in zip(snap.lag_ns_sum, base.lag_ns_sum)]
        dlate = [a - b for a, b in zip(snap.late, base.late)]
        if min(dc) < 0 or min(dl) < 0 or min(dlate) < 0:
            self.reset()  # the counters restarted: the job was re-created or the maps reset
            return self.update(snap, absent)
        r0, r1 = base.round, snap.round
        rounds = 0 if r1 is None else r1 - (r0 if r0 is not None else -1)
        cfg = self.config
        present = [i for i in range(self.world) if not absent >> i & 1] or list(range(self.world))
        if rounds < cfg.min_rounds or median(dc[i] for i in present) < cfg.min_contributions or snap.t <= base.t:
            return None  # not enough evidence yet: let the interval grow
        self._base = snap
        self.intervals += 1
        dt = snap.t - base.t
        period = dt / rounds * 1e9  # ns a round
        # lag a round: the data plane sums the lag of the start of each call (a member's chunk 0),
        # what a late member costs the others in each round, however many chunks and calls a step
        lags = [dl[i] / rounds if dc[i] - dlate[i] > 0 else None for i in range(self.world)]
        known = [lags[i] for i in present if lags[i] is not None]
        med_lag = median(known) if known else 0.0
        top_lag = max(known) if known else 0.0
        med_c = median(dc[i] for i in present)
        per_round = med_c / rounds  # contributions a member makes in one round (chunks, steps)
        floor = cfg.min_lag_ms * 1e6
        a = cfg.alpha
        out = []
        for i, w in enumerate(self._state):
            raw = 1.0
            if lags[i] is not None:
                excess = lags[i] - med_lag
                if excess >= floor:
                    raw = period / max(period - excess, period / cfg.max_slowdown)
            # Fewer contributions than the median member: slower by that ratio. A snapshot can fall
            # between members' sends of one round, so one round's worth of difference is forgiven.
            if dc[i] + per_round < med_c:
                raw = max(raw, med_c / (dc[i] + per_round))
            raw = min(max(raw, 1.0), cfg.max_slowdown)
            slowdown = raw if self.intervals == 1 else a * raw + (1 - a) * w.slowdown
            lag_ms = w.lag_ms
            if lags[i] is not None:
                lag_ms = lags[i] / 1e6 if lag_ms is None else a * lags[i] / 1e6 + (1 - a) * lag_ms
            wait = w.wait_s
            if lags[i] is not None:
                wait += rounds * max(0.0, top_lag - lags[i]) / 1e9
            if absent >> i & 1:     # whatever its average was
                slowdown = 1.0
            out.append(WorkerState(i, lag_ms, slowdown, wait, snap.contributions[i], snap.late[i],
                                   snap.last_round[i], slowdown >= cfg.slow_factor, bool(absent >> i & 1)))
        self._state = out
        self.last = Observation(snap.t, base.t, r1, rounds, period / 1e6, tuple(out))
        return self.last


def slowdown_text(obs: Observation, ranks: Sequence[int]) -> str:
    """``rank 3 (3.1x)`` / ``ranks 2, 3 (2.0x, 3.1x)`` for log lines and reasons."""
    by = {w.rank: w for w in obs.workers}
    if not ranks:
        return "no rank"
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(str(r) for r in ranks)} " \
           f"({', '.join(f'{by[r].slowdown:.1f}x' for r in ranks)})"


def finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x
