"""The metrics against Debian's real Prometheus server.

Prometheus runs in the lab's aggregator namespace (where the daemon's metrics endpoint listens),
scrapes it every second and evaluates the shipped rules (configs/prometheus/aggd.rules.yml, with
the alerts' ``for:`` shortened to 2 s). A job of three workers allreduces while rank 2 sleeps a
second before each round, with half of the job's slots in user space. Then: the straggler alert
fires for rank 2 only, the overflow-to-user-space alert for the job (and not for a robust job,
served in user space by design, whose members then give the dashboard their scores), every
expression of every panel of configs/grafana/aggd.json and every recording rule returns data,
``aggctl top`` shows the job, and stopping the daemon fires the daemon-down alert. The workers are
tests/harness/metrics_worker.py.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.prometheus import Prometheus, free_port

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "configs" / "prometheus" / "aggd.rules.yml"
DASHBOARD = ROOT / "configs" / "grafana" / "aggd.json"
WORKER = ROOT / "tests" / "harness" / "metrics_worker.py"
FOR = "2s"          # the alerts' `for:` in this test (the shipped file says minutes)
ROUNDS = 14
DELAY = 1.0         # rank 2 sleeps this long before each round
SIZE = 4096         # 16 chunks: 8 kernel slots, 8 user-space slots

#: Grafana's built-in variables in panel expressions, and what they stand for here.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "${__rate_interval}": "1m", "$__interval": "5s",
                     "${__interval}": "5s", "$__range": "5m", "${__range}": "5m"}


def shortened_rules() -> str:
    return re.sub(r"(?m)^(\s+for:) \S+$", rf"\1 {FOR}", RULES.read_text())


def panel_expressions(dashboard: dict, job: str) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel, template variables substituted."""
    variables = {"$job": job, "${job}": job, "${job:regex}": job}
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", ()))
            for t in p.get("targets", ()):
                expr = t["expr"]
                for k, v in sorted({**GRAFANA_VARIABLES, **variables}.items(), key=lambda kv: -len(kv[0])):
                    expr = expr.replace(k, v)
                assert "$" not in expr, f"{p['title']}: unknown variable in {expr}"
                out.append((p["title"], expr))

    walk(dashboard["panels"])
    return out


def start_worker(lab, w: int, rank: int, name: str, token: str, delay: float) -> subprocess.Popen:
    return lab.run(lab.worker_ns(w), [sys.executable, str(WORKER), "--server", f"{lab.agg_ip}:47000",
                                      "--bind", f"{lab.worker_ip(w)}:40000", "--job", name, "--token", token,
                                      "--rank", str(rank), "--rounds", str(ROUNDS), "--delay", str(delay),
                                      "--size", str(SIZE)],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_dashboard_rules_and_alerts_in_prometheus(make_lab, make_daemon, tmp_path):
    lab = make_lab(3)
    metrics_port = free_port(lab.agg_ns)
    d = make_daemon(lab, metrics={"address": f"127.0.0.1:{metrics_port}"})
    job = d.call("jobs.create", name="train", world=3, slots=16, kernel_slots=8)
    assert (job["kernel_slots"], job["userspace_slots"]) == (8, 8)
    prom = Prometheus(lab, tmp_path, f"127.0.0.1:{metrics_port}", shortened_rules())
    workers = []
    try:
        assert {r["name"] for r in prom.rules()} >= {"AggdDown", "AggdStraggler", "AggdOverflowToUserspace"}
        prom.wait(lambda: prom.query('up{job="aggd"} == 1'), 20, "scrape of the daemon")
        prom.wait(lambda: all(r["health"] == "ok" for r in prom.rules()), 10, "every rule evaluated")
        assert not [r for r in prom.rules() if r.get("lastError")]

        workers = [start_worker(lab, w, w, "train", job["token"], DELAY if w == 2 else 0.0) for w in range(3)]
        # the straggler alert fires, for rank 2 only
        firing = prom.wait(lambda: prom.firing("AggdStraggler"), 60, "AggdStraggler firing")
        assert {(a["aggd_job"], a["rank"]) for a in firing} == {("train", "2")}, firing

        # aggctl top finds the endpoint (address and namespace) from the daemon's config: the file
        # given, or without one the file of the daemon its control socket reaches
        res = d.aggctl("top", "--once", "--json", "--interval", "0.5")
        assert res.exit_code == 0 and json.loads(res.output)["jobs"], res.output
        res = d.aggctl("top", "--config", str(d.config_path), "--once", "--json", "--interval", "1.5")
        assert res.exit_code == 0, res.output
        top = json.loads(res.output)
        (j,) = top["jobs"]
        assert (j["job"], j["strategy"], j["world"], j["joined"]) == ("train", "sync", 3, 3)
        assert top["daemon"]["xdp_attached"] and top["daemon"]["kernel_slots_allocated"] == 8
        by_rank = {w["rank"]: w for w in top["workers"]}
        assert set(by_rank) == {0, 1, 2} and by_rank[2]["straggler"] and by_rank[2]["lag_seconds"] > 0.5
        assert by_rank[0]["lag_seconds"] < 0.25 and not by_rank[0]["straggler"]

        for p in workers:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            assert json.loads(out.splitlines()[-1])["rounds"] == ROUNDS
        # a robust job's members, so that the untrusted-members panel has scores (tensors of 1, 2
        # and 3: their median times 3 is their sum, which the workers check)
        robust = d.call("jobs.create", name="robust", world=3, slots=16, combine="median")
        workers = [start_worker(lab, w, w, "robust", robust["token"], 0.0) for w in range(3)]
        for p in workers:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
        prom.wait(lambda: prom.query('aggd_worker_score{aggd_job="robust"}'), 30, "a robust job's scores")
        time.sleep(2)  # a last scrape and rule evaluation after the last round

        # every panel's expression returns data
        dashboard = json.loads(DASHBOARD.read_text())
        empty = [(title, expr) for title, expr in panel_expressions(dashboard, "train|robust")
                 if not prom.query(expr)]
        assert not empty, f"panels without data: {empty}"
        # ... and every recording rule (by the series it records)
        records = [r["name"] for r in prom.rules() if r["type"] == "recording"]
        assert len(records) >= 10
        empty = [name for name in records if not prom.query(name)]
        assert not empty, f"recording rules without data: {empty}"
        # the rounds and the user-space share, as Prometheus sees them
        rounds = prom.query('aggd_job_rounds_total{aggd_job="train"}')
        assert float(rounds[0]["value"][1]) == ROUNDS
        share = prom.query('sum(aggd_elements_total{aggd_job="train",path="user"}) / '
                           'sum(aggd_elements_total{aggd_job="train"})')
        assert float(share[0]["value"][1]) == 0.5  # chunks 8..15 of 16 use user-space slots

        overflow = prom.wait(lambda: prom.firing("AggdOverflowToUserspace"), 30, "AggdOverflowToUserspace")
        assert [a["aggd_job"] for a in overflow] == ["train"]
        assert not prom.firing("AggdDown")

        d.stop()
        down = prom.wait(lambda: prom.firing("AggdDown"), 30, "AggdDown firing")
        assert down[0]["instance"] == f"127.0.0.1:{metrics_port}"
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
                p.wait()
        prom.close()
