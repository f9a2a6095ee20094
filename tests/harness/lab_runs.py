"""Checks of the lab's worker processes (``aggd.lab.runner.run_workers``): each worker checks its own
results against the exact float64 sum and the documented error bound and prints a record a call, so
these assertions cover every member."""
from __future__ import annotations


def assert_all_right(runs, expected_records: int | None = None, dp=None, job: int = 1) -> None:
    """Every worker exited 0, printed ``expected_records`` records (any number: None), and every
    result had the tensor's shape and was within its bound. ``dp``: a data plane whose ``job``
    counters a failure message shows."""
    for run in runs:
        stats = dp.job_stats(job) if dp is not None else ""
        assert run.returncode == 0, f"rank {run.rank} failed:\n{run.stderr[-3000:]}\n{stats}"
        if expected_records is not None:
            assert len(run.records) == expected_records, run.stderr[-3000:]
        wrong = [rec for rec in run.records if not (rec["shape_ok"] and rec["within_bound"])]
        assert not wrong, (run.rank, wrong[:3])
