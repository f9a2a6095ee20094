"""``aggctl bench kernels``: the client's numba kernels timed alone, JSON rows and a PNG."""
from __future__ import annotations

import json

from click.testing import CliRunner

from aggd.cli.main import main as aggctl


def test_bench_kernels_rows_and_plot(tmp_path):
    png = tmp_path / "kernels.png"
    res = CliRunner().invoke(aggctl, ["bench", "kernels", "--values", "100K", "--repeats", "1", "--json",
                                      "--png", str(png)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = [json.loads(line) for line in res.output.splitlines()]
    assert [(r["kernel"], r["precision"]) for r in rows] == [
        ("all_finite", None), ("fill", 32), ("scatter", 32), ("fill", 16), ("scatter", 16), ("fill", 8), ("scatter", 8)]
    assert all(r["bench"] == "kernels" and r["values"] == 100 * 1024 and r["ns_per_value"] > 0 for r in rows)
    # a narrow packet's values: 16 bits one a lane (with room for the int32 result), 8 bits two
    assert {r["precision"]: r["values_per_packet"] for r in rows if r["kernel"] == "fill"} == {32: 2233, 16: 2233, 8: 4466}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_kernels_refuses_a_bad_precision():
    res = CliRunner().invoke(aggctl, ["bench", "kernels", "--precision", "12"])
    assert res.exit_code == 2 and "--precision" in res.output and "8, 16 or 32" in res.output
