"""``aggctl bench memory``: what jobs cost the real daemon in resident memory, and whether creating
a big job holds anybody up.

A lab daemon (``aggd.lab.daemon.LabDaemon``) is started and driven through its control socket, as
aggctl drives it: its resident set (``/proc/PID/status``: VmRSS, and its anonymous, file-backed and
shared parts) is read with no job (after one job was created and deleted), after ``jobs`` idle jobs of ``slots`` slots are created, and
after they are deleted; then one job served wholly in user space gets contributions into more and
more of its slots (one member of two sends, so every slot it reaches holds an open round), the
per-active-slot figure; and a job of ``big_slots`` slots is created while another thread asks for
``status`` (the longest answer is what an operator would have waited).
"""
from __future__ import annotations

import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from aggd_client.membership import request_join
from aggd_client.protocol import Header, MsgType

from aggd.dataplane.netns import in_netns
from aggd.lab.daemon import LabDaemon
from aggd.lab.namespaces import Lab

_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def process_memory(pid: int) -> dict[str, int]:
    """Resident bytes of process ``pid``: rss (VmRSS) and its anon, file and shmem parts."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            out[key] = int(rest.split()[0]) * 1024
    return {"rss": out["VmRSS"], "anon": out["RssAnon"], "file": out["RssFile"], "shmem": out["RssShmem"]}


def settled_memory(pid: int, wait: float = 0.5) -> dict[str, int]:
    """``process_memory`` after ``wait`` s (the serving thread and the policy runner finish what a
    request started)."""
    time.sleep(wait)
    return process_memory(pid)


def _delta(after: dict, before: dict) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def create_idle_jobs(d: LabDaemon, n: int, slots: int | None, world: int = 2, prefix: str = "idle") -> list[float]:
    """Create ``n`` jobs through the control socket (as ``aggctl jobs create``); seconds each took."""
    took = []
    for i in range(n):
        args = {"name": f"{prefix}{i}", "world": world}
        if slots is not None:
            args["slots"] = slots
        t0 = time.monotonic()
        d.call("jobs.create", **args)
        took.append(time.monotonic() - t0)
    return took


def delete_jobs(d: LabDaemon, prefix: str) -> None:
    for j in d.call("jobs.list"):
        if j["name"].startswith(prefix):
            d.call("jobs.delete", job=j["name"])


class Contributor:
    """Rank 0 of a job, joined from worker 0's namespace: sends one contribution per chunk (its
    round 0), so each chunk's slot holds an open round while rank 1 never sends."""

    def __init__(self, lab: Lab, d: LabDaemon, job: str, token: str) -> None:
        dataplane = d.call("status")["dataplane"]
        address = dataplane["address"]
        with in_netns(lab.worker_ns(0)):   # the socket stays in the namespace it was made in
            self.info, local = request_join((address, dataplane["port"]), job, 0, token,
                                            bind=(lab.worker_ip(0), 0))
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.bind(local)
        self.server = (address, self.info.port)
        self.payload = np.arange(self.info.elements, dtype=np.int32).tobytes()

    def send(self, chunks: range, burst: int = 128, pause: float = 0.004) -> None:
        for n, chunk in enumerate(chunks):
            # the member's tag rides in ``contributors`` (docs/protocol.md, "Member tags"): without
            # it every contribution is dropped bad_tag and no slot opens
            hdr = Header(type=MsgType.CONTRIB, job=self.info.job, rank=0, round=0, chunk=chunk,
                         count=self.info.elements, contributors=self.info.tag)
            self.sock.sendto(hdr.pack() + self.payload, self.server)
            if n % burst == burst - 1:
                time.sleep(pause)   # the user-space socket's buffer, not a loss test

    def close(self) -> None:
        self.sock.close()


def _contributions(d: LabDaemon, job: str) -> int:
    return d.call("jobs.show", job=job)["paths"]["userspace"]["counters"]["contributions"]


def _wait_contributions(d: LabDaemon, job: str, want: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    got = _contributions(d, job)
    while got < want and time.monotonic() < deadline:
        time.sleep(0.1)
        got = _contributions(d, job)
    return got


def status_while(d: LabDaemon, action: Callable[[], None], every: float = 0.02) -> tuple[float, list[float]]:
    """Run ``action`` (timed) while another thread asks for ``status`` every ``every`` s; (its
    seconds, each status answer's seconds, those started while it ran)."""
    stop = threading.Event()
    took: list[float] = []

    def ask():
        while not stop.is_set():
            t0 = time.monotonic()
            d.call("status")
            took.append(time.monotonic() - t0)
            stop.wait(every)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    try:
        action()
    finally:
        spent = time.monotonic() - t0
        stop.set()
        t.join()
    return spent, took


def run(*, jobs: int = 256, slots: int | None = None, active: tuple[int, ...] = (1024, 4096, 16384),
        big_slots: int = 16384, lab_name: str, on_row: Callable[[dict], None] = lambda r: None) -> list[dict]:
    """The measurements above, one row each (see the module docstring). ``slots``: the idle jobs'
    slots (None: the daemon's ``[jobs] default_slots``, 1024 unless configured)."""
    rows = []

    def emit(row):
        rows.append(row)
        on_row(row)

    with Lab(lab_name, 1) as lab:
        d = LabDaemon(lab, prefix="aggdm-", jobs={"default_slots": 1024, "max_slots": max(16384, big_slots, *active)})
        try:
            d.start()
            pid = d.proc.pid
            # what the first job loads once (code, caches), and a deletion's heap trim, not counted
            create_idle_jobs(d, 1, None, prefix="warm")
            delete_jobs(d, "warm")
            base = settled_memory(pid, 1.0)
            emit({"bench": "memory", "case": "no_jobs", **{f"{k}_bytes": v for k, v in base.items()}})

            took = create_idle_jobs(d, jobs, slots)
            default = d.call("jobs.list")[0]["slots"] if jobs else slots
            idle = settled_memory(pid)
            grown = _delta(idle, base)
            emit({"bench": "memory", "case": "idle_jobs", "jobs": jobs, "slots": default,
                  **{f"{k}_bytes": v for k, v in idle.items()},
                  "rss_over_no_jobs_bytes": grown["rss"],
                  "rss_per_idle_job_bytes": grown["rss"] / max(1, jobs),
                  "anon_per_idle_job_bytes": grown["anon"] / max(1, jobs),
                  "create_median_s": statistics.median(took) if took else None,
                  "create_max_s": max(took) if took else None})
            delete_jobs(d, "idle")
            after = settled_memory(pid)
            emit({"bench": "memory", "case": "idle_jobs_deleted", "jobs": jobs,
                  **{f"{k}_bytes": v for k, v in after.items()},
                  "rss_over_no_jobs_bytes": after["rss"] - base["rss"]})

            # active slots: one job, all in user space, rank 0 contributing to more and more chunks
            most = max(active)
            job = d.call("jobs.create", name="active", world=2, slots=most, kernel_slots=0)
            empty = settled_memory(pid)
            emit({"bench": "memory", "case": "empty_job", "slots": most, "kernel_slots": job["kernel_slots"],
                  **{f"{k}_bytes": v for k, v in empty.items()},
                  "rss_over_previous_bytes": empty["rss"] - after["rss"]})
            c = Contributor(lab, d, "active", job["token"])
            try:
                sent = 0
                for k in sorted(active):
                    c.send(range(sent, k))
                    sent = k
                    counted = _wait_contributions(d, "active", k)
                    if counted < k:   # a per-slot figure over slots that never opened would be made up
                        drops = d.call("jobs.show", job="active")["paths"]["userspace"]["drops"]
                        raise RuntimeError(f"only {counted} of {k} contributions reached the job's slots "
                                           f"(drops: { {r: n for r, n in drops.items() if n} })")
                    now = settled_memory(pid)
                    grown = _delta(now, empty)
                    emit({"bench": "memory", "case": "active_slots", "slots": most, "active_slots": counted,
                          "elements": c.info.elements, **{f"{k2}_bytes": v for k2, v in now.items()},
                          "rss_over_empty_job_bytes": grown["rss"],
                          "rss_per_active_slot_bytes": grown["rss"] / max(1, counted),
                          "anon_per_active_slot_bytes": grown["anon"] / max(1, counted),
                          "file_per_active_slot_bytes": grown["file"] / max(1, counted)})
            finally:
                c.close()
            d.call("jobs.delete", job="active")
            after = settled_memory(pid)
            emit({"bench": "memory", "case": "active_job_deleted",
                  **{f"{k}_bytes": v for k, v in after.items()},
                  "rss_over_no_jobs_bytes": after["rss"] - base["rss"]})

            # a big job created while status is asked for
            spent, answers = status_while(d, lambda: d.call("jobs.create", name="big", world=2, slots=big_slots))
            big = settled_memory(pid)
            emit({"bench": "memory", "case": "create_big_job", "slots": big_slots, "create_s": spent,
                  "status_answers": len(answers), "status_max_s": max(answers) if answers else None,
                  "rss_over_no_jobs_bytes": big["rss"] - base["rss"]})
            d.call("jobs.delete", job="big")
        finally:
            d.close()
    return rows
