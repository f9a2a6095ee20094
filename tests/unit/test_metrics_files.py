"""The shipped Prometheus rules, scrape config and Grafana dashboard: promtool accepts them, the
alerts fire (and only) when they should with the shipped ``for:`` durations (``promtool test rules``
on synthetic series), and every metric they name is one the collector exports.

promtool comes with Debian's ``prometheus`` (scripts/setup.sh installs it); these tests fail, not
skip, without it."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aggd.metrics import reader as m, server
from aggd.dataplane import JobStats

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "configs" / "prometheus" / "aggd.rules.yml"
SCRAPE = ROOT / "configs" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "configs" / "grafana" / "aggd.json"
T = 'instance="h:9477", job="aggd"'   # target labels Prometheus adds


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run scripts/setup.sh (Debian's prometheus package)"
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd)


def test_promtool_checks_the_rules_and_the_scrape_config():
    res = promtool("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    res = promtool("check", "config", SCRAPE.name, cwd=SCRAPE.parent)  # it loads aggd.rules.yml too
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def firing(name: str, at: str, *label_sets: str) -> dict:
    """A promql_expr_test: at ``at``, alert ``name`` fires exactly for ``label_sets``."""
    return {"expr": f'ALERTS{{alertname="{name}", alertstate="firing"}}', "eval_time": at,
            "exp_samples": [{"labels": f'ALERTS{{alertname="{name}", alertstate="firing", {ls}}}', "value": 1}
                            for ls in label_sets]}


def case(series: dict[str, str], *tests: dict) -> dict:
    return {"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "promql_expr_test": list(tests)}


def test_alerts_fire_when_they_should(tmp_path):
    w = lambda rank: f'aggd_job="train", rank="{rank}", {T}'  # noqa: E731
    j = f'aggd_job="train", {T}'
    cases = [
        # a rank 1 s late with 3x the median's step time: after 2 minutes, not before; a rank
        # with a large lag but even steps (everybody slow) and an even rank: never
        case({f"aggd_worker_lag_seconds{{{w(2)}}}": "1+0x20", f"aggd_worker_slowdown_ratio{{{w(2)}}}": "3+0x20",
              f"aggd_worker_lag_seconds{{{w(1)}}}": "0.6+0x20", f"aggd_worker_slowdown_ratio{{{w(1)}}}": "1.1+0x20",
              f"aggd_worker_lag_seconds{{{w(0)}}}": "0.01+0x20", f"aggd_worker_slowdown_ratio{{{w(0)}}}": "1+0x20"},
             firing("AggdStraggler", "1m"),
             firing("AggdStraggler", "3m", f'{w(2)}, severity="warning"')),
        # the target stops answering; and no target at all
        case({f"up{{{T}}}": "1 1 1 1 0 0 0 0 0 0 0 0 0 0"},
             firing("AggdDown", "30s"), firing("AggdDown", "1m30s"),
             firing("AggdDown", "3m", f'{T}, severity="critical"')),
        case({'up{job="other", instance="x:1"}': "1+0x10"},
             firing("AggdDown", "2m", 'job="aggd", severity="critical"')),
        # 10% of a job's packets dropped busy: after 10 minutes; 50% duplicates: never
        case({f'aggd_packets_total{{{j}, path="kernel"}}': "0+1500x60",
              f'aggd_drops_total{{{j}, path="kernel", reason="busy"}}': "0+150x60",
              f'aggd_drops_total{{{j}, path="kernel", reason="duplicate"}}': "0+750x60",
              f'aggd_packets_total{{aggd_job="even", {T}, path="kernel"}}': "0+1500x60",
              f'aggd_drops_total{{aggd_job="even", {T}, path="kernel", reason="duplicate"}}': "0+750x60"},
             firing("AggdDropsRising", "5m"),
             firing("AggdDropsRising", "13m", f'{j}, severity="warning"'),
             {"expr": 'aggd_job:aggd_drop_ratio:rate5m{aggd_job="train"}', "eval_time": "10m",
              "exp_samples": [{"labels": f'aggd_job:aggd_drop_ratio:rate5m{{{j}}}', "value": 0.1}]}),
        # half of a job's packets handed to user space: after 15 minutes; a job with no kernel
        # slot (user space by design, e.g. a robust one): never
        case({f'aggd_packets_total{{{j}, path="kernel"}}': "0+1000x100",
              f"aggd_userspace_handoffs_total{{{j}}}": "0+500x100",
              f'aggd_job_slots{{{j}, path="kernel"}}': "8+0x100",
              f'aggd_packets_total{{aggd_job="robust", {T}, path="kernel"}}': "0+1000x100",
              f'aggd_userspace_handoffs_total{{aggd_job="robust", {T}}}': "0+1000x100",
              f'aggd_job_slots{{aggd_job="robust", {T}, path="kernel"}}': "0+0x100"},
             firing("AggdOverflowToUserspace", "10m"),
             firing("AggdOverflowToUserspace", "21m", f'{j}, severity="warning"'),
             {"expr": 'aggd_job:aggd_userspace_handoff_ratio:rate5m{aggd_job="train"}', "eval_time": "10m",
              "exp_samples": [{"labels": f"aggd_job:aggd_userspace_handoff_ratio:rate5m{{{j}}}", "value": 0.5}]}),
        # a rank declared gone for a minute
        case({f"aggd_worker_gone{{{w(3)}}}": "0 0 1 1 1 1 1 1 1", f"aggd_worker_gone{{{w(0)}}}": "0+0x8"},
             firing("AggdWorkerGone", "1m"),
             firing("AggdWorkerGone", "1m45s", f'{w(3)}, severity="warning"')),
        # a rank's contributions beyond its job's bound: at once, while they keep coming
        case({f"aggd_worker_offences_total{{{w(3)}}}": "0 0 3 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5",
              f"aggd_worker_offences_total{{{w(0)}}}": "0+0x27"},
             firing("AggdWorkerOutOfBounds", "15s"),
             firing("AggdWorkerOutOfBounds", "1m", f'{w(3)}, severity="warning"'),
             firing("AggdWorkerOutOfBounds", "7m")),
        # a robust job's rank scoring below -0.5 for a minute; an honest one never
        case({f"aggd_worker_score{{{w(2)}}}": "0.9 0.8 -5 -5 -5 -5 -5 -5 -5 -5", f"aggd_worker_score{{{w(0)}}}": "0.9+0x9"},
             firing("AggdWorkerSuspect", "1m"),
             firing("AggdWorkerSuspect", "1m30s", f'{w(2)}, severity="warning"')),
        # a rank the others have waited for for a minute and more
        case({f"aggd_worker_blocking_seconds{{{w(1)}}}": "0 15 30 45 60 75 90 105 120 135 150",
              f"aggd_worker_blocking_seconds{{{w(0)}}}": "0+0x10"},
             firing("AggdWorkerBlocking", "1m"),
             firing("AggdWorkerBlocking", "2m30s", f'{w(1)}, severity="warning"')),
        # forged packets to the aggd port
        case({f'aggd_drops_total{{aggd_job="", path="kernel", reason="bad_magic", {T}}}': "0+300x60",
              f'aggd_drops_total{{{j}, path="kernel", reason="duplicate"}}': "0+300x60"},
             firing("AggdMalformedPackets", "5m"),
             firing("AggdMalformedPackets", "16m", f'reason="bad_magic", {T}, severity="warning"')),
        # packets with a member's address but not its tag, for minutes (a forged member)
        case({f'aggd_drops_total{{{j}, path="kernel", reason="bad_tag"}}': "0+60x60"},
             firing("AggdForgedMember", "3m"),
             firing("AggdForgedMember", "12m", f'{j}, reason="bad_tag", severity="warning"')),
        # one overflowed sum; the data plane and the user-space path going away; slots used up;
        # metrics left out
        case({f'aggd_sum_overflows_total{{{j}, path="user"}}': "0 0 0 1 1 1 1 1 1",
              f"aggd_xdp_attached{{{T}}}": "1 1 0 0 0 0 0 0 0 0", f"aggd_userspace_path_up{{{T}}}": "1+0x10",
              f"aggd_kernel_slots_allocated{{{T}}}": "100+0x200", f"aggd_kernel_slots_capacity{{{T}}}": "100+0x200",
              f'aggd_metrics_truncated_total{{reason="jobs", {T}}}': "0 0 3 6 9"},
             firing("AggdSumOverflow", "1m", f'{j}, path="user", severity="warning"'),
             firing("AggdXdpDetached", "2m", f'{T}, severity="critical"'),
             firing("AggdUserspacePathDown", "2m"),
             firing("AggdKernelSlotsExhausted", "20m"),
             firing("AggdKernelSlotsExhausted", "45m", f'{T}, severity="info"'),
             firing("AggdMetricsTruncated", "1m", f'reason="jobs", {T}, severity="info"')),
    ]
    spec = tmp_path / "aggd.rules.test.yml"  # JSON is YAML
    spec.write_text(json.dumps({"rule_files": [str(RULES)], "evaluation_interval": "15s", "tests": cases},
                               indent=1))
    res = promtool("test", "rules", str(spec))
    assert res.returncode == 0, res.stdout + res.stderr


def test_shipped_rules_are_patient():
    """Alerts that act on a state wait minutes before firing (the service test shortens them)."""
    text = RULES.read_text()
    durations = dict(re.findall(r"- alert: (\w+)\n(?:.*\n)*?\s+for: (\d+m)", text))
    assert {"AggdDown", "AggdStraggler", "AggdDropsRising", "AggdOverflowToUserspace"} <= set(durations)
    assert all(int(d[:-1]) >= 1 for d in durations.values())


# -- the dashboard ------------------------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", ()))
    return out


def test_dashboard_is_a_grafana_dashboard():
    d = dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 30
    ps = panels(d)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in ps if p["type"] == "row"]
    assert rows == ["Overview", "Per job", "Per worker", "Data plane health"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query" and "label_values(" in json.dumps(job["query"]) and job["multi"]
    for p in ps:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat", "gauge", "table"), p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"]), p["title"]
    # panels of the per-job and per-worker rows follow the job variable
    in_row, follow = None, []
    for p in ps:
        if p["type"] == "row":
            in_row = p["title"]
        elif in_row in ("Per job", "Per worker"):
            follow.append(all('aggd_job=~"$job"' in t["expr"] for t in p["targets"]))
    assert follow and all(follow)


# -- every metric named exists ------------------------------------------------------------------------------

def exported_names() -> set[str]:
    """Every sample name the collector exports when every family has something to say."""
    shards = {"version": 2, "index": 0, "shares": [0.5, 0.5], "rates": [1e6, 2e6], "changes_total": 2}
    j = m.JobInfo(1, "train", 2, 2, 16, 8, 0, ((0, 0, "sync"),), shards=shards)
    reader = types_reader(j)
    text = generate_latest(server.registry_for(reader)).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def types_reader(j):
    class R:
        def jobs(self):
            return [j]

        def job_stats(self, job, path):
            return JobStats()

        def rounds(self, job):
            return 3

        def strategy(self, job, round_):
            return m.strategy_in_force(job, round_)

        def slot_usage(self, jobs):
            return m.SlotUsage(1, 1, 1, 1, 1, {1: {"kernel": 0, "user": 0}})

        def worker_lag(self, job):
            return [m.WorkerLag(0, 1, 0.1, 0, 0, 0.0, 0.1, 1.0, False, 0.0, score=0.9)]

        def policy(self, job):
            return m.PolicyState()

        def health(self):
            return m.Health(True, True)
    return R()


METRIC = re.compile(r"(?<![\w:])([a-z_][a-z0-9_]*(?::[a-z0-9_]+)*)(?![\w:])(?!\s*\()")


def referenced(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # not inside label values
    expr = re.sub(r"\b(by|without|ignoring|on|group_left|group_right)\s*\([^)]*\)", "", expr)
    return {n for n in METRIC.findall(expr) if n == "up" or (n.startswith("aggd") and n != "aggd_job")
            or ":" in n}


def rule_exprs() -> tuple[set[str], list[str]]:
    text = RULES.read_text()
    records = set(re.findall(r"- record: (\S+)", text))
    exprs = []
    for block in re.split(r"\n\s+- (?:record|alert): ", text)[1:]:
        m_ = re.search(r"expr: (?:>-\n((?:\s{10}.*\n?)+)|(.*))", block)
        exprs.append((m_.group(1) or m_.group(2)).strip())
    return records, exprs


def test_every_metric_in_the_rules_and_the_dashboard_is_exported():
    names = exported_names() | {"up"}
    records, exprs = rule_exprs()
    assert len(exprs) == len(re.findall(r"- (?:record|alert): ", RULES.read_text()))
    dash = [t["expr"] for p in panels(dashboard()) for t in p.get("targets", ())]
    missing = {}
    for expr in exprs + dash:
        unknown = referenced(expr) - names - records
        if unknown:
            missing[expr] = unknown
    assert not missing, missing
    # and the recording rules' names follow level:metric:operations
    assert all(re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", r) for r in records), records


@pytest.mark.parametrize("expr,names", [
    ('sum by (aggd_job) (rate(aggd_elements_total{aggd_job=~"$job", path="user"}[1m]))', {"aggd_elements_total"}),
    ('up{job="aggd"} == 0 or absent(up{job="aggd"})', {"up"}),
    ("aggd_job:aggd_drop_ratio:rate5m > 0.05", {"aggd_job:aggd_drop_ratio:rate5m"}),
    ("rate(aggd_x_total[$__rate_interval]) / ignoring (path) rate(aggd_y_total[5m])", {"aggd_x_total", "aggd_y_total"}),
])
def test_referenced(expr, names):
    assert referenced(expr) == names
