"""``aggctl bench shards`` end to end: the even and the rebalanced runs on labs alike, one JSON row
each, the members agreeing on every map (the speed-up itself is the benchmark's, in the docs)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.root


def test_bench_shards_emits_both_runs(tmp_path):
    png = tmp_path / "shards.png"
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "shards", "--workers", "2", "--size", "256K",
         "--calls", "10", "--steady", "4", "--rebalance-every", "2", "--rates", "200,50", "--json",
         "--plot", str(png)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    even, rebalanced = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert (even["mode"], rebalanced["mode"]) == ("even", "rebalanced")
    assert even["final_weights"] == [1, 1]
    w = rebalanced["final_weights"]
    assert w[0] > w[1], w                      # moved off the slower link
    assert len(rebalanced["seconds_per_call"]) == 10 and rebalanced["speedup_over_even"] > 0
    assert png.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "shards", "--rates", "100"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--rates" in bad.stderr


def test_bench_shards_scale_out_and_in_through_daemons():
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "shards", "--workers", "2", "--size", "256K",
         "--calls", "14", "--rebalance-every", "2", "--rates", "200,200,200", "--scale", "4:8", "--json"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    weights = row["weights_per_call"]
    assert len(weights[0]) == 2 and len(weights[-1]) == 3 and weights[-1][2] == 0, weights
    assert all(t is not None for t in row["seconds_by_phase"].values()), row["seconds_by_phase"]
    bad = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "shards", "--scale", "8:4"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--scale" in bad.stderr
