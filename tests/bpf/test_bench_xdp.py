"""`aggctl bench xdp --json`: one row per strategy and size, every timed packet really added."""
import json

import pytest
from click.testing import CliRunner

from aggd.cli.main import main as aggctl

pytestmark = pytest.mark.root


def test_bench_xdp_json_rows():
    res = CliRunner().invoke(aggctl, ["bench", "xdp", "--elements", "64", "--strategies", "sync,ssp:2,async",
                                      "--packets", "256", "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    assert [r["strategy"] for r in rows] == ["sync", "ssp:2", "async", "numpy-add"]
    for r in rows[:-1]:
        assert r["elements_per_packet"] == 64 and r["added"] == 256 and r["released"] == 4
        assert r["ns_per_packet"] > 0 and r["elements_per_s_per_core"] > 0
        assert 0 < r["harness_ns"] < r["ns_per_packet"]  # doing nothing costs less than adding
    assert rows[-1]["elements_per_s_per_core"] > 1e8


def test_bench_xdp_at_every_precision():
    """Narrow jobs' contributions (with room) are timed as really added: an 8-bit packet holds two
    values a lane, and a bad precision is refused by name."""
    res = CliRunner().invoke(aggctl, ["bench", "xdp", "--elements", "64", "--strategies", "sync",
                                      "--precision", "8,16,32", "--packets", "128", "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")][:-1]
    assert [(r["precision"], r["values_per_packet"]) for r in rows] == [(8, 128), (16, 64), (32, 64)]
    assert all(r["added"] == 128 and r["released"] == 2 and r["verdicts"] == {"drop": 126, "tx": 2}
               for r in rows), rows
    bad = CliRunner().invoke(aggctl, ["bench", "xdp", "--elements", "64", "--precision", "12"])
    assert bad.exit_code != 0 and "--precision" in bad.output and "12" in bad.output


def test_bench_xdp_with_members_at_several_exponents():
    """``--exponents 2``: half the members send another exponent, and their contributions are
    aligned; every one is still added and each round released."""
    res = CliRunner().invoke(aggctl, ["bench", "xdp", "--elements", "64", "--strategies", "sync",
                                      "--precision", "8,32", "--exponents", "1,2", "--packets", "128", "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")][:-1]
    assert [(r["exponents"], r["precision"]) for r in rows] == [(1, 8), (1, 32), (2, 8), (2, 32)]
    assert all(r["added"] == 128 and r["released"] == 2 for r in rows), rows
    bad = CliRunner().invoke(aggctl, ["bench", "xdp", "--elements", "64", "--exponents", "0"])
    assert bad.exit_code != 0 and "--exponents" in bad.output
