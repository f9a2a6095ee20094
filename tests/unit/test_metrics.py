"""aggd.metrics (families, reader, collector, server) against a fake map reader: names, units and labels by the Prometheus conventions,
values from the data planes' counters, the strategy in force, releases by strategy across a swap,
policy decisions, truncation of jobs and ranks, per-rank lag and blocking; the daemon's reader over
fake data planes; and aggctl top's view of two scrapes."""
from __future__ import annotations

import re
import types
from dataclasses import dataclass, field, replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aggd.metrics import collector, families, reader as m, server
from aggd.core.addresses import host_port
from aggd.cli.commands import top
from aggd.dataplane import JobStats, merge_member_rows
from aggd_client.protocol import Counter, DropReason


@dataclass
class FakeReader:
    """What the daemon's reader returns, as plain data the test changes between scrapes."""
    jobs_: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)      # (job id | None, path) -> JobStats
    rounds_: dict = field(default_factory=dict)    # job id -> highest round
    lags: dict = field(default_factory=dict)       # job id -> [WorkerLag]
    policies: dict = field(default_factory=dict)   # job id -> PolicyState
    busy: dict = field(default_factory=dict)
    broken: set = field(default_factory=set)       # job ids whose reads raise
    health_: m.Health = m.Health(True, True, 2, 3)

    def jobs(self):
        return list(self.jobs_)

    def job_stats(self, job, path):
        if job is not None and job.id in self.broken:
            raise KeyError(job.id)
        return self.stats.get((None if job is None else job.id, path), JobStats())

    def rounds(self, job):
        return self.rounds_.get(job.id)

    def strategy(self, job, round_):
        return m.strategy_in_force(job, round_)

    def slot_usage(self, jobs):
        return m.SlotUsage(8 << 20, 4680, 1792, 1792, 24, {j.id: self.busy.get(j.id, {}) for j in jobs})

    def worker_lag(self, job):
        return self.lags.get(job.id, [])

    def policy(self, job):
        return self.policies.get(job.id, m.PolicyState())

    def health(self):
        return self.health_


def scrape(collector) -> dict[str, list[tuple[dict, float]]]:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples, name, **labels):
    got = [v for lbl, v in samples.get(name, ()) if all(lbl.get(k) == str(x) for k, x in labels.items())]
    assert len(got) == 1, (name, labels, samples.get(name))
    return got[0]


def job(id_=1, name="train", world=3, strategies=((0, 0, "sync"),), **kw):
    return m.JobInfo(id_, name, world, joined=world, slots=16, kernel_slots=8, kernel_base=0,
                     strategies=tuple(strategies), **kw)


def test_names_units_and_labels_follow_the_conventions():
    r = FakeReader([job()], lags={1: [m.WorkerLag(0, 5, 0.5, lag_seconds=0.1, slowdown=1.0, straggler=False,
                                                  wait_seconds=1.0)]}, busy={1: {"kernel": 1, "user": 0}})
    reg = server.registry_for(r)
    text = generate_latest(reg).decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith(("process_", "python_")):
            continue
        assert fam.name.startswith("aggd_") and fam.name.count("aggd_") == 1, fam.name
        assert not re.search(r"_(ms|milliseconds|us|ns|kb|mb|kib|mib|percent)(_|$)", fam.name), fam.name
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), fam.name
        else:
            assert not any(s.name.endswith("_total") for s in fam.samples), fam.name
        for s in fam.samples:
            assert set(s.labels) <= set(families.LABELS), (s.name, s.labels)
            names.add(s.name)
            if "path" in s.labels:
                assert s.labels["path"] in ("kernel", "user")
    # one family per counter the data planes keep, with its unit in the name where it has one
    assert {"aggd_packets_total", "aggd_bytes_total", "aggd_elements_total", "aggd_results_released_total",
            "aggd_drops_total", "aggd_retransmits_total", "aggd_rereads_total", "aggd_userspace_handoffs_total",
            "aggd_job_strategy_info", "aggd_job_strategy_version", "aggd_strategy_swaps_total",
            "aggd_policy_decisions_total", "aggd_worker_lag_seconds", "aggd_worker_wait_seconds_total",
            "aggd_kernel_memory_bytes", "aggd_job_slots_busy", "aggd_metrics_truncated_total"} <= names
    assert "# TYPE aggd_job_strategy_timeout_seconds gauge" in text


def test_every_data_plane_counter_has_a_metric():
    assert set(families.COUNTERS) == {c.name.lower() for c in Counter}
    names = [f.name for f in families.COUNTERS.values()]
    assert len(set(names)) == len(names)


def test_counters_and_drops_by_path_and_reason():
    k = JobStats({"rx_packets": 100, "rx_bytes": 106400, "elements": 25600, "contributions": 100,
                  "released": 30, "to_userspace": 40, "retransmits": 3, "rereads": 2},
                 {"duplicate": 3, "busy": 1})
    u = JobStats({"rx_packets": 40, "elements": 10240, "released": 10}, {"stale": 2})
    r = FakeReader([job()], {(1, "kernel"): k, (1, "user"): u,
                             (None, "kernel"): JobStats({}, {"bad_magic": 7})}, {1: 9})
    s = scrape(collector.AggdCollector(r))
    assert value(s, "aggd_packets_total", aggd_job="train", path="kernel") == 100
    assert value(s, "aggd_packets_total", aggd_job="train", path="user") == 40
    assert value(s, "aggd_bytes_total", aggd_job="train", path="kernel") == 106400
    assert value(s, "aggd_elements_total", aggd_job="train", path="user") == 10240
    assert value(s, "aggd_userspace_handoffs_total", aggd_job="train") == 40
    assert value(s, "aggd_retransmits_total", aggd_job="train", path="kernel") == 3
    assert value(s, "aggd_job_rounds_total", aggd_job="train") == 10
    # every reason of every path is exported, zeros included; packets of no job have no aggd_job
    drops = s["aggd_drops_total"]
    assert len(drops) == 2 * 2 * len(DropReason)
    assert value(s, "aggd_drops_total", aggd_job="train", path="kernel", reason="duplicate") == 3
    assert value(s, "aggd_drops_total", aggd_job="train", path="user", reason="stale") == 2
    assert value(s, "aggd_drops_total", aggd_job="", path="kernel", reason="bad_magic") == 7
    assert value(s, "aggd_drops_total", aggd_job="train", path="user", reason="not_member") == 0
    assert value(s, "aggd_job_slots", aggd_job="train", path="kernel") == 8
    assert value(s, "aggd_job_slots", aggd_job="train", path="user") == 8
    assert value(s, "aggd_userspace_errors_total") == 2 and value(s, "aggd_userspace_send_errors_total") == 3
    assert value(s, "aggd_kernel_memory_bytes") == 1792 * 4680
    assert value(s, "aggd_kernel_memory_allocated_bytes") == 24 * 4680
    assert value(s, "aggd_kernel_slots_capacity") == 1792


def test_strategy_in_force_follows_the_round_and_releases_go_to_it():
    swapped = job(strategies=((0, 0, "sync"), (1, 10, "quorum:2:20ms")))
    kernel = JobStats({"released": 30})
    r = FakeReader([swapped], {(1, "kernel"): kernel}, {1: 5})
    c = collector.AggdCollector(r)
    s = scrape(c)
    assert value(s, "aggd_job_strategy_info", aggd_job="train", strategy="sync") == 1
    assert value(s, "aggd_job_strategy_version", aggd_job="train") == 0
    assert value(s, "aggd_strategy_swaps_total", aggd_job="train") == 1  # installed, from round 10
    assert value(s, "aggd_results_released_total", aggd_job="train", path="kernel", strategy="sync") == 30
    assert value(s, "aggd_results_released_total", aggd_job="train", path="kernel", strategy="quorum") == 0
    # the job passes round 10: quorum governs, and what is released from now on counts for it
    r.rounds_[1] = 12
    r.stats[(1, "kernel")] = JobStats({"released": 45})
    s = scrape(c)
    assert value(s, "aggd_job_strategy_info", aggd_job="train", strategy="quorum") == 1
    assert [value(s, f"aggd_job_strategy_{x}", aggd_job="train")
            for x in ("version", "param", "timeout_seconds")] == [1, 2, 0.02]
    assert value(s, "aggd_results_released_total", aggd_job="train", path="kernel", strategy="sync") == 30
    assert value(s, "aggd_results_released_total", aggd_job="train", path="kernel", strategy="quorum") == 15
    assert value(s, "aggd_results_released_total", aggd_job="train", path="user", strategy="ssp") == 0
    # counters that went down (the job re-created): they start over
    r.stats[(1, "kernel")] = JobStats({"released": 4})
    s = scrape(c)
    assert value(s, "aggd_results_released_total", aggd_job="train", path="kernel", strategy="quorum") == 4
    assert value(s, "aggd_results_released_total", aggd_job="train", path="kernel", strategy="sync") == 0


def test_policy_decisions_are_counted_once_and_state_shown():
    r = FakeReader([job()], policies={1: m.PolicyState(True, 1, ((100.0, "quorum"),))})
    c = collector.AggdCollector(r)
    s = scrape(c)
    assert value(s, "aggd_policy_decisions_total", aggd_job="train", strategy="quorum") == 1
    assert value(s, "aggd_policy_decisions_total", aggd_job="train", strategy="sync") == 0
    assert value(s, "aggd_job_policy_switched", aggd_job="train") == 1
    assert value(s, "aggd_job_stragglers", aggd_job="train") == 1
    s = scrape(c)  # the same record: nothing new
    assert value(s, "aggd_policy_decisions_total", aggd_job="train", strategy="quorum") == 1
    r.policies[1] = m.PolicyState(False, 0, ((100.0, "quorum"), (130.0, "sync")))
    s = scrape(c)
    assert value(s, "aggd_policy_decisions_total", aggd_job="train", strategy="quorum") == 1
    assert value(s, "aggd_policy_decisions_total", aggd_job="train", strategy="sync") == 1
    assert value(s, "aggd_job_policy_switched", aggd_job="train") == 0


def test_jobs_and_ranks_beyond_the_limits_are_left_out_and_counted():
    jobs = [job(i, f"j{i}", world=5) for i in (3, 1, 2)]
    lags = {i: [m.WorkerLag(rank, 10) for rank in range(5)] for i in (1, 2, 3)}
    limits = {"jobs": 2}
    c = collector.AggdCollector(FakeReader(jobs, lags=lags), max_jobs=lambda: limits["jobs"], max_ranks=3)
    s = scrape(c)
    assert {lbl["aggd_job"] for lbl, _ in s["aggd_job_strategy_info"]} == {"j1", "j2"}  # lowest ids
    assert {lbl["rank"] for lbl, _ in s["aggd_worker_contributions_total"]} == {"0", "1", "2"}
    assert value(s, "aggd_jobs") == 3
    assert value(s, "aggd_metrics_truncated_total", reason="jobs") == 1
    assert value(s, "aggd_metrics_truncated_total", reason="ranks") == 2 * 2
    s = scrape(c)  # summed over scrapes
    assert value(s, "aggd_metrics_truncated_total", reason="jobs") == 2
    limits["jobs"] = 64  # a reload raises the limit
    s = scrape(c)
    assert value(s, "aggd_metrics_truncated_total", reason="jobs") == 2
    assert len(s["aggd_job_strategy_info"]) == 3


def test_worker_families_empty_without_lag_and_detector_values_only_when_judged():
    r = FakeReader([job(1, "a"), job(2, "b")],
                   lags={2: [m.WorkerLag(0, 4, 0.0), m.WorkerLag(1, 4, 2.0, 1, 1, 0.7, 1.0, 3.0, True, 0.0)]})
    s = scrape(collector.AggdCollector(r))
    assert {lbl["aggd_job"] for lbl, _ in s["aggd_worker_contributions_total"]} == {"b"}
    assert [lbl["rank"] for lbl, _ in s["aggd_worker_lag_seconds"]] == ["1"]  # rank 0 not judged yet
    assert value(s, "aggd_worker_lag_seconds", aggd_job="b", rank=1) == 1.0
    assert value(s, "aggd_worker_slowdown_ratio", aggd_job="b", rank=1) == 3.0
    assert value(s, "aggd_worker_straggler", aggd_job="b", rank=1) == 1
    assert value(s, "aggd_worker_arrival_lag_seconds_total", aggd_job="b", rank=1) == 2.0
    assert value(s, "aggd_worker_blocking_seconds", aggd_job="b", rank=1) == 0.7
    assert value(s, "aggd_worker_rounds_behind", aggd_job="b", rank=1) == 1
    assert value(s, "aggd_worker_late_contributions_total", aggd_job="b", rank=1) == 1


def test_a_job_that_cannot_be_read_is_skipped_and_counted():
    r = FakeReader([job(1, "a"), job(2, "b")], broken={1})
    s = scrape(collector.AggdCollector(r))
    assert {lbl["aggd_job"] for lbl, _ in s["aggd_job_strategy_info"]} == {"b"}
    assert value(s, "aggd_metrics_collect_errors_total") == 1


def test_slot_usage_and_health():
    r = FakeReader([job()], busy={1: {"kernel": 3, "user": 1}}, health_=m.Health(False, True))
    s = scrape(collector.AggdCollector(r))
    assert value(s, "aggd_job_slots_busy", aggd_job="train", path="kernel") == 3
    assert value(s, "aggd_job_slots_busy", aggd_job="train", path="user") == 1
    assert value(s, "aggd_xdp_attached") == 0 and value(s, "aggd_userspace_path_up") == 1


# -- per-rank views from member_stats ------------------------------------------------------------------

def rows(*ranks):
    """(last_round, last_ns) per rank -> member_stats rows."""
    return [{"rank": i, "contributions": 10 * (i + 1), "lag_ns_sum": int(1e9) * i, "late": i,
             "last_round": lr, "last_ns": ns} for i, (lr, ns) in enumerate(ranks)]


def test_blocking_under_a_barrier_only():
    now = 100 * 10**9
    sample = rows((7, 90 * 10**9), (7, 95 * 10**9), (6, 50 * 10**9))
    sync = m.worker_rows(sample, now, m.blocks_after(m.StrategyState("sync")))
    assert [w.rounds_behind for w in sync] == [0, 0, 1]
    assert [w.blocking_seconds for w in sync] == [0.0, 0.0, 10.0]  # since the oldest of the waiting ones
    assert [w.contributions for w in sync] == [10, 20, 30] and sync[2].lag_seconds_sum == 2.0
    # declared gone (or quarantined): rounds do not wait for it, so it blocks nobody
    assert m.worker_rows(sample, now, m.blocks_after(m.StrategyState("sync")), gone=(2,))[2].blocking_seconds == 0
    assert all(w.blocking_seconds == 0 for w in m.worker_rows(sample, now, m.blocks_after(m.StrategyState("quorum"))))
    assert all(w.blocking_seconds == 0 for w in m.worker_rows(sample, now, m.blocks_after(m.StrategyState("async"))))
    # ssp:1 lets a rank be one round behind; two is a wait
    assert m.worker_rows(sample, now, m.blocks_after(m.StrategyState("ssp", 1)))[2].blocking_seconds == 0
    two = rows((8, 90 * 10**9), (6, 50 * 10**9))
    assert m.worker_rows(two, now, m.blocks_after(m.StrategyState("ssp", 1)))[1].blocking_seconds == 10.0
    # a rank that never contributed is behind everyone who did
    fresh = m.worker_rows(rows((0, 99 * 10**9), (None, 0)), now, 0)
    assert (fresh[1].rounds_behind, fresh[1].blocking_seconds) == (1, 1.0)
    assert m.worker_rows(rows((None, 0), (None, 0)), now, 0)[0].rounds_behind == 0


def test_detector_view_joins_the_counters():
    det = {1: types.SimpleNamespace(lag_ms=250.0, slowdown=2.5, flagged=True, wait_s=0.0)}
    out = m.worker_rows(rows((3, 0), (3, 0)), 0, 0, det)
    assert (out[0].lag_seconds, out[0].straggler) == (None, None)
    assert (out[1].lag_seconds, out[1].slowdown, out[1].straggler, out[1].wait_seconds) == (0.25, 2.5, True, 0.0)


def test_merged_rows_of_both_paths():
    a = {"rank": 0, "contributions": 3, "lag_ns_sum": 10, "late": 1, "last_round": 4, "last_ns": 7, "offences": 2}
    b = {"rank": 0, "contributions": 2, "lag_ns_sum": 5, "late": 0, "last_round": None, "last_ns": 9}   # (a P4 switch's)
    assert merge_member_rows(a, b) == {"rank": 0, "contributions": 5, "lag_ns_sum": 15, "late": 1, "last_round": 4,
                                       "last_ns": 9, "offences": 2, "score_terms": None}
    # a robust job's score terms (user space keeps them; the kernel's rows have none)
    assert merge_member_rows({**a, "score_terms": None}, {**b, "score_terms": (1.0, 2.0, 3.0)})["score_terms"] == \
        (1.0, 2.0, 3.0)
    assert merge_member_rows({**a, "score_terms": (1.0, 1.0, 1.0)}, {**b, "score_terms": (1.0, 2.0, 3.0)})[
        "score_terms"] == (2.0, 3.0, 4.0)


def test_strategy_in_force():
    j = job(strategies=((0, 0, "sync"), (1, 10, "ssp:2"), (2, 20, "quorum:2:50ms")))
    assert m.strategy_in_force(j, None) == m.StrategyState("sync", 0, 0, 0, 2)
    assert m.strategy_in_force(j, 10) == m.StrategyState("ssp", 2, 0, 1, 2)
    assert m.strategy_in_force(j, 99) == m.StrategyState("quorum", 2, 50_000, 2, 2)


# -- the daemon's reader over fake data planes ------------------------------------------------------------

class FakeDp:
    """The DataPlane calls the reader makes; slot i holds an open round if i is odd."""
    attached = True

    def open_slots(self, job):
        return sum(i % 2 for i in range(0, 8))

    def job_stats(self, job):
        return JobStats({"rx_packets": 5 if job is not None else 0}, {"bad_magic": 1} if job is None else {})

    def max_round(self, job):
        return 6

    def member_stats(self, job, world):
        return rows(*[(6, 1000)] * (world - 1), (5, 1000))


class FakeUs:
    """The user-space path's DataPlane calls: no per-member counters kept."""
    attached = True

    def describe(self):
        return {"alive": True, "errors": 0, "send_errors": 0}

    def job_stats(self, job):
        if job is None:
            return JobStats({}, {"too_short": 2})
        return JobStats({c.name.lower(): 7 for c in Counter}, {d.name.lower(): 0 for d in DropReason})

    def max_round(self, job):
        return 7

    def member_stats(self, job, world):
        return None

    def open_slots(self, job):
        return 2


def test_service_reader_over_the_daemon_state():
    import threading

    from aggd.core.registry import Limits, Registry

    reg = Registry(Limits(kernel_budget=100, elements=256, port=47000, userspace_port=47002, result_port=47001))
    j = reg.create("train", 3, slots=16, kernel_slots=0)
    reg.set_strategy(j.id, "quorum:2", 3)
    det = types.SimpleNamespace(last=types.SimpleNamespace(stragglers=(2,)),
                                workers=[types.SimpleNamespace(rank=r, lag_ms=1.0 * r, slowdown=1.0, flagged=r == 2,
                                                               wait_s=0.5) for r in range(3)])
    runner = types.SimpleNamespace(detectors={j.id: det},
                                   policies={j.id: types.SimpleNamespace(switched="quorum:2")},
                                   decisions={j.id: [{"time": 5.0, "strategy": "quorum:2:50ms"}]},
                                   score_watch=lambda jid: None)
    dp, us = FakeDp(), FakeUs()
    svc = types.SimpleNamespace(lock=threading.RLock(), registry=reg, policy=runner, dp=dp, us=us, planes=(dp, us),
                                config=types.SimpleNamespace(dataplane=types.SimpleNamespace(kind="xdp", kernel_memory=1 << 20)),
                                slot_bytes=4680, kernel_capacity=224)
    r = m.ServiceReader(svc, clock=lambda: 3000)
    (info,) = r.jobs()
    assert (info.name, info.world, info.kernel_slots, info.strategies[-1]) == ("train", 3, 0, (1, 3, "quorum:2:50ms"))
    assert r.job_stats(info, "user").counters["elements"] == 7
    assert r.job_stats(None, "user").drops == {"too_short": 2}
    assert r.job_stats(None, "kernel").drops == {"bad_magic": 1}
    assert r.rounds(info) == 7                              # no kernel slot: user space's round only
    assert r.worker_lag(info) == []                         # ... and no per-member counters there yet
    assert r.policy(info) == m.PolicyState(True, 1, ((5.0, "quorum"),))
    assert r.slot_usage([info]).busy == {info.id: {"kernel": 0, "user": 2}}
    # with kernel slots, the kernel's per-member counters and the detector's view
    reg.jobs[j.id] = replace(reg.jobs[j.id], kernel_slots=8)
    (info,) = r.jobs()
    lag = r.worker_lag(info)
    assert [w.rounds_behind for w in lag] == [0, 0, 1] and lag[2].straggler and lag[2].lag_seconds == 0.002
    assert lag[2].blocking_seconds == 0  # quorum governs round 6: nobody waits
    assert r.rounds(info) == 7
    assert r.slot_usage([info]).busy == {info.id: {"kernel": 4, "user": 2}}
    s = scrape(collector.AggdCollector(r))
    assert value(s, "aggd_job_strategy_info", aggd_job="train", strategy="quorum") == 1
    assert value(s, "aggd_policy_decisions_total", aggd_job="train", strategy="quorum") == 1
    # a policy runner of another shape (or none) leaves the rest of the scrape alone
    svc.policy = types.SimpleNamespace()
    (info,) = r.jobs()
    assert r.policy(info) == m.PolicyState() and r.worker_lag(info)[2].lag_seconds is None


def test_host_port():
    assert host_port("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert host_port("[::1]:9477") == ("::1", 9477)
    with pytest.raises(ValueError):
        host_port("nowhere")


# -- aggctl top ---------------------------------------------------------------------------------------------

def exposition(reader) -> dict:
    return top.parse(generate_latest(server.registry_for(reader)).decode())


def test_top_view_from_two_scrapes():
    j = job(strategies=((0, 0, "quorum:2:20ms"),))
    r = FakeReader([j], {(1, "kernel"): JobStats({"elements": 1000}), (1, "user"): JobStats({"elements": 0})},
                   {1: 9}, lags={1: [m.WorkerLag(0, 10, 0.0), m.WorkerLag(1, 10, 1.0, 0, 1, 2.0, 0.5, 4.0, True, 0.0)]},
                   policies={1: m.PolicyState(True, 1)})
    a = exposition(r)
    r.stats = {(1, "kernel"): JobStats({"elements": 4000}), (1, "user"): JobStats({"elements": 1000}),
               (None, "kernel"): JobStats({}, {"busy": 4})}
    r.rounds_ = {1: 19}
    r.lags = {1: [m.WorkerLag(0, 30, 0.0), m.WorkerLag(1, 20, 6.0, 0, 1, 2.0, 0.5, 4.0, True, 0.0)]}
    v = top.view(a, exposition(r), 2.0)
    (jv,) = v["jobs"]
    assert jv["strategy"] == "quorum:2:20ms" and jv["policy_switched"] and jv["stragglers"] == 1
    assert jv["rounds_per_second"] == 5.0 and jv["elements_per_second"] == 2000.0
    assert jv["bytes_per_second"] == 8000.0 and jv["kernel_share"] == 0.75
    w0, w1 = v["workers"]
    assert (w0["rank"], w0["contributions_per_second"], w0["lag_seconds"]) == (0, 10.0, None)
    assert (w1["lag_seconds"], w1["straggler"], w1["mean_arrival_lag_seconds"]) == (0.5, True, 0.5)
    assert w1["rounds_behind"] == 1
    assert v["daemon"]["xdp_attached"] and v["daemon"]["kernel_slots_capacity"] == 1792
    text = "\n".join(top.render(v, "test"))
    assert "quorum:2:20ms (policy)" in text and "STRAGGLER" in text and "75%" in text
    assert top.view(a, a, 2.0, job="other")["jobs"] == []


def test_top_endpoint_from_the_daemon_config(tmp_path):
    cfg = tmp_path / "aggd.toml"
    cfg.write_text('[dataplane]\nnetns = "lab-agg"\n[metrics]\naddress = "127.0.0.2:9999"\n')
    assert top.endpoint(None, str(cfg), None) == ("http://127.0.0.2:9999/metrics", "lab-agg")
    assert top.endpoint(None, str(cfg), "other") == ("http://127.0.0.2:9999/metrics", "other")
    assert top.endpoint("http://x:1/metrics", str(cfg), None) == ("http://x:1/metrics", None)


def test_top_unreachable_exits_3():
    from click.testing import CliRunner

    from aggd.cli.main import main

    res = CliRunner().invoke(main, ["top", "--url", "http://127.0.0.1:1/metrics", "--once"])
    assert res.exit_code == 3 and "cannot read metrics" in res.output
    res = CliRunner().invoke(main, ["top", "--url", "http://127.0.0.1:1/metrics", "--json"])
    assert res.exit_code == 2


@pytest.mark.parametrize("kind,param,timeout,text", [("sync", 0, 0, "sync"), ("ssp", 2, 0, "ssp:2"),
                                                     ("quorum", 3, 0.05, "quorum:3:50ms")])
def test_top_strategy_text(kind, param, timeout, text):
    assert top._strategy_text(kind, param, timeout) == text


def test_a_p4_switch_exports_what_it_keeps_and_nothing_else():
    """With kind = "p4": no kernel memory or XDP series, the switch's session instead; a Tofino's
    counters it does not keep are absent (not 0), the ones it keeps are exported."""
    untracked = frozenset({"rx_bytes", "elements", "retransmits"})
    tofino = JobStats({"rx_packets": 9, "released": 4}, {"bad_magic": 1}, untracked)

    class SwitchReader(FakeReader):
        def slot_usage(self, jobs):
            return m.SlotUsage(None, None, 1024, 1024, 8, {j.id: {"user": 0} for j in jobs})

    r = SwitchReader([job()], {(1, "kernel"): tofino, (1, "user"): JobStats({"rx_bytes": 5})},
                     health_=m.Health(None, True, p4_connected=True))
    s = scrape(collector.AggdCollector(r))
    assert value(s, "aggd_packets_total", aggd_job="train", path="kernel") == 9
    assert value(s, "aggd_bytes_total", aggd_job="train", path="user") == 5
    assert not [lbl for lbl, _ in s.get("aggd_bytes_total", ()) if lbl.get("path") == "kernel"]
    assert not [lbl for lbl, _ in s.get("aggd_elements_total", ()) if lbl.get("path") == "kernel"]
    assert value(s, "aggd_drops_total", aggd_job="train", path="kernel", reason="bad_magic") == 1
    assert value(s, "aggd_p4_connected") == 1 and value(s, "aggd_kernel_slots_capacity") == 1024
    for absent in ("aggd_xdp_attached", "aggd_kernel_memory_bytes", "aggd_kernel_slot_bytes",
                   "aggd_kernel_memory_budget_bytes"):
        assert absent not in s, absent


def test_every_family_is_in_the_docs_with_its_type():
    """docs/observability.md lists each family declared in aggd.metrics.families, with its type."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`aggd_"):
            for name in re.findall(r"`(aggd_[a-z0-9_]+)`", cells[0]):
                rows[name] = cells[1]
    for f in families.ALL:
        shown = f.name + {"counter": "_total", "info": "_info", "gauge": ""}[f.kind]
        assert shown in rows, f"{shown} is exported but not in docs/observability.md"
        assert rows[shown].startswith("gauge" if f.kind == "info" else f.kind), (shown, rows[shown])
    assert len({f.name for f in families.ALL}) == len(families.ALL)
