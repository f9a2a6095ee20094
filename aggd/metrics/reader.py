"""What the metrics collector reads, and the reader over the running daemon.

A reader (:class:`Reader`; :class:`ServiceReader` over the daemon's ``Service``, a fake in the unit
tests) answers:

``jobs()``                       -> [JobInfo]: the registry's jobs
``job_stats(job, path)``         -> JobStats(counters, drops) of ``path`` ("kernel" or "user");
                                    ``job=None``: drops of packets that never reached a job
``rounds(job)``                  -> highest round either path has seen, or None
``strategy(job, round)``         -> StrategyState: the table entry governing ``round``
``slot_usage(jobs)``             -> SlotUsage: kernel budget and slots, busy slots per job and path
``worker_lag(job)``              -> [WorkerLag] per rank: the data planes' per-member counters and
                                    the straggler detector's view; [] when neither is there
``policy(job)``                  -> PolicyState: decisions of the dynamic-hybrid policy so far
``health()``                     -> Health: XDP attached, user-space path alive, its error counts

The service's data planes are read only through the ``aggd.dataplane.DataPlane`` interface; events
with no data-plane counter come from what the daemon records anyway: hot swaps are the registry's
strategy versions, policy decisions the policy runner's record (``PolicyRunner.decisions``, with
their times), per-rank lag and waiting time the straggler detector's (``aggd.core.straggler``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from aggd.dataplane import JobStats, holding, max_round, member_rows

log = logging.getLogger(__name__)

#: Kernel slots read per scrape to count busy ones (a slot read is ~7 us); beyond, busy counts are
#: not exported for the remaining jobs.
SLOT_SCAN_LIMIT = 16384


# -- what a reader returns ---------------------------------------------------------------------------

@dataclass(frozen=True)
class JobInfo:
    id: int
    name: str
    world: int
    joined: int = 0
    slots: int = 0
    kernel_slots: int = 0
    kernel_base: int = 0
    #: strategy versions, oldest first: (version, from_round, text), as the registry keeps them
    strategies: tuple[tuple[int, int, str], ...] = ((0, 0, "sync"),)
    created_at: float = 0.0
    gone: tuple[int, ...] = ()    #: ranks declared gone (rounds do not wait for them)
    departures: int = 0           #: members declared gone since the daemon started
    #: a sharded job's newest shard report (aggd.daemon.shard_reports), None if none came
    shards: dict | None = None

    @property
    def userspace_slots(self) -> int:
        return self.slots - self.kernel_slots


@dataclass(frozen=True)
class StrategyState:
    kind: str             #: "sync", "quorum", ...
    param: int = 0        #: quorum k, ssp staleness
    timeout_us: int = 0   #: quorum deadline
    version: int = 0      #: the version governing the current round
    latest_version: int = 0  #: the newest version installed (one per hot swap)


@dataclass(frozen=True)
class SlotUsage:
    budget_bytes: int | None      #: None: not kernel memory (switch slots, dataplane.kind = "p4")
    slot_bytes: int | None
    capacity: int         #: kernel slots the budget holds
    array_slots: int      #: kernel slots the loaded array holds (allocated at load)
    allocated: int        #: kernel slots allocated to jobs
    #: job id -> {"kernel": n, "user": n} slots holding an open round now
    busy: dict[int, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerLag:
    """One rank of a job. The counters come from the data plane (``member_stats``); ``lag_seconds``,
    ``slowdown``, ``straggler`` and ``wait_seconds`` from the straggler detector (``aggd.core.straggler``),
    None until it has judged an interval."""
    rank: int
    contributions: int = 0
    lag_seconds_sum: float = 0.0  #: sum over its contributions of (arrival - the round's first arrival)
    late: int = 0                 #: contributions that came after their round was released
    rounds_behind: int = 0        #: the job's newest round minus this rank's
    blocking_seconds: float = 0.0 #: how long the ranks ahead have been waiting for it (0: nobody waits)
    lag_seconds: float | None = None
    slowdown: float | None = None
    straggler: bool | None = None
    wait_seconds: float | None = None  #: cumulative time it waited for others at the barrier
    offences: int = 0             #: contributions dropped beyond the job's per-member bound
    score: float | None = None    #: a robust job's member: its Zeno score in the policy's last window


@dataclass(frozen=True)
class PolicyState:
    switched: bool = False        #: the policy's strategy is in force, not the job's own
    stragglers: int = 0           #: ranks the detector flags now
    #: every decision applied so far that the service still remembers: (time, strategy kind)
    decisions: tuple[tuple[float, str], ...] = ()


@dataclass(frozen=True)
class Health:
    xdp_attached: bool | None     #: None: no XDP program (dataplane.kind = "p4")
    userspace_alive: bool
    userspace_errors: int = 0
    userspace_send_errors: int = 0
    p4_connected: bool | None = None   #: the switch's P4Runtime session, with dataplane.kind = "p4"


class Reader(Protocol):
    def jobs(self) -> list[JobInfo]: ...
    def job_stats(self, job: JobInfo | None, path: str) -> JobStats: ...
    def rounds(self, job: JobInfo) -> int | None: ...
    def strategy(self, job: JobInfo, round_: int | None) -> StrategyState: ...
    def slot_usage(self, jobs: list[JobInfo]) -> SlotUsage: ...
    def worker_lag(self, job: JobInfo) -> list[WorkerLag]: ...
    def policy(self, job: JobInfo) -> PolicyState: ...
    def health(self) -> Health: ...


def strategy_in_force(job: JobInfo, round_: int | None) -> StrategyState:
    """The registry's entry governing ``round_`` (the job's newest; None: round 0)."""
    from aggd.core import strategy as strat

    rows = {v: strat.to_entry(strat.parse(t), v, f) for v, f, t in job.strategies}
    e = strat.governing(list(rows.values()), 0 if round_ is None else round_)
    kind = strat.StrategyKind(e.kind).name.lower()
    return StrategyState(kind, e.param, e.timeout_us, e.version, job.strategies[-1][0])


# -- per-rank views from the per-member counters -----------------------------------------------------

def blocks_after(state: StrategyState) -> int | None:
    """Rounds a rank may fall behind before the strategy makes the others wait for it: 0 under a
    barrier (sync, wbsp), s under ssp:s, None where nobody waits (quorum, async)."""
    return {"sync": 0, "wbsp": 0, "ssp": state.param}.get(state.kind)


def worker_rows(rows: list[dict], now_ns: int, blocks: int | None, detected: dict | None = None,
                scores: dict | None = None, gone: tuple[int, ...] = ()) -> list[WorkerLag]:
    """WorkerLag per rank from ``member_stats`` rows ({rank, contributions, lag_ns_sum, late,
    last_round (None: none yet), last_ns (the data plane's clock, as ``now_ns``)}), the
    detector's view of each rank (rank -> object with lag_ms, slowdown, flagged, wait_s) and a
    robust job's scores (rank -> the policy's last window's).

    A rank is *blocking* when the strategy makes the ranks ahead of it wait for it (it is more than
    ``blocks`` rounds behind the newest); it has blocked since the oldest of their last
    contributions. The detector judges intervals in which the job advanced, so it cannot see a
    rank that stopped altogether: this can. A rank declared gone (``gone``) blocks nobody: rounds
    no longer wait for it."""
    tops = [r["last_round"] for r in rows if r["last_round"] is not None]
    top = max(tops) if tops else None
    detected = detected or {}
    out = []
    for r in rows:
        mine = r["last_round"]
        behind = 0 if top is None else top - (mine if mine is not None else -1)
        blocked = 0.0
        if blocks is not None and behind > blocks and r["rank"] not in gone:
            waiting = [x["last_ns"] for x in rows if x["last_round"] is not None
                       and (mine is None or x["last_round"] > mine)]
            blocked = max(0.0, (now_ns - min(waiting)) / 1e9)
        d = detected.get(r["rank"])
        lag_ms = getattr(d, "lag_ms", None)
        out.append(WorkerLag(int(r["rank"]), int(r["contributions"]), int(r["lag_ns_sum"]) / 1e9,
                             int(r.get("late", 0)), behind, blocked,
                             None if lag_ms is None else lag_ms / 1e3,
                             getattr(d, "slowdown", None), getattr(d, "flagged", None),
                             getattr(d, "wait_s", None), int(r.get("offences", 0)),
                             (scores or {}).get(r["rank"])))
    return out


# -- the daemon's reader ----------------------------------------------------------------------------

class ServiceReader:
    """Reads a running ``aggd.daemon.service.Service``: its registry (a snapshot under the service's lock),
    the XDP maps and the user-space path's counters."""

    def __init__(self, service, *, clock: Callable[[], int] = time.monotonic_ns):
        self.service = service
        self.clock = clock  # bpf_ktime_get_ns is CLOCK_MONOTONIC too
        self._detected: dict[int, dict] = {}
        self._policy: dict[int, PolicyState] = {}
        self._scores: dict[int, dict] = {}

    def jobs(self) -> list[JobInfo]:
        svc = self.service
        with svc.lock:  # the registry, and what the policy thread knows, as of one moment
            departures = getattr(svc, "departures", {})
            reports = getattr(svc, "shard_reports", None)
            jobs = [JobInfo(j.id, j.name, j.world, len(j.members), j.slots, j.kernel_slots, j.kernel_base,
                            tuple(tuple(e) for e in j.strategies), j.created_at, tuple(sorted(j.gone)),
                            departures.get(j.id, 0), reports.describe(j.id) if reports is not None else None)
                    for j in svc.registry.list()]
            self._detected, self._policy, self._scores = {}, {}, {}
            runner = getattr(svc, "policy", None)
            if runner is not None:
                try:
                    self._read_policy(runner, jobs)
                except (AttributeError, KeyError, TypeError, ValueError):  # the policy's shape changed
                    log.debug("metrics: cannot read the policy runner", exc_info=True)
        return jobs

    def _read_policy(self, runner, jobs: list[JobInfo]) -> None:
        for j in jobs:
            det = runner.detectors.get(j.id)
            judged = det is not None and det.last is not None
            if judged:
                self._detected[j.id] = {w.rank: w for w in det.workers}
            watch = runner.score_watch(j.id)
            if watch is not None:
                self._scores[j.id] = dict(watch.last)
            pol = runner.policies.get(j.id)
            self._policy[j.id] = PolicyState(
                bool(pol is not None and pol.switched), len(det.last.stragglers) if judged else 0,
                tuple((float(d["time"]), str(d["strategy"]).split(":", 1)[0])
                      for d in runner.decisions.get(j.id, ())))

    def _plane(self, path: str):
        return self.service.dp if path == "kernel" else self.service.us

    def job_stats(self, job: JobInfo | None, path: str) -> JobStats:
        return self._plane(path).job_stats(None if job is None else job.id)

    def rounds(self, job: JobInfo) -> int | None:
        return max_round(holding(self.service.planes, job), job)

    def strategy(self, job: JobInfo, round_: int | None) -> StrategyState:
        return strategy_in_force(job, round_)

    def slot_usage(self, jobs: list[JobInfo]) -> SlotUsage:
        svc = self.service
        with svc.lock:
            budget_slots = svc.registry.limits.kernel_budget
            allocated = svc.registry.kernel_used()
        busy, scanned = {}, 0
        for job in jobs:
            counts = {}
            if job.kernel_slots and scanned + job.kernel_slots <= SLOT_SCAN_LIMIT:
                scanned += job.kernel_slots
                n = svc.dp.open_slots(job.id)
                if n is not None:  # None: the data plane cannot tell (a Tofino)
                    counts["kernel"] = n
            elif not job.kernel_slots:
                counts["kernel"] = 0
            user = svc.us.open_slots(job.id)
            if user is not None:
                counts["user"] = user
            busy[job.id] = counts
        if svc.config.dataplane.kind == "p4":  # switch slots: no kernel memory to speak of
            return SlotUsage(None, None, budget_slots, svc.kernel_capacity, allocated, busy)
        return SlotUsage(svc.config.dataplane.kernel_memory, svc.slot_bytes, budget_slots,
                         max(1, svc.kernel_capacity), allocated, busy)

    def worker_lag(self, job: JobInfo) -> list[WorkerLag]:
        rows = member_rows(holding(self.service.planes, job), job)
        if rows is None:
            return []
        top = max((r["last_round"] for r in rows if r["last_round"] is not None), default=None)
        return worker_rows(rows, self.clock(), blocks_after(strategy_in_force(job, top)),
                           self._detected.get(job.id), self._scores.get(job.id), job.gone)

    def policy(self, job: JobInfo) -> PolicyState:
        return self._policy.get(job.id, PolicyState())

    def health(self) -> Health:
        svc = self.service
        us = svc.us.describe() if svc.us is not None else {"alive": False, "errors": 0, "send_errors": 0}
        attached = bool(svc.dp is not None and svc.dp.attached)
        p4 = svc.config.dataplane.kind == "p4"
        return Health(None if p4 else attached, bool(us["alive"]), us["errors"], us["send_errors"],
                      p4_connected=attached if p4 else None)
