"""Issue 20's optional AF_XDP transport, as the lab measures it (``aggd.lab.xsk_client``): workers whose
packets go through AF_XDP sockets in copy mode reduce through the real XDP program as UDP workers do,
at MTU 1500 (one chunk a frame) and 9000 (multi-buffer frames of three chunks), at 32 and 8 bits,
under loss, and leave no program on their interface behind them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aggd.lab.namespaces import WORKER_IFNAME, xdp_prog_id
from aggd.lab.runner import LabJob, run_workers, xdp_aggregator

pytestmark = pytest.mark.root


def _bench(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--workers", "2",
                          "--iters", "2", "--json", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("mtu, precisions", [(1500, "32,8"), (9000, "32")], ids=["1500", "9000"])
def test_aggd_xsk_reduces_as_aggd_xdp_does(mtu, precisions):
    rows = _bench("--systems", "aggd-xdp,aggd-xsk", "--size", "1M", "--mtu", str(mtu), "--precision", precisions)
    assert sorted((r["system"], r["precision"]) for r in rows) == sorted(
        (s, int(b)) for s in ("aggd-xdp", "aggd-xsk") for b in precisions.split(","))
    for r in rows:
        assert r["errors"] == 0 and r["within_bound"], r
        assert r["mtu"] == mtu and r["seconds_per_allreduce"] > 0


def test_aggd_xsk_recovers_from_loss():
    (row,) = _bench("--systems", "aggd-xsk", "--size", "1M", "--loss", "2")
    assert row["errors"] == 0 and row["within_bound"] and row["retransmits"] > 0, row


def test_an_xsk_worker_takes_its_program_away(make_lab):
    lab = make_lab(2)
    with xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=[0, 1])
        dp.install_job(job.config(lab))
        runs = run_workers(lab, job, timeout=300, extra=["--sizes", "1000,300000", "--rounds", "2",
                                                         "--transport", "xsk"])
        for run in runs:
            assert run.returncode == 0, run.stderr[-3000:]
            assert len(run.records) == 4 and all(r["within_bound"] for r in run.records), run.records
        assert dp.job_stats(1).counters["released"] > 0
    assert [xdp_prog_id(lab.worker_ns(i), WORKER_IFNAME) for i in range(2)] == [None, None]


def test_aggd_xsk_refuses_generic_mode():
    from click.testing import CliRunner

    from aggd.cli.main import main as aggctl
    res = CliRunner().invoke(aggctl, ["bench", "allreduce", "--systems", "aggd-xsk", "--mode", "generic"])
    assert res.exit_code == 2 and "--systems" in res.output and "native" in res.output, res.output
