"""Nobody left hanging: a real aggd daemon, 4 real workers training the digits MLP in a lab, one of
them SIGKILLed mid-training.

Under ``sync`` the survivors' round waits for the dead worker (its slots in the kernel, or all in
the daemon's user-space path). The daemon must declare it gone
within ``[policy] silent_after`` (5 s by default, docs/protocol.md "Members declared gone"), say so
in ``aggctl workers`` and its log, and the survivors must go on and finish training. A worker
restarted at once rejoins where the job is (the JOIN answer's round), is declared gone as well
(its old self left a round waiting), then keeps pace and is awaited again."""
from __future__ import annotations

import re
import threading
import time

import pytest
from click.testing import CliRunner

from aggd.cli.main import main as aggctl
from aggd.training.labtrain import RunParams, run
from tests.harness import readme_worker

pytestmark = pytest.mark.root

ROUNDS, KILL_AT = 200, 60
SILENT_AFTER = 5.0          #: the shipped default
#: how long the survivors may stall: the silence limit, a scan interval (a quarter of it), the
#: policy's interval and the survivors' retransmission backoff, with room for a loaded CI host
STALL_BOUND = SILENT_AFTER + SILENT_AFTER / 4 + 3.0


def longest_stall(result) -> float:
    """Longest gap between rank 0's consecutive evaluations after the kill (seconds)."""
    times = [t for t, _ in result.rounds_curve if t >= result.killed_at - 1e-3]   # (the curve's t is rounded)
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


@pytest.mark.parametrize("path", ["kernel", "user"])
def test_a_dead_worker_under_sync_is_declared_gone_and_the_others_finish(lab_daemon, path):
    lab, d = lab_daemon(4)
    job = {}
    res = run(lab, d, "sync", "none", RunParams(rounds=ROUNDS, compute_ms=10.0, target=0.9, timeout_s=180),
              on_job=job.update, kill=(3, KILL_AT), kernel_slots=None if path == "kernel" else 0)
    survivors = {w["rank"]: w for w in res.workers}
    assert sorted(survivors) == [0, 1, 2], res.workers
    assert all(w["rounds"] >= ROUNDS and w["drained"] is True for w in survivors.values()), res.workers
    assert res.final_accuracy >= 0.9
    stall = longest_stall(res)
    assert SILENT_AFTER <= stall + 1.0 and stall <= STALL_BOUND, (stall, res.rounds_curve)
    log = d.log()
    assert "rank 3 declared gone" in log and "waits for it" in log, log[-3000:]
    gone_at = int(re.search(r"rank 3 declared gone from round (\d+)", log).group(1))
    assert gone_at > KILL_AT and "declared gone" not in log.replace("rank 3 declared gone", ""), log[-3000:]


def test_the_operator_sees_why_and_a_restarted_worker_is_awaited_again(lab_daemon):
    lab, d = lab_daemon(4)
    job, seen, stop = {}, {}, threading.Event()

    def watch():
        while not stop.is_set() and "workers" not in seen:
            if job:
                w = d.call("workers", job=job["name"])
                if w["workers"][3]["gone"]:
                    seen["json"] = w
                    seen["workers"] = CliRunner().invoke(aggctl, ["--socket", d.socket, "workers",
                                                                  job["name"]]).output
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        res = run(lab, d, "sync", "none", RunParams(rounds=ROUNDS + 100, compute_ms=10.0, target=0.9,
                                                    timeout_s=240),
                  on_job=job.update, kill=(3, KILL_AT), restart=True)
    finally:
        stop.set()
        t.join(5)
    finished = sorted(w["rank"] for w in res.workers)
    assert finished == [0, 1, 2, 3], res.workers          # the restarted rank 3 finished too
    assert all(w["drained"] is True for w in res.workers), res.workers
    assert res.final_accuracy >= 0.9
    assert longest_stall(res) <= STALL_BOUND
    log = d.log()
    assert "rank 3 declared gone" in log and "rank 3 is awaited again" in log, log[-3000:]
    assert "GONE" in seen["workers"] and "rank 3 gone: silent" in seen["workers"], seen["workers"]
    assert seen["json"]["workers"][3]["gone"]["round"] > KILL_AT


def test_the_readmes_client_defaults_outlast_a_dead_workers_declaration(lab_daemon):
    """With the client's defaults (the README's code), the survivors of a SIGKILLed worker go on
    once the daemon has declared it gone (``silent_after``, 5 s): a call's ``give_up_after`` (30 s)
    outlasts it. With the 5 s default of before, the survivors gave up at the very moment the
    daemon declared the dead one gone."""
    lab, d = lab_daemon(3)
    job = d.call("jobs.create", name="readme", world=3)
    procs = [readme_worker.start(lab, w, "readme", job["token"], 400) for w in range(3)]
    try:
        for line in procs[2].stdout:          # the victim: killed after it did 50 rounds
            if int(line.split()[0]) >= 50:
                break
        procs[2].kill()
        procs[2].wait()
        for p in procs[:2]:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            rounds = [line.split() for line in stdout.splitlines()]
            assert len(rounds) == 400 and float(rounds[-1][1]) == 1.0 + 2.0, rounds[-3:]   # the two survivors
            # told once (the client's log, on stderr without a handler) that sums hold fewer
            assert stderr.count("summed 2 of 3 members' contributions (the daemon declared the others gone") == 1, \
                stderr[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "rank 2 declared gone" in d.log()
    # aggctl workers names the dead rank's last round, long after the slots' banks moved on
    dead = d.call("workers", job="readme")["workers"][2]
    assert dead["gone"] and dead["last_round"] is not None and dead["last_round"] >= 50, dead
    # gone, it slows nobody: no straggler for the detector (the policy switched jobs for it)
    assert not dead["straggler"] and dead["slowdown"] == 1.0, dead
