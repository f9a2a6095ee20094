"""``aggctl bench train`` run tiny: one model, 2 workers, a few steps, aggd-xdp and gloo, JSON and PNG.
(aggd-user under the bench's runner: tests/train/test_precision_training.py; under torchrun with
every bucket layout: tests/train/test_torch_lab.py.)"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from aggd.cli.main import main as aggctl

pytestmark = pytest.mark.root


def test_bench_train_tiny_writes_rows_ratios_and_a_plot(tmp_path, monkeypatch, request):
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    # the bench's temporary folders go here, and are gone after it (a short path: the lab daemon's
    # control socket is in one of them, and a Unix socket's path has at most 107 bytes)
    scratch = Path(tempfile.mkdtemp(prefix="aggd-bt-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    res = CliRunner().invoke(aggctl, ["bench", "train", "--model", "cnn", "--workers", "2", "--steps", "6",
                                      "--systems", "aggd-xdp,gloo", "--target", "0.3", "--eval-every", "2",
                                      "--json", str(out), "--png", str(png)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    rows = [x for x in lines if x["bench"] == "train"]
    assert [r["system"] for r in rows] == ["aggd-xdp", "gloo"]
    assert all(r["model"] == "cnn" and r["workers"] == 2 and r["steps"] == 6 and r["step_time_s"] > 0
               and r["samples_per_s"] > 0 and r["curve"] for r in rows), rows
    ratios = [x for x in lines if x["bench"] == "train-ratio"]
    assert {r["system"] for r in ratios} == {"aggd-xdp"} and all(r["speed_vs_gloo"] > 0 for r in ratios)
    assert "speed vs gloo" in res.output
    assert all([s for s, _, _ in r["curve"]] == [2, 4, 6] and r["eval_every"] == 2 and r["seed"] == 0 for r in rows)
    assert [(r["strategy"], r["retransmits"] is None) for r in rows] == [("sync", False), (None, True)]
    summary = [x for x in lines if x["bench"] == "train-steps-to-target"]
    assert [(r["system"], r["precision"], r["seeds"]) for r in summary] == \
        [("aggd-xdp", 32, [0]), ("gloo", 32, [0])]
    assert "steps to 30%: median" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(scratch.iterdir()) == []
