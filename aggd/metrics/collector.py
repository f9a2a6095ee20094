"""The Prometheus collector: on each scrape, a reader's snapshot of the data planes turned into the
families of ``aggd.metrics.families``.

Nothing here runs per packet: the XDP program and the user-space path keep their counters as they
always do (BPF maps, the model's arrays), and :class:`AggdCollector` reads them when Prometheus
scrapes, like client_python's process collector reads ``/proc``. What it reads comes from an
injected reader (``aggd.metrics.reader``). Cardinality is bounded: jobs beyond ``max_jobs`` (by
id) and ranks beyond ``max_ranks`` are left out and counted in ``aggd_metrics_truncated_total``.

Releases are counted per job by the data planes; the collector attributes each scrape's new ones
to the strategy in force. Policy decisions come with their times: each scrape counts the new ones.
docs/observability.md lists every metric.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from aggd_client.protocol import Counter, DropReason, StrategyKind

from aggd.dataplane import JobStats
from aggd.metrics import families as F
from aggd.metrics.reader import JobInfo, PolicyState, Reader

log = logging.getLogger(__name__)

KINDS = tuple(k.name.lower() for k in StrategyKind)
DEFAULT_MAX_JOBS = 64
DEFAULT_MAX_RANKS = 64


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
        fam: dict[str, object] = {}

        def out(family: F.Family):
            """This scrape's family of ``family`` (made at first use: a family a data plane
            cannot fill, the switch's XDP state say, is left out)."""
            made = fam.get(family.name)
            if made is None:
                made = fam[family.name] = family.new()
            return made

        per_job = (F.DROPS, F.JOB_STRATEGY, F.JOB_STRATEGY_VERSION, F.JOB_STRATEGY_PARAM, F.JOB_STRATEGY_TIMEOUT,
                   F.STRATEGY_SWAPS, F.POLICY_DECISIONS, F.JOB_ROUNDS, F.JOB_MEMBERS, F.JOB_MEMBERS_JOINED,
                   F.JOB_SLOTS, F.JOB_SLOTS_BUSY, F.JOB_POLICY_SWITCHED, F.JOB_STRAGGLERS, F.JOB_DEPARTURES,
                   F.WORKER_GONE, F.SHARD_MAP_VERSION, F.SHARD_INDEX, F.SHARD_SHARE, F.SHARD_RATE, F.SHARD_MAP_CHANGES,
                   F.WORKER_CONTRIBUTIONS, F.WORKER_ARRIVAL_LAG, F.WORKER_LATE, F.WORKER_OFFENCES,
                   F.WORKER_ROUNDS_BEHIND,
                   F.WORKER_BLOCKING, F.WORKER_LAG, F.WORKER_SLOWDOWN, F.WORKER_STRAGGLER, F.WORKER_WAIT)
        for family in (*F.COUNTERS.values(), *per_job):  # present (if empty) in every scrape
            out(family)

        jobs = sorted(r.jobs(), key=lambda j: j.id)
        max_jobs, max_ranks = _limit(self.max_jobs), _limit(self.max_ranks)
        shown = jobs[:max(0, max_jobs)]
        self._truncated["jobs"] += len(jobs) - len(shown)
        out(F.JOBS).add_metric([], len(jobs))

        for path in F.PATHS:
            for reason, n in self._stats(None, path).drops.items():
                out(F.DROPS).add_metric(["", path, reason], n)

        keep = set()
        for job in shown:
            try:
                top = r.rounds(job)
                st = r.strategy(job, top)
                stats = {path: self._stats(job, path) for path in F.PATHS}
                ranks = sorted(r.worker_lag(job), key=lambda w: w.rank)
                pol = r.policy(job)
            except Exception:  # a job deleted mid-scrape, or a bug: the rest of the scrape goes on
                self._errors += 1
                log.debug("metrics: reading job %s failed", job.name, exc_info=True)
                continue
            name = job.name
            for path in F.PATHS:
                s = stats[path]
                for c, family in F.COUNTERS.items():
                    if c not in s.counters or c in F.KERNEL_ONLY:
                        continue
                    if c == "released":
                        for kind, n in self._attribute(job, path, s.counters.get(c, 0), st.kind).items():
                            out(family).add_metric([name, path, kind], n)
                    else:
                        out(family).add_metric([name, path], s.counters.get(c, 0))
                for reason, n in s.drops.items():
                    out(F.DROPS).add_metric([name, path, reason], n)
            for c in F.KERNEL_ONLY:
                if c in stats["kernel"].counters:
                    out(F.COUNTERS[c]).add_metric([name], stats["kernel"].counters[c])
            out(F.JOB_STRATEGY).add_metric([name], {"strategy": st.kind})
            out(F.JOB_STRATEGY_VERSION).add_metric([name], st.version)
            out(F.JOB_STRATEGY_PARAM).add_metric([name], st.param)
            out(F.JOB_STRATEGY_TIMEOUT).add_metric([name], st.timeout_us / 1e6)
            out(F.STRATEGY_SWAPS).add_metric([name], st.latest_version)
            for kind, n in self._count_decisions(job, pol).items():
                out(F.POLICY_DECISIONS).add_metric([name, kind], n)
            out(F.JOB_POLICY_SWITCHED).add_metric([name], int(pol.switched))
            out(F.JOB_STRAGGLERS).add_metric([name], pol.stragglers)
            out(F.JOB_DEPARTURES).add_metric([name], job.departures)
            if job.shards is not None:
                sh = job.shards
                out(F.SHARD_MAP_VERSION).add_metric([name], sh["version"])
                out(F.SHARD_INDEX).add_metric([name], sh["index"])
                out(F.SHARD_MAP_CHANGES).add_metric([name], sh["changes_total"])
                for i, share in enumerate(sh["shares"]):
                    out(F.SHARD_SHARE).add_metric([name, str(i)], share)
                    if sh["rates"][i] is not None:
                        out(F.SHARD_RATE).add_metric([name, str(i)], sh["rates"][i])
            for rank in range(min(job.world, max_ranks)):
                out(F.WORKER_GONE).add_metric([name, str(rank)], int(rank in job.gone))
            out(F.JOB_ROUNDS).add_metric([name], 0 if top is None else top + 1)
            out(F.JOB_MEMBERS).add_metric([name], job.world)
            out(F.JOB_MEMBERS_JOINED).add_metric([name], job.joined)
            out(F.JOB_SLOTS).add_metric([name, "kernel"], job.kernel_slots)
            out(F.JOB_SLOTS).add_metric([name, "user"], job.userspace_slots)
            shown_ranks = [w for w in ranks if w.rank < max_ranks]
            self._truncated["ranks"] += len(ranks) - len(shown_ranks)
            for w in shown_ranks:
                lbl = [name, str(w.rank)]
                out(F.WORKER_CONTRIBUTIONS).add_metric(lbl, w.contributions)
                out(F.WORKER_ARRIVAL_LAG).add_metric(lbl, w.lag_seconds_sum)
                out(F.WORKER_LATE).add_metric(lbl, w.late)
                out(F.WORKER_OFFENCES).add_metric(lbl, w.offences)
                out(F.WORKER_ROUNDS_BEHIND).add_metric(lbl, w.rounds_behind)
                out(F.WORKER_BLOCKING).add_metric(lbl, w.blocking_seconds)
                for family, v in ((F.WORKER_LAG, w.lag_seconds), (F.WORKER_SLOWDOWN, w.slowdown),
                                  (F.WORKER_SCORE, w.score),
                                  (F.WORKER_WAIT, w.wait_seconds),
                                  (F.WORKER_STRAGGLER, None if w.straggler is None else int(w.straggler))):
                    if v is not None:  # the detector has not judged the rank yet
                        out(family).add_metric(lbl, v)
            keep.add(job.id)
        for d in (self._released, self._decisions):
            for key in [k for k in d if k[0] not in keep]:
                del d[key]

        usage = r.slot_usage([j for j in shown if j.id in keep])
        by_id = {j.id: j.name for j in shown}
        for job_id, paths in usage.busy.items():
            if job_id in by_id:
                for path, n in paths.items():
                    out(F.JOB_SLOTS_BUSY).add_metric([by_id[job_id], path], n)
        if usage.slot_bytes is not None:
            out(F.KERNEL_MEMORY_BUDGET).add_metric([], usage.budget_bytes)
            out(F.KERNEL_MEMORY).add_metric([], usage.array_slots * usage.slot_bytes)
            out(F.KERNEL_MEMORY_ALLOCATED).add_metric([], usage.allocated * usage.slot_bytes)
            out(F.KERNEL_SLOT_BYTES).add_metric([], usage.slot_bytes)
        out(F.KERNEL_SLOTS_CAPACITY).add_metric([], usage.capacity)
        out(F.KERNEL_SLOTS_ALLOCATED).add_metric([], usage.allocated)

        h = r.health()
        if h.xdp_attached is not None:
            out(F.XDP_ATTACHED).add_metric([], int(h.xdp_attached))
        if h.p4_connected is not None:
            out(F.P4_CONNECTED).add_metric([], int(h.p4_connected))
        out(F.USERSPACE_UP).add_metric([], int(h.userspace_alive))
        out(F.USERSPACE_ERRORS).add_metric([], h.userspace_errors)
        out(F.USERSPACE_SEND_ERRORS).add_metric([], h.userspace_send_errors)

        for reason, n in self._truncated.items():
            out(F.TRUNCATED).add_metric([reason], n)
        out(F.COLLECT_ERRORS).add_metric([], self._errors)
        out(F.COLLECT_DURATION).add_metric([], time.perf_counter() - t0)
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
