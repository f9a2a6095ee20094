"""The daemon killed (SIGKILL) or stopped (SIGTERM) and started again, ten times over two runs, while
4 real workers train, with half of the job's slots in the kernel and half in the daemon's
user-space path, at 0% and 5% packet loss: every run must finish with bit-identical replicas (under
``sync`` every worker applies the same results), as kernel-only jobs always did. The user-space
path keeps its slots in memory-mapped files (aggd/dataplane/userspace/keep.py), as the kernel keeps
its pinned maps; members are not judged silent for the daemon's downtime.

Replicas that differed here (3 of 5 runs with ten restarts) had applied the same results: the
training loop's running sum of its unanswered steps kept a float64 residue when a result came in
during ``must_wait()`` (tests/unit/test_training_loop.py); the same 120-round run without any
restart differed too."""
from __future__ import annotations

import signal
import threading

import pytest

from aggd.training.labtrain import RunParams, run

pytestmark = pytest.mark.root

K, T = signal.SIGKILL, signal.SIGTERM
#: (loss %, the signals of the restarts in one run): ten restarts over the two runs
RUNS = [(0.0, (T, K, K, T, K)), (5.0, (K, T, K, K, T))]
EVERY = 30                                 #: rounds between restarts


@pytest.mark.parametrize("loss, signals", RUNS, ids=["0%", "5%"])
def test_restarts_mid_training_lose_nothing(lab_daemon, loss, signals):
    lab, d = lab_daemon(4, loss=loss)
    params = RunParams(rounds=EVERY * (len(signals) + 1), compute_ms=5.0, target=0.8, timeout_s=300,
                       eval_every=5)
    reached = {"round": -1}
    progressed = threading.Condition()
    restarts = []

    def on_record(rank, rec):
        if rank == 0 and "round" in rec:
            with progressed:
                reached["round"] = rec["round"]
                progressed.notify_all()

    def restart():
        for i, sig in enumerate(signals):
            with progressed:
                if not progressed.wait_for(lambda: reached["round"] >= EVERY * (i + 1), timeout=120):
                    return
            d.stop(sig)
            d.start()
            restarts.append(signal.Signals(sig).name)

    class AfterRestarts:
        """The daemon as run() calls it: its closing calls (the job's decisions, its deletion) wait
        for the last restart. At 0% loss restarts lag the rounds (the workers run on while a stop
        takes effect), so the last one can overlap the end of training, and run() found the
        daemon down (DaemonUnreachable, 2 of 14 runs)."""

        @staticmethod
        def call(cmd, **args):
            if cmd != "jobs.create":
                t.join(150)
            return d.call(cmd, **args)

    t = threading.Thread(target=restart, daemon=True)
    t.start()
    res = run(lab, AfterRestarts(), "sync", "none", params, on_record=on_record, kernel_slots=32)
    t.join(60)
    assert restarts == [signal.Signals(s).name for s in signals], restarts
    assert len(res.workers) == 4 and all(w["drained"] is True and w["rounds"] >= params.rounds
                                         for w in res.workers), (res.workers, d.log()[-3000:])
    assert len({w["params_sha"] for w in res.workers}) == 1, res.workers
    assert d.log().count("user-space slots taken up where the previous daemon left them") == len(signals)
    assert "declared gone" not in d.log()
