"""Real training at 8 and 16 bits a contribution value (docs/precision.md): a daemon's narrow job,
real worker processes in a lab, error feedback with error reset, against the 32-bit job of the
same run. The digits MLP through ``aggctl bench precision`` (its CLI, JSON and PNG), and the cnn
with DDP under torchrun through the hook (``aggctl bench train --precision``)."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from aggd.cli.main import main as aggctl
from aggd.training import torchbench

pytestmark = pytest.mark.root

#: the cnn's steps, and the steps between its accuracy measurements (on 450 test images)
STEPS, EVAL_EVERY = 100, 5
#: the cnn's final accuracy is the mean of its last evaluations (25 steps): at 90-97% one evaluation
#: moves by up to 1.5 points from the next, three times the half point compared
SETTLED = 5


def settled(row: dict) -> float:
    return sum(acc for _, _, acc in row["curve"][-SETTLED:]) / SETTLED


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_digits_at_8_bits_with_error_reset_train_as_32_bits(tmp_path):
    out, png = tmp_path / "precision.json", tmp_path / "precision.png"
    res = CliRunner().invoke(aggctl, ["bench", "precision", "--variants", "32,16,8,8-nofb", "--json", str(out),
                                      "--png", str(png)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = {r["variant"]: r for r in _rows(out)}
    assert list(rows) == ["32", "16", "8", "8-nofb"]
    base = rows["32"]
    assert base["rounds_to_target"] is not None, base
    for name in ("16", "8"):
        r = rows[name]
        assert r["feedback"] and r["replicas_equal"], r            # every replica applied the same values
        assert abs(r["final_accuracy"] - base["final_accuracy"]) <= 0.005, (name, r["final_accuracy"], base)
        assert r["rounds_to_target"] is not None and r["rounds_to_target"] <= 1.1 * base["rounds_to_target"], \
            (name, r["rounds_to_target"], base["rounds_to_target"])
    assert not rows["8-nofb"]["feedback"] and rows["8-nofb"]["final_accuracy"] > 0.5   # shown beside it
    assert (rows["8"]["bytes_up_per_value"], rows["8"]["bytes_down_per_value"]) == (1, 2)
    assert "| 8-nofb |" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cnn_under_torchrun_at_8_bits_trains_as_32_bits():
    """DDP's buckets (one at the first step, then rebuilt by size: the hook's error feedback keys
    follow) through an 8-bit job's user-space path, beside the 32-bit job."""
    rows = torchbench.run(["cnn"], 4, STEPS, systems=("aggd-user",), lab_name="tp" + __import__("secrets").token_hex(3),
                          target=0.9, precisions=(32, 8), eval_every=EVAL_EVERY)
    by = {r["precision"]: r for r in rows}
    base, narrow = by[32], by[8]
    assert base["steps_to_target"] is not None
    assert abs(settled(narrow) - settled(base)) <= 0.005, (narrow["curve"][-SETTLED:], base["curve"][-SETTLED:])
    # accuracy is measured every 5 steps, so a step count is known only to the next evaluation: 10%
    # more steps than 32 bits' is allowed up to the evaluation at or after it (20 steps: 22 -> 25;
    # runs of one code differ: CI saw 8 bits reach 90% at step 20 in one and 25 in another)
    allowed = EVAL_EVERY * math.ceil(1.1 * base["steps_to_target"] / EVAL_EVERY)
    assert narrow["steps_to_target"] is not None and narrow["steps_to_target"] <= allowed, \
        (narrow["steps_to_target"], base["steps_to_target"])
