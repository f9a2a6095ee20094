"""Prometheus metrics of the aggregator, read from the data planes when Prometheus scrapes.

Nothing here runs per packet: the XDP program and the user-space path keep their counters as they
always do (BPF maps, the model's arrays), and :class:`AggdCollector` turns a snapshot of them into
metric families on each scrape, like client_python's process collector reads ``/proc``. What it
reads comes from an injected *reader* (:class:`ServiceReader` over the daemon's ``Service``; a
fake in the unit tests) with these methods:

``jobs()``                       -> [JobInfo]: the registry's jobs
``job_stats(job, path)``         -> JobStats(counters, drops) of ``path`` ("kernel" or "user");
                                    ``job=None``: drops of packets that never reached a job
``rounds(job)``                  -> highest round either path has seen, or None
``strategy(job, round)``         -> StrategyState: the table entry governing ``round``
``slot_usage(jobs)``             -> SlotUsage: kernel budget and slots, busy slots per job and path
``worker_lag(job)``              -> [WorkerLag] per rank: the data plane's per-member counters and
                                    the straggler detector's view; [] when neither is there
``policy(job)``                  -> PolicyState: decisions of the dynamic-hybrid policy so far
``health()``                     -> Health: XDP attached, user-space path alive, its error counts

Names follow the Prometheus conventions: one ``aggd_`` prefix, base units (seconds, bytes),
``_total`` on counters, ``_info`` for the strategy in force. Labels are only ``aggd_job`` (the
job's name: ``job`` itself is the label Prometheus gives every scraped series, and an exported
``job`` would be renamed ``exported_job``), ``rank``, ``reason``, ``strategy`` (a strategy kind)
and ``path`` (``kernel`` or ``user``; with ``[dataplane] kind = "p4"``, ``kernel`` is the switch).
Cardinality is bounded: jobs beyond ``max_jobs`` (by id) and
ranks beyond ``max_ranks`` are left out and counted in ``aggd_metrics_truncated_total``.
docs/observability.md lists every metric.

Events with no data-plane counter come from what the daemon records anyway: hot swaps are the
registry's strategy versions (they survive restarts with state.json), policy decisions the policy
runner's record of the switches it made (``aggd.daemon.policy_runner.PolicyRunner.decisions``, with their times:
the collector counts the new ones at each scrape), per-rank lag and waiting time the straggler
detector's (``aggd.core.straggler``). Releases are counted per job by the data planes; the collector
attributes each scrape's new ones to the strategy in force.

:func:`serve` starts the HTTP endpoint (``[metrics] address``, inside ``dataplane.netns`` when
that is set, like the daemon's other sockets) with this collector and the process collector.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from aggd_client.protocol import Counter, DropReason, StrategyKind

from aggd.core.addresses import host_port
from aggd.dataplane import JobStats

log = logging.getLogger(__name__)

PATHS = ("kernel", "user")
KINDS = tuple(k.name.lower() for k in StrategyKind)
#: Every label any aggd metric carries (tests check this).
LABELS = ("aggd_job", "rank", "reason", "strategy", "path")
DEFAULT_MAX_JOBS = 64
DEFAULT_MAX_RANKS = 64
#: Kernel slots read per scrape to count busy ones (a slot read is ~7 us); beyond, busy counts are
#: not exported for the remaining jobs.
SLOT_SCAN_LIMIT = 16384

#: Data-plane counter (docs/protocol.md, "Counters") -> (metric name without _total, help).
#: ``released`` is exported by strategy (aggd_results_released_total) and ``to_userspace`` for the
#: kernel only; tests fail when the protocol gains a counter that is not here.
COUNTER_METRICS: dict[str, tuple[str, str]] = {
    "rx_packets": ("aggd_packets", "aggd messages received by the path for the job (the kernel counts "
                                   "every packet of the job that reaches the XDP program, those it "
                                   "hands to user space included)"),
    "rx_bytes": ("aggd_bytes", "Bytes of aggd messages received by the path for the job"),
    "elements": ("aggd_elements", "int32 elements aggregated by the path"),
    "contributions": ("aggd_contributions", "Contributions added to a sum by the path"),
    "released": ("aggd_results_released", "Results released by the path, by the strategy in force when "
                                          "the daemon saw them released"),
    "rereads": ("aggd_rereads", "Results sent again to a worker that lost them (re-reads and late "
                                "contributions answered)"),
    "retransmits": ("aggd_retransmits", "Contributions received with the retransmit flag"),
    "overflows": ("aggd_sum_overflows", "Results sent flagged overflow: a sum outside int32"),
    "to_userspace": ("aggd_userspace_handoffs", "Packets the XDP program handed to the user-space "
                                                "(overflow) path: slots beyond the job's kernel slots, "
                                                "or another packet size"),
    "carried": ("aggd_carried_contributions", "Late contributions carried into a later round"),
    "timeouts": ("aggd_quorum_timeouts", "Rounds released by a quorum deadline"),
    "partials": ("aggd_partial_results", "Running sums sent before release (async)"),
}
PER_PATH_ONLY_KERNEL = {"to_userspace"}


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


# -- the collector -----------------------------------------------------------------------------------

def _limit(value: int | Callable[[], int]) -> int:
    return int(value() if callable(value) else value)


class AggdCollector:
    """A prometheus_client collector over a reader (see the module docstring)."""

    def __init__(self, reader: Reader, *, max_jobs: int | Callable[[], int] = DEFAULT_MAX_JOBS,
                 max_ranks: int | Callable[[], int] = DEFAULT_MAX_RANKS):
        self.reader = reader
        self.max_jobs, self.max_ranks = max_jobs, max_ranks
        # (job id, name, created_at) -> [time of the newest decision counted, {kind: decisions}]
        self._decisions: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self._truncated = {"jobs": 0, "ranks": 0}
        self._errors = 0
        # (job id, name, created_at, path) -> [last released total, {kind: released attributed}]
        self._released: dict[tuple, list] = {}

    def describe(self):
        return []  # collected on scrape only, never at registration

    def collect(self):
        with self._lock:  # concurrent scrapes would attribute the same releases twice
            return self._collect()

    def _collect(self) -> list:
        t0 = time.perf_counter()
        r = self.reader
        J, P, JP = ["aggd_job"], ["path"], ["aggd_job", "path"]
        fam: dict[str, object] = {}

        def counter(name, doc, labels):
            fam[name] = CounterMetricFamily(name, doc, labels=labels)
            return fam[name]

        def gauge(name, doc, labels=()):
            fam[name] = GaugeMetricFamily(name, doc, labels=list(labels))
            return fam[name]

        per_counter = {c: counter(name, doc, JP + (["strategy"] if c == "released" else []))
                       for c, (name, doc) in COUNTER_METRICS.items() if c not in PER_PATH_ONLY_KERNEL}
        handoffs = counter(*COUNTER_METRICS["to_userspace"], J)
        drops = counter("aggd_drops", "Packets dropped, by path and reason (docs/protocol.md); packets "
                                      "that never reached a job have no aggd_job", JP + ["reason"])
        info = InfoMetricFamily("aggd_job_strategy", "The strategy governing the job's current round",
                                labels=J)
        fam["aggd_job_strategy"] = info
        version = gauge("aggd_job_strategy_version", "Version of the strategy governing the current round", J)
        param = gauge("aggd_job_strategy_param", "Parameter of the strategy in force: quorum size, ssp "
                                                 "staleness (0 for the others)", J)
        timeout = gauge("aggd_job_strategy_timeout_seconds", "Quorum deadline of the strategy in force "
                                                             "(0 for the others)", J)
        swaps = counter("aggd_strategy_swaps", "Hot swaps: strategy versions installed after the first", J)
        decisions = counter("aggd_policy_decisions", "Decisions of the dynamic-hybrid policy, by the "
                                                     "strategy it chose", J + ["strategy"])
        rounds = counter("aggd_job_rounds", "Rounds begun: the highest round seen by either path, plus one", J)
        world = gauge("aggd_job_members", "Members (world size) of the job", J)
        joined = gauge("aggd_job_members_joined", "Members that have joined", J)
        slots = gauge("aggd_job_slots", "Slots of the job's pool served by each path", JP)
        busy = gauge("aggd_job_slots_busy", "Slots of the job holding an open round now", JP)
        switched = gauge("aggd_job_policy_switched", "1 while the dynamic-hybrid policy's strategy is in "
                                                     "force instead of the job's own", J)
        stragglers = gauge("aggd_job_stragglers", "Ranks the straggler detector flags now", J)
        W = ["aggd_job", "rank"]
        contrib = counter("aggd_worker_contributions", "Contributions of the rank added to a sum", W)
        lag_sum = counter("aggd_worker_arrival_lag_seconds", "Sum over the rank's contributions of (its arrival "
                                                         "- its round's first arrival); with "
                                                         "aggd_worker_contributions_total, the mean lag", W)
        late = counter("aggd_worker_late_contributions", "Contributions of the rank that arrived after "
                                                         "their round was released", W)
        behind = gauge("aggd_worker_rounds_behind", "The job's newest round minus the rank's newest", W)
        blocking = gauge("aggd_worker_blocking_seconds", "How long the ranks ahead of this one have been "
                                                         "waiting for it under a barrier (0: nobody waits)", W)
        lag = gauge("aggd_worker_lag_seconds", "How late the rank's contributions arrive after the first of "
                                               "their round (the straggler detector's moving average)", W)
        slowdown = gauge("aggd_worker_slowdown_ratio", "How many times longer the rank's steps take than the "
                                                       "median member's (1: even)", W)
        straggler = gauge("aggd_worker_straggler", "1 while the straggler detector flags the rank", W)
        wait = counter("aggd_worker_wait_seconds", "Cumulative time the rank waited for others at the "
                                                   "barrier (since the detector started on the job)", W)

        jobs = sorted(r.jobs(), key=lambda j: j.id)
        max_jobs, max_ranks = _limit(self.max_jobs), _limit(self.max_ranks)
        shown = jobs[:max(0, max_jobs)]
        self._truncated["jobs"] += len(jobs) - len(shown)
        gauge("aggd_jobs", "Jobs in the registry (exported or not)").add_metric([], len(jobs))

        for path in PATHS:
            for reason, n in self._stats(None, path).drops.items():
                drops.add_metric(["", path, reason], n)

        keep = set()
        for job in shown:
            try:
                top = r.rounds(job)
                st = r.strategy(job, top)
                stats = {path: self._stats(job, path) for path in PATHS}
                ranks = sorted(r.worker_lag(job), key=lambda w: w.rank)
                pol = r.policy(job)
            except Exception:  # a job deleted mid-scrape, or a bug: the rest of the scrape goes on
                self._errors += 1
                log.debug("metrics: reading job %s failed", job.name, exc_info=True)
                continue
            name = job.name
            for path in PATHS:
                s = stats[path]
                for c, m in per_counter.items():
                    if c not in s.counters:
                        continue
                    if c == "released":
                        for kind, n in self._attribute(job, path, s.counters.get(c, 0), st.kind).items():
                            m.add_metric([name, path, kind], n)
                    else:
                        m.add_metric([name, path], s.counters.get(c, 0))
                for reason, n in s.drops.items():
                    drops.add_metric([name, path, reason], n)
            if "to_userspace" in stats["kernel"].counters:
                handoffs.add_metric([name], stats["kernel"].counters["to_userspace"])
            info.add_metric([name], {"strategy": st.kind})
            version.add_metric([name], st.version)
            param.add_metric([name], st.param)
            timeout.add_metric([name], st.timeout_us / 1e6)
            swaps.add_metric([name], st.latest_version)
            for kind, n in self._count_decisions(job, pol).items():
                decisions.add_metric([name, kind], n)
            switched.add_metric([name], int(pol.switched))
            stragglers.add_metric([name], pol.stragglers)
            rounds.add_metric([name], 0 if top is None else top + 1)
            world.add_metric([name], job.world)
            joined.add_metric([name], job.joined)
            slots.add_metric([name, "kernel"], job.kernel_slots)
            slots.add_metric([name, "user"], job.userspace_slots)
            shown_ranks = [w for w in ranks if w.rank < max_ranks]
            self._truncated["ranks"] += len(ranks) - len(shown_ranks)
            for w in shown_ranks:
                lbl = [name, str(w.rank)]
                contrib.add_metric(lbl, w.contributions)
                lag_sum.add_metric(lbl, w.lag_seconds_sum)
                late.add_metric(lbl, w.late)
                behind.add_metric(lbl, w.rounds_behind)
                blocking.add_metric(lbl, w.blocking_seconds)
                for fam_, v in ((lag, w.lag_seconds), (slowdown, w.slowdown), (wait, w.wait_seconds),
                                (straggler, None if w.straggler is None else int(w.straggler))):
                    if v is not None:  # the detector has not judged the rank yet
                        fam_.add_metric(lbl, v)
            keep.add(job.id)
        for d in (self._released, self._decisions):
            for key in [k for k in d if k[0] not in keep]:
                del d[key]

        usage = r.slot_usage([j for j in shown if j.id in keep])
        by_id = {j.id: j.name for j in shown}
        for job_id, paths in usage.busy.items():
            if job_id in by_id:
                for path, n in paths.items():
                    busy.add_metric([by_id[job_id], path], n)
        if usage.slot_bytes is not None:
            gauge("aggd_kernel_memory_budget_bytes", "Kernel memory budget for slots ([dataplane] kernel_memory)"
                  ).add_metric([], usage.budget_bytes)
            gauge("aggd_kernel_memory_bytes", "Kernel memory the loaded slot array takes (allocated at load)"
                  ).add_metric([], usage.array_slots * usage.slot_bytes)
            gauge("aggd_kernel_memory_allocated_bytes", "Kernel slot memory allocated to jobs"
                  ).add_metric([], usage.allocated * usage.slot_bytes)
            gauge("aggd_kernel_slot_bytes", "Bytes of one kernel slot").add_metric([], usage.slot_bytes)
        gauge("aggd_kernel_slots_capacity", "Kernel slots the budget holds").add_metric([], usage.capacity)
        gauge("aggd_kernel_slots_allocated", "Kernel slots allocated to jobs").add_metric([], usage.allocated)

        h = r.health()
        if h.xdp_attached is not None:
            gauge("aggd_xdp_attached", "1 if the XDP program is attached").add_metric([], int(h.xdp_attached))
        if h.p4_connected is not None:
            gauge("aggd_p4_connected", "1 while the daemon holds its P4Runtime session with the switch "
                                       "(dataplane.kind = \"p4\")").add_metric([], int(h.p4_connected))
        gauge("aggd_userspace_path_up", "1 if the user-space path is serving").add_metric([], int(h.userspace_alive))
        counter("aggd_userspace_errors", "Packets whose handling in user space raised", []
                ).add_metric([], h.userspace_errors)
        counter("aggd_userspace_send_errors", "Sends of the user-space path that failed", []
                ).add_metric([], h.userspace_send_errors)

        trunc = counter("aggd_metrics_truncated", "Jobs (reason=jobs) or ranks (reason=ranks) left out "
                                                  "of a scrape by [metrics] max_jobs / max_ranks, summed "
                                                  "over scrapes", ["reason"])
        for reason, n in self._truncated.items():
            trunc.add_metric([reason], n)
        counter("aggd_metrics_collect_errors", "Jobs that could not be read during a scrape", []
                ).add_metric([], self._errors)
        gauge("aggd_metrics_collect_duration_seconds", "Time the last scrape took to read the data planes"
              ).add_metric([], time.perf_counter() - t0)
        return list(fam.values())

    def _stats(self, job: JobInfo | None, path: str) -> JobStats:
        s = self.reader.job_stats(job, path)
        # every reason always present: a series that appears only with its first drop would make
        # increase() miss that drop
        # (counters a data plane does not keep stay absent: a P4 target without them)
        return JobStats({c.name.lower(): int(s.counters.get(c.name.lower(), 0)) for c in Counter
                         if c.name.lower() not in s.untracked},
                        {d.name.lower(): int(s.drops.get(d.name.lower(), 0)) for d in DropReason}, s.untracked)

    def _count_decisions(self, job: JobInfo, pol: PolicyState) -> dict[str, int]:
        """Decisions by the strategy chosen: the service remembers its last few, with their times;
        those newer than the newest already counted are counted."""
        key = (job.id, job.name, job.created_at)
        rec = self._decisions.setdefault(key, [float("-inf"), dict.fromkeys(KINDS, 0)])
        for t, kind in sorted(pol.decisions):
            if t > rec[0]:
                rec[1][kind] = rec[1].get(kind, 0) + 1
                rec[0] = t
        return rec[1]

    def _attribute(self, job: JobInfo, path: str, total: int, kind: str) -> dict[str, int]:
        """Releases by strategy kind: the data planes count releases per job, so what was released
        between two scrapes goes to the strategy in force at the later one (exact except around a
        swap). A counter that went down (job re-created, counters reset) starts over."""
        key = (job.id, job.name, job.created_at, path)
        rec = self._released.get(key)
        if rec is None or total < rec[0]:
            rec = self._released[key] = [total, dict.fromkeys(KINDS, 0)]
            rec[1][kind] = total
        else:
            rec[1][kind] = rec[1].get(kind, 0) + total - rec[0]
            rec[0] = total
        return rec[1]


# -- per-rank views from the per-member counters -----------------------------------------------------

def blocks_after(state: StrategyState) -> int | None:
    """Rounds a rank may fall behind before the strategy makes the others wait for it: 0 under a
    barrier (sync, wbsp), s under ssp:s, None where nobody waits (quorum, async)."""
    return {"sync": 0, "wbsp": 0, "ssp": state.param}.get(state.kind)


def worker_rows(rows: list[dict], now_ns: int, blocks: int | None, detected: dict | None = None) -> list[WorkerLag]:
    """WorkerLag per rank from ``member_stats`` rows ({rank, contributions, lag_ns_sum, late,
    last_round (None: none yet), last_ns (the data plane's clock, as ``now_ns``)}) and the
    detector's view of each rank (rank -> object with lag_ms, slowdown, flagged, wait_s).

    A rank is *blocking* when the strategy makes the ranks ahead of it wait for it (it is more than
    ``blocks`` rounds behind the newest); it has blocked since the oldest of their last
    contributions. The detector judges intervals in which the job advanced, so it cannot see a
    rank that stopped altogether: this can."""
    tops = [r["last_round"] for r in rows if r["last_round"] is not None]
    top = max(tops) if tops else None
    detected = detected or {}
    out = []
    for r in rows:
        mine = r["last_round"]
        behind = 0 if top is None else top - (mine if mine is not None else -1)
        blocked = 0.0
        if blocks is not None and behind > blocks:
            waiting = [x["last_ns"] for x in rows if x["last_round"] is not None
                       and (mine is None or x["last_round"] > mine)]
            blocked = max(0.0, (now_ns - min(waiting)) / 1e9)
        d = detected.get(r["rank"])
        lag_ms = getattr(d, "lag_ms", None)
        out.append(WorkerLag(int(r["rank"]), int(r["contributions"]), int(r["lag_ns_sum"]) / 1e9,
                             int(r.get("late", 0)), behind, blocked,
                             None if lag_ms is None else lag_ms / 1e3,
                             getattr(d, "slowdown", None), getattr(d, "flagged", None),
                             getattr(d, "wait_s", None)))
    return out


def merge_rows(a: dict, b: dict) -> dict:
    """One member's counters from the kernel and from the user-space path."""
    rounds = [x for x in (a.get("last_round"), b.get("last_round")) if x is not None]
    return {"rank": a["rank"], "contributions": a["contributions"] + b["contributions"],
            "lag_ns_sum": a["lag_ns_sum"] + b["lag_ns_sum"], "late": a["late"] + b["late"],
            "last_round": max(rounds) if rounds else None, "last_ns": max(a["last_ns"], b["last_ns"])}


# -- the daemon's reader ----------------------------------------------------------------------------

class ServiceReader:
    """Reads a running ``aggd.daemon.service.Service``: its registry (a snapshot under the service's lock),
    the XDP maps and the user-space path's counters."""

    def __init__(self, service, *, clock: Callable[[], int] = time.monotonic_ns):
        self.service = service
        self.clock = clock  # bpf_ktime_get_ns is CLOCK_MONOTONIC too
        self._detected: dict[int, dict] = {}
        self._policy: dict[int, PolicyState] = {}

    def jobs(self) -> list[JobInfo]:
        svc = self.service
        with svc.lock:  # the registry, and what the policy thread knows, as of one moment
            jobs = [JobInfo(j.id, j.name, j.world, len(j.members), j.slots, j.kernel_slots, j.kernel_base,
                            tuple(tuple(e) for e in j.strategies), j.created_at)
                    for j in svc.registry.list()]
            self._detected, self._policy = {}, {}
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
            pol = runner.policies.get(j.id)
            self._policy[j.id] = PolicyState(
                bool(pol is not None and pol.switched), len(det.last.stragglers) if judged else 0,
                tuple((float(d["time"]), str(d["strategy"]).split(":", 1)[0])
                      for d in runner.decisions.get(j.id, ())))

    def job_stats(self, job: JobInfo | None, path: str) -> JobStats:
        svc = self.service
        if path == "kernel":
            return svc.dp.job_stats(None if job is None else job.id)
        if job is None:
            return JobStats({}, svc.us.stats()["no_job"])
        if not svc.us.has_job(job.id):
            return JobStats({}, {})
        return JobStats({c.name.lower(): int(v) for c, v in zip(Counter, svc.us.counters(job.id))},
                        {d.name.lower(): int(v) for d, v in zip(DropReason, svc.us.drops(job.id))})

    def rounds(self, job: JobInfo) -> int | None:
        svc = self.service
        tops = [svc.dp.max_round(job.id)] if job.kernel_slots and hasattr(svc.dp, "max_round") else []
        if svc.us.has_job(job.id):
            tops.append(svc.us.job_rounds(job.id)[0])
        tops = [t for t in tops if t is not None]
        return max(tops) if tops else None

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
                n = svc.dp.open_slots(job.kernel_base, job.kernel_slots)
                if n is not None:  # None: the data plane cannot tell (a Tofino)
                    counts["kernel"] = n
            elif not job.kernel_slots:
                counts["kernel"] = 0
            user = self._user_busy(job)
            if user is not None:
                counts["user"] = user
            busy[job.id] = counts
        if svc.config.dataplane.kind == "p4":  # switch slots: no kernel memory to speak of
            return SlotUsage(None, None, budget_slots, svc.kernel_capacity, allocated, busy)
        return SlotUsage(svc.config.dataplane.kernel_memory, svc.slot_bytes, budget_slots,
                         max(1, svc.kernel_capacity), allocated, busy)

    def _user_busy(self, job: JobInfo) -> int | None:
        us = self.service.us
        if hasattr(us, "busy_slots"):
            return us.busy_slots(job.id)
        try:  # until the user-space path says it itself
            with us._lock:
                state = us._route[job.id].jobs[job.id]
                return sum(any(int(b.state) == 1 for b in s.banks) for s in state.slots)
        except (AttributeError, KeyError):
            return None

    def worker_lag(self, job: JobInfo) -> list[WorkerLag]:
        svc = self.service
        rows = None
        if job.kernel_slots and hasattr(svc.dp, "member_stats"):
            rows = svc.dp.member_stats(job.id, job.world)
        us_rows = getattr(svc.us, "member_stats", None)  # the user-space path, once it keeps them
        if us_rows is not None and job.userspace_slots and svc.us.has_job(job.id):
            extra = us_rows(job.id, job.world)
            rows = extra if rows is None else [merge_rows(a, b) for a, b in zip(rows, extra)]
        if rows is None:
            return []
        top = max((r["last_round"] for r in rows if r["last_round"] is not None), default=None)
        return worker_rows(rows, self.clock(), blocks_after(strategy_in_force(job, top)),
                           self._detected.get(job.id))

    def policy(self, job: JobInfo) -> PolicyState:
        return self._policy.get(job.id, PolicyState())

    def health(self) -> Health:
        svc = self.service
        us = svc.us
        attached = bool(svc.dp is not None and svc.dp.attached)
        if svc.config.dataplane.kind == "p4":
            return Health(None, bool(us is not None and us.is_alive()),
                          us.errors if us is not None else 0, us.send_errors if us is not None else 0,
                          p4_connected=attached)
        return Health(attached,
                      bool(us is not None and us.is_alive()),
                      us.errors if us is not None else 0, us.send_errors if us is not None else 0)


# -- the endpoint ---------------------------------------------------------------------------------------

class MetricsServer:
    def __init__(self, httpd, thread, address: tuple[str, int]):
        self.httpd, self.thread, self.address = httpd, thread, address

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def registry_for(reader: Reader, **limits):
    """A CollectorRegistry with the aggd collector (and the process collector)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    registry.register(AggdCollector(reader, **limits))
    return registry


def serve(service) -> MetricsServer:
    """Start the endpoint of a started ``Service`` on ``[metrics] address``, in
    ``dataplane.netns`` if set. The limits are read from the service's config at each scrape, so a
    reload applies them."""
    from contextlib import nullcontext

    from prometheus_client import start_http_server

    cfg = service.config
    host, port = host_port(cfg.metrics.address)
    registry = registry_for(ServiceReader(service),
                            max_jobs=lambda: getattr(service.config.metrics, "max_jobs", DEFAULT_MAX_JOBS),
                            max_ranks=lambda: getattr(service.config.metrics, "max_ranks", DEFAULT_MAX_RANKS))
    netns = cfg.dataplane.netns or None
    if netns:
        from aggd.dataplane.netns import in_netns
        where = in_netns(netns)
    else:
        where = nullcontext()
    try:
        with where:  # the listening socket stays in the namespace it was made in
            httpd, thread = start_http_server(port, host, registry)
    except OSError as exc:
        raise OSError(exc.errno, f"metrics.address {cfg.metrics.address}"
                                 f"{' in netns ' + netns if netns else ''}: {exc.strerror}") from None
    thread.name = "aggd-metrics"
    log.info("metrics on http://%s:%d/metrics%s", host, port, f" in netns {netns}" if netns else "")
    return MetricsServer(httpd, thread, (host, port))
