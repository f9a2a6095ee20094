"""Debian's real Prometheus server in a lab namespace, for the metrics' service test
(tests/service/test_prometheus.py): started on a free port, queried through its HTTP API."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path


def free_port(ns: str) -> int:
    from aggd.lab.namespaces import in_netns
    with in_netns(ns):
        s = socket.socket()
    with s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Debian's prometheus in the lab's aggregator namespace, scraping ``target`` every second and
    evaluating the rules ``rules_text``."""

    def __init__(self, lab, workdir: Path, target: str, rules_text: str):
        binary = shutil.which("prometheus")
        assert binary, "Debian's prometheus is not installed: run scripts/setup.sh (APT_PACKAGES)"
        self.lab, self.ns = lab, lab.agg_ns
        rules = workdir / "aggd.rules.yml"
        rules.write_text(rules_text)
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {rules}\n"
            f"scrape_configs:\n  - job_name: aggd\n    static_configs:\n      - targets: ['{target}']\n")
        check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.port = free_port(self.ns)
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = lab.run(self.ns, [binary, f"--config.file={config}",
                                          f"--storage.tsdb.path={workdir / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT)
        self.wait(lambda: self._get("/-/ready", raw=True) is not None, 60, "Prometheus ready")

    def _get(self, path: str, raw: bool = False, **params):
        from aggd.lab.namespaces import in_netns
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with in_netns(self.ns):  # urllib's socket is made in the namespace
                with urllib.request.urlopen(url, timeout=10) as resp:
                    body = resp.read().decode()
        except OSError:
            if raw:
                return None
            raise
        if raw:
            return body
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]

    def query(self, expr: str) -> list:
        return self._get("/api/v1/query", query=expr)["result"]

    def rules(self) -> list[dict]:
        return [r for g in self._get("/api/v1/rules")["groups"] for r in g["rules"]]

    def firing(self, name: str) -> list[dict]:
        return [a["labels"] for a in self._get("/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == name and a["state"] == "firing"]

    def wait(self, cond, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log_path.read_text()[-3000:]}")
            got = cond()
            if got:
                return got
            time.sleep(0.5)
        raise AssertionError(f"no {what} within {timeout} s")

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
