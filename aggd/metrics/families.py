"""Every metric family aggd exports, declared once: name, type, help and labels.

The collector (``aggd.metrics.collector``) makes a fresh family of each at every scrape and fills
it; docs/observability.md lists them and tests/unit/test_metrics_files.py checks the two agree.
Names follow the Prometheus conventions: one ``aggd_`` prefix, base units (seconds, bytes),
``_total`` on counters (added by client_python), ``_info`` for the strategy in force.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

#: Every label any aggd metric carries (tests check this). ``aggd_job`` is the job's name: ``job``
#: itself is the label Prometheus gives every scraped series, and an exported ``job`` would be
#: renamed ``exported_job``.
LABELS = ("aggd_job", "rank", "reason", "strategy", "path", "aggregator")
PATHS = ("kernel", "user")

J, JP, W = ("aggd_job",), ("aggd_job", "path"), ("aggd_job", "rank")

_KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "info": InfoMetricFamily}


@dataclass(frozen=True)
class Family:
    name: str
    kind: str          #: "counter", "gauge" or "info"
    help: str
    labels: tuple[str, ...] = ()

    def new(self):
        """An empty family of this metric, to fill in one scrape."""
        return _KINDS[self.kind](self.name, self.help, labels=list(self.labels))


def counter(name: str, help_: str, labels: tuple[str, ...] = ()) -> Family:
    return Family(name, "counter", help_, labels)


def gauge(name: str, help_: str, labels: tuple[str, ...] = ()) -> Family:
    return Family(name, "gauge", help_, labels)


# -- the data planes' per-job counters (docs/protocol.md, "Counters") --------------------------------
#: Protocol counter -> its family. ``released`` is exported by strategy and ``to_userspace`` for the
#: kernel only; tests fail when the protocol gains a counter that is not here.
COUNTERS: dict[str, Family] = {
    "rx_packets": counter("aggd_packets", "aggd messages received by the path for the job (the kernel "
                                          "counts every packet of the job that reaches the XDP program, "
                                          "those it hands to user space included)", JP),
    "rx_bytes": counter("aggd_bytes", "Bytes of aggd messages received by the path for the job", JP),
    "elements": counter("aggd_elements", "int32 elements aggregated by the path", JP),
    "contributions": counter("aggd_contributions", "Contributions added to a sum by the path", JP),
    "released": counter("aggd_results_released", "Results released by the path, by the strategy in force "
                                                 "when the daemon saw them released", JP + ("strategy",)),
    "rereads": counter("aggd_rereads", "Results sent again to a worker that lost them (re-reads and late "
                                       "contributions answered)", JP),
    "retransmits": counter("aggd_retransmits", "Contributions received with the retransmit flag", JP),
    "overflows": counter("aggd_sum_overflows", "Results sent flagged overflow: a sum outside int32", JP),
    "to_userspace": counter("aggd_userspace_handoffs", "Packets the XDP program handed to the user-space "
                                                       "(overflow) path: slots beyond the job's kernel slots, "
                                                       "or another packet size", J),
    "carried": counter("aggd_carried_contributions", "Late contributions carried into a later round", JP),
    "timeouts": counter("aggd_quorum_timeouts", "Rounds released by a quorum deadline", JP),
    "partials": counter("aggd_partial_results", "Running sums sent before release (async)", JP),
    "forwarded": counter("aggd_forwarded_sums", "A rack job's partial sums sent up to its upper aggregator "
                                                "(re-sends included)", JP),
    "relayed": counter("aggd_relayed_results", "The upper aggregator's results passed on to the rack's "
                                               "members", JP),
    "uncarried": counter("aggd_uncarried_contributions", "Late quorum contributions answered but not added: "
                                                         "no bank was free to carry them (slots serving "
                                                         "several chunk indices, or past rounds full of "
                                                         "carries)", JP),
}
#: Counters exported for the kernel path only (no ``path`` label).
KERNEL_ONLY = {"to_userspace"}
DROPS = counter("aggd_drops", "Packets dropped, by path and reason (docs/protocol.md); packets that never "
                              "reached a job have no aggd_job", JP + ("reason",))

# -- jobs ------------------------------------------------------------------------------------------
JOBS = gauge("aggd_jobs", "Jobs in the registry (exported or not)")
JOB_STRATEGY = Family("aggd_job_strategy", "info", "The strategy governing the job's current round", J)
JOB_STRATEGY_VERSION = gauge("aggd_job_strategy_version", "Version of the strategy governing the current round", J)
JOB_STRATEGY_PARAM = gauge("aggd_job_strategy_param", "Parameter of the strategy in force: quorum size, ssp "
                                                      "staleness (0 for the others)", J)
JOB_STRATEGY_TIMEOUT = gauge("aggd_job_strategy_timeout_seconds", "Quorum deadline of the strategy in force "
                                                                  "(0 for the others)", J)
STRATEGY_SWAPS = counter("aggd_strategy_swaps", "Hot swaps: strategy versions installed after the first", J)
POLICY_DECISIONS = counter("aggd_policy_decisions", "Decisions of the dynamic-hybrid policy, by the strategy "
                                                    "it chose", J + ("strategy",))
JOB_ROUNDS = counter("aggd_job_rounds", "Rounds begun: the highest round seen by either path, plus one", J)
JOB_MEMBERS = gauge("aggd_job_members", "Members (world size) of the job", J)
JOB_MEMBERS_JOINED = gauge("aggd_job_members_joined", "Members that have joined", J)
JOB_SLOTS = gauge("aggd_job_slots", "Slots of the job's pool served by each path", JP)
JOB_SLOTS_BUSY = gauge("aggd_job_slots_busy", "Slots of the job holding an open round now", JP)
JOB_POLICY_SWITCHED = gauge("aggd_job_policy_switched", "1 while the dynamic-hybrid policy's strategy is in "
                                                        "force instead of the job's own", J)
JOB_STRAGGLERS = gauge("aggd_job_stragglers", "Ranks the straggler detector flags now", J)
JOB_DEPARTURES = counter("aggd_job_departures", "Members declared gone (silent while a round waited for "
                                                "them, or removed by hand) since the daemon started", J)

# -- a sharded job's map, as its members report it (docs/sharding.md) -------------------------------
A = ("aggd_job", "aggregator")
SHARD_MAP_VERSION = gauge("aggd_shard_map_version", "Version of the job's shard map the members last reported", J)
SHARD_INDEX = gauge("aggd_shard_index", "Which aggregator of the job's shard map this host is", J)
SHARD_SHARE = gauge("aggd_shard_share", "Share of every tensor each aggregator of the map sums (its weight over "
                                        "the weights' total)", A)
SHARD_RATE = gauge("aggd_shard_rate_values_per_second", "Each aggregator's service rate as the deciding member "
                                                        "measured it (values a second; absent until measured)", A)
SHARD_MAP_CHANGES = counter("aggd_shard_map_changes", "New shard map versions reported since the daemon started", J)

# -- workers (ranks) ------------------------------------------------------------------------------
WORKER_CONTRIBUTIONS = counter("aggd_worker_contributions", "Contributions of the rank added to a sum", W)
WORKER_ARRIVAL_LAG = counter("aggd_worker_arrival_lag_seconds", "Sum over the rank's rounds of (the arrival of "
                                                                "its call's start, chunk 0 - the round's first "
                                                                "arrival); with aggd_job_rounds_total, the mean "
                                                                "lag a round", W)
WORKER_LATE = counter("aggd_worker_late_contributions", "Contributions of the rank that arrived after their "
                                                        "round was released", W)
WORKER_OFFENCES = counter("aggd_worker_offences", "Contributions of the rank dropped beyond the job's per-member "
                                                  "bound (max_abs or max_norm)", W)
WORKER_SCORE = gauge("aggd_worker_score", "A robust job's member: its score in the policy's last window, "
                                          "(<x, m> - rho |x|^2) / |m|^2 with m the job's result over its rows "
                                          "(about 1 honest; below -0.5 in score_after windows: quarantined)", W)
WORKER_ROUNDS_BEHIND = gauge("aggd_worker_rounds_behind", "The job's newest round minus the rank's newest", W)
WORKER_BLOCKING = gauge("aggd_worker_blocking_seconds", "How long the ranks ahead of this one have been waiting "
                                                        "for it under a barrier (0: nobody waits)", W)
WORKER_LAG = gauge("aggd_worker_lag_seconds", "How late the rank starts its rounds: its chunk 0 after the "
                                              "round's first arrival (the straggler detector's moving average)", W)
WORKER_SLOWDOWN = gauge("aggd_worker_slowdown_ratio", "How many times longer the rank's steps take than the "
                                                      "median member's (1: even)", W)
WORKER_STRAGGLER = gauge("aggd_worker_straggler", "1 while the straggler detector flags the rank", W)
WORKER_GONE = gauge("aggd_worker_gone", "1 while the rank is declared gone: rounds do not wait for it", W)
WORKER_WAIT = counter("aggd_worker_wait_seconds", "Cumulative time the rank waited for others at the barrier "
                                                  "(since the detector started on the job)", W)

# -- the host's data planes -------------------------------------------------------------------------
KERNEL_MEMORY_BUDGET = gauge("aggd_kernel_memory_budget_bytes", "Kernel memory budget for slots "
                                                                "([dataplane] kernel_memory)")
KERNEL_MEMORY = gauge("aggd_kernel_memory_bytes", "Kernel memory the loaded slot array takes (allocated at load)")
KERNEL_MEMORY_ALLOCATED = gauge("aggd_kernel_memory_allocated_bytes", "Kernel slot memory allocated to jobs")
KERNEL_SLOT_BYTES = gauge("aggd_kernel_slot_bytes", "Bytes of one kernel slot")
KERNEL_SLOTS_CAPACITY = gauge("aggd_kernel_slots_capacity", "Kernel slots the budget holds")
KERNEL_SLOTS_ALLOCATED = gauge("aggd_kernel_slots_allocated", "Kernel slots allocated to jobs")
XDP_ATTACHED = gauge("aggd_xdp_attached", "1 if the XDP program is attached")
P4_CONNECTED = gauge("aggd_p4_connected", "1 while the daemon holds its P4Runtime session with the switch "
                                          "(dataplane.kind = \"p4\")")
USERSPACE_UP = gauge("aggd_userspace_path_up", "1 if the user-space path is serving")
USERSPACE_ERRORS = counter("aggd_userspace_errors", "Packets whose handling in user space raised")
USERSPACE_SEND_ERRORS = counter("aggd_userspace_send_errors", "Sends of the user-space path that failed")

# -- the collector itself -------------------------------------------------------------------------
TRUNCATED = counter("aggd_metrics_truncated", "Jobs (reason=jobs) or ranks (reason=ranks) left out of a scrape "
                                              "by [metrics] max_jobs / max_ranks, summed over scrapes", ("reason",))
COLLECT_ERRORS = counter("aggd_metrics_collect_errors", "Jobs that could not be read during a scrape")
COLLECT_DURATION = gauge("aggd_metrics_collect_duration_seconds", "Time the last scrape took to read the data "
                                                                  "planes")

#: Every family, in the order a scrape lists them.
ALL: tuple[Family, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Family)) + \
    tuple(COUNTERS.values())
