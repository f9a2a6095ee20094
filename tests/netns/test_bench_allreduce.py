"""``aggctl bench allreduce`` end to end: the three systems on one lab, one JSON row each, checked."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.root


def test_bench_allreduce_emits_a_row_per_system(tmp_path):
    png = tmp_path / "allreduce.png"
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp,aggd-user,gloo",
         "--size", "256K", "--workers", "2", "--iters", "2", "--pattern", "near", "--json", "--plot", str(png)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["system"] for r in rows] == ["aggd-xdp", "aggd-user", "gloo"]
    for r in rows:
        assert r["workers"] == 2 and r["bytes"] == 256 << 10 and r["pattern"] == "near"
        assert r["within_bound"] and r["errors"] == 0, r
        assert r["seconds_per_allreduce"] > 0 and r["algbw_gbps"] > 0
        # the result array is the only tensor-sized thing an allreduce must add
        assert 0 < r["worker_extra_rss_bytes"], r
        assert r["worker_extra_file_rss_bytes"] >= 0, r  # library pages taken off it
    xdp, user, _ = rows
    assert xdp["aggregator_memory"] == "bpf_maps" and xdp["aggregator_memory_bytes"] > 0
    assert user["aggregator_memory"] == "peak_rss" and user["aggregator_memory_bytes"] > 0
    assert png.stat().st_size > 10_000  # a real PNG


def test_bench_allreduce_with_loss_and_a_cpu_hog_rows_say_their_slowdown():
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp,gloo",
         "--size", "256K", "--workers", "2", "--iters", "2", "--loss", "2,0"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["aggd-xdp", "gloo", "aggd-xdp", "gloo"], lines
    assert all("loss=0%" in line for line in lines[:2]) and all("loss=2%" in line for line in lines[2:4]), lines
    (summary,) = [line for line in lines if line.startswith("workers=2") and "loss=2%" in line]
    assert "aggd-xdp / gloo" in summary and "its lossless time" in summary, summary
    bad = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--loss", "5,x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--loss" in bad.stderr
    busy = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp", "--size", "256K",
         "--workers", "2", "--iters", "2", "--cpu-hogs", "0,1", "--json"], capture_output=True, text=True, timeout=600)
    assert busy.returncode == 0, busy.stderr[-3000:]
    rows = [json.loads(line) for line in busy.stdout.splitlines() if line.startswith("{")]
    assert [r["cpu_hogs"] for r in rows] == [0, 1] and all(r["within_bound"] for r in rows), rows
    assert "slowdown_over_quiet" not in rows[0] and rows[1]["slowdown_over_quiet"] > 0, rows


def test_bench_allreduce_with_and_without_gro_on_the_workers():
    """``--gro off,on``: each system on the workers' two receive paths in turn, in one lab; with GRO
    (as a NIC) aggd's results reach the workers in trains, read one a call."""
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp,gloo", "--size", "1M",
         "--workers", "2", "--iters", "2", "--mtu", "1500", "--gro", "off,on", "--json"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["system"], r["gro"]) for r in rows] == [("aggd-xdp", False), ("gloo", False), ("aggd-xdp", True),
                                                      ("gloo", True)], rows
    assert all(r["within_bound"] and r["errors"] == 0 and r["mtu"] == 1500 for r in rows), rows
    assert rows[0]["result_trains"] == 0 and rows[2]["result_trains"] > 0, rows
    bad = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--gro", "maybe"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--gro" in bad.stderr


def test_bench_allreduce_refuses_an_unknown_system():
    out = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "nccl"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "unknown system" in out.stderr and "nccl" in out.stderr


def test_bench_allreduce_jumbo_packets_in_generic_mode():
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp", "--mode", "generic",
         "--size", "1M", "--workers", "2", "--iters", "2", "--json"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    from aggd_client.protocol import MAX_ELEMENTS
    assert row["mode"] == "generic" and row["elements_per_packet"] == MAX_ELEMENTS
    assert row["within_bound"] and row["errors"] == 0, row
    assert row["aggregator_memory_bytes"] <= 160 << 20  # the default slot pool stays bounded


def test_bench_allreduce_refuses_jumbo_packets_in_native_mode():
    out = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp",
                          "--elements", "8192"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--mode generic" in out.stderr
    out = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp",
                          "--mtu", "9001"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--mtu" in out.stderr and "--mode generic" in out.stderr


@pytest.mark.parametrize("mtu", [None, 1500])
def test_bench_allreduce_native_takes_the_largest_packet_the_mtu_holds(mtu):
    """Native XDP by default at MTU 9000 (multi-buffer frames), or the MTU given."""
    from aggd_client.protocol import HEADER_SIZE, NATIVE_MAX_ELEMENTS, NATIVE_MAX_MTU
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp", "--size", "1M",
         "--workers", "2", "--iters", "2", "--json"] + (["--mtu", str(mtu)] if mtu else []),
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    want = NATIVE_MAX_ELEMENTS if mtu is None else (mtu - 28 - HEADER_SIZE) // 4
    assert (row["mode"], row["mtu"], row["elements_per_packet"]) == ("native", mtu or NATIVE_MAX_MTU, want), row
    assert want == (358 if mtu == 1500 else 2233)
    assert row["within_bound"] and row["errors"] == 0, row


def test_bench_allreduce_at_every_precision():
    """aggd's systems at 8, 16 and 32 bits beside one gloo row, native XDP at 832 values a packet
    (the program's narrow lanes, the workers' frames with room for the result); every result within
    its precision's bound."""
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp,aggd-user,gloo",
         "--size", "1M", "--workers", "2", "--iters", "2", "--elements", "832", "--precision", "8,16,32",
         "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["system"], r["precision"]) for r in rows] == [
        ("aggd-xdp", 32), ("aggd-xdp", 16), ("aggd-xdp", 8), ("aggd-user", 32), ("aggd-user", 16),
        ("aggd-user", 8), ("gloo", 32)]
    assert all(r["within_bound"] and r["errors"] == 0 for r in rows), rows
    # narrow workers send room for the result (--narrow-room auto): no frame goes back through the daemon
    xdp = [r for r in rows if r["system"] == "aggd-xdp"]
    assert [(r["room"], r["handed_back"]) for r in xdp] == [(False, 0), (True, 0), (True, 0)], xdp
    too_big = subprocess.run(     # generic mode's jumbo packets (8192 values)
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-xdp", "--size", "64K",
         "--workers", "2", "--iters", "1", "--precision", "8", "--mode", "generic"],
        capture_output=True, text=True, timeout=600)
    assert too_big.returncode != 0 and "at most 2233 values" in too_big.stderr, too_big.stderr[-2000:]


def test_bench_allreduce_robust_jobs_beside_the_summing_one():
    """aggd-user's job summing and as a robust job (docs/protocol.md, "Robust jobs"): every member
    checks the median / trimmed mean of the four tensors within the bound, and the robust rows say
    their slowdown over the summing one; zeno and a robust job without aggd-user are refused."""
    out = subprocess.run(
        [sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--systems", "aggd-user",
         "--size", "256K", "--workers", "4", "--iters", "2", "--combine", "sum,median,trimmed:1", "--json"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["combine"] for r in rows] == ["sum", "median", "trimmed:1"]
    assert all(r["within_bound"] and r["errors"] == 0 for r in rows), rows
    assert all(r["slowdown_over_sum"] > 0 for r in rows[1:]), rows
    for argv, says in ((["--systems", "aggd-user", "--combine", "zeno"], "cannot check"),
                       (["--systems", "gloo", "--combine", "median"], "aggd-user only")):
        bad = subprocess.run([sys.executable, "-m", "aggd.cli.main", "bench", "allreduce", "--size", "64K",
                              "--workers", "2", "--iters", "1", *argv], capture_output=True, text=True, timeout=600)
        assert bad.returncode != 0 and says in bad.stderr, bad.stderr[-2000:]
