"""A daemon killed (SIGKILL) mid-training and started again: no job is lost and training goes on to
the end with the right sums. The job holds half its slots in the kernel, so both paths live through
the restart: the XDP program stays attached and keeps its pinned slots, and the chunks served in
user space are refilled by the workers' retransmissions once the new daemon listens."""
from __future__ import annotations

import signal
import threading

import pytest

from aggd.lab.namespaces import xdp_prog_id
from aggd.lab.runner import LabJob, run_workers

pytestmark = pytest.mark.root

ROUNDS = 30
KILL_AFTER = 5


def test_sigkill_and_restart_mid_training(make_lab, make_daemon, slot_bytes):
    lab = make_lab(4)
    d = make_daemon(lab, dataplane={"kernel_memory": 8 * slot_bytes})
    job = d.call("jobs.create", name="train", world=4, slots=16)
    assert (job["kernel_slots"], job["userspace_slots"]) == (8, 8)

    restarted = threading.Event()
    failures = []

    def kill_and_restart():
        try:
            old = d.proc
            d.stop(signal.SIGKILL)
            assert old.returncode == -signal.SIGKILL
            # killed, the program stays attached and keeps serving the kernel's chunks
            assert xdp_prog_id(lab.agg_ns, lab.agg_ifname) is not None
            d.start()
        except BaseException as exc:  # reported by the test thread below
            failures.append(exc)
        finally:
            restarted.set()

    def on_record(rank, rec):
        if rank == 0 and rec["round"] == KILL_AFTER and not restarted.is_set() and not hasattr(on_record, "t"):
            on_record.t = threading.Thread(target=kill_and_restart)
            on_record.t.start()

    runs = run_workers(lab, LabJob(job=job["id"], workers=[0, 1, 2, 3], name="train", token=job["token"]),
                       timeout=400, on_record=on_record,
                       extra=["--sizes", "16384", "--rounds", str(ROUNDS), "--give-up-after", "90"])
    restarted.wait(120)
    assert not failures, failures
    for r in runs:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stderr[-3000:]}\n{d.log()[-3000:]}"
        assert [rec["round"] for rec in r.records] == list(range(ROUNDS))
        assert all(rec["within_bound"] for rec in r.records), r.records

    # the restarted daemon has the job, its members and its kernel placement; nothing was reinstalled
    assert "job train (1): restored, kernel slots kept" in d.log()
    shown = d.call("jobs.show", job="train")
    assert shown["token"] == job["token"] and shown["joined"] == 4
    assert shown["placement"] == job["placement"]
    # user space served its chunks after the restart (its counters start at zero with the process)
    assert shown["paths"]["userspace"]["counters"]["released"] > 0
    assert shown["round"] == ROUNDS - 1
