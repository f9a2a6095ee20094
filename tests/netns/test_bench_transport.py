"""``aggctl bench transport``: a worker's packet path alone to a native XDP program that turns frames
round, through one veth and through a bridge, UDP sockets and an AF_XDP socket (copy mode,
multi-buffer at 9000)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from click.testing import CliRunner

from aggd.cli.main import main as aggctl


@pytest.mark.root
def test_bench_transport_rows_and_plot(tmp_path):
    png = tmp_path / "transport.png"
    out = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "transport", "--bytes", "20M", "--reps", "1",
                          "--path", "veth,bridge", "--json", "--png", str(png)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["path"], r["mtu"], r["system"]) for r in rows] == [
        (p, m, s) for p in ("veth", "bridge") for m in (1500, 9000) for s in ("udp", "xsk")]
    for r in rows:
        assert r["frames"] == (20 << 20) // (r["mtu"] - 28) and r["payload_bytes"] == r["mtu"] - 28
        assert r["gbps"] > 0 and r["host_cpu_seconds_per_gb"] >= 0, r
        assert r["zero_copy"] is (False if r["system"] == "xsk" else None), r  # a veth has no zero-copy mode
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith("aggd-t")]


@pytest.mark.parametrize("args, hint", [(["--mtu", "12000"], "--mtu"), (["--systems", "dpdk"], "--systems"),
                                        (["--window", "0"], "--window"), (["--path", "wire"], "--path")])
def test_bench_transport_refuses_bad_options(args, hint):
    res = CliRunner().invoke(aggctl, ["bench", "transport", *args])
    assert res.exit_code == 2 and hint in res.output, res.output
