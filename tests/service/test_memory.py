"""What jobs cost the real daemon (issue 16): idle jobs take almost no memory and give it back when
deleted, and creating the largest job a daemon allows holds up neither aggctl nor another job's
user-space traffic. Jobs are created through the control socket, as ``aggctl jobs create`` does."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from aggd_client.membership import join

from aggd.bench.memory import create_idle_jobs, delete_jobs, process_memory, settled_memory, status_while
from aggd.dataplane.netns import in_netns

pytestmark = pytest.mark.root

MIB = 1 << 20


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def test_idle_jobs_cost_little_and_their_memory_returns_when_deleted(make_lab, make_daemon):
    lab = make_lab(1)
    # the shipped defaults: 1024 slots a job (256 values a slot: 8 MiB of sums each, were they made)
    d = make_daemon(lab, jobs={"default_slots": 1024})
    pid = d.proc.pid
    create_idle_jobs(d, 2, None, prefix="warm")   # what the first jobs load once (code, caches)
    delete_jobs(d, "warm")
    base = settled_memory(pid, 1.0)

    took = create_idle_jobs(d, 256, None)
    assert d.call("jobs.show", job="idle0")["slots"] == 1024
    idle = settled_memory(pid)
    grown = idle["rss"] - base["rss"]
    assert grown < 100 * MIB, (grown / MIB, base, idle)
    assert max(took) < 1.0, max(took)
    kept = d.state_dir / "userspace"
    assert len(list(kept.glob("job-*"))) == 256        # each job's slots are kept in files ...
    assert _disk_bytes(kept) < 64 * MIB, _disk_bytes(kept) / MIB   # ... sparse: 2 GiB of zeros unwritten

    delete_jobs(d, "idle")
    after = settled_memory(pid)
    assert after["rss"] - base["rss"] < 16 * MIB, ((after["rss"] - base["rss"]) / MIB, base, after)
    assert not list(kept.glob("job-*"))


def test_creating_the_largest_job_holds_up_neither_status_nor_another_jobs_traffic(make_lab, make_daemon):
    lab = make_lab(1)
    d = make_daemon(lab, jobs={"default_slots": 16, "max_slots": 16384})
    job = d.call("jobs.create", name="busy", world=1, slots=16, kernel_slots=0)   # served in user space
    address = d.call("status")["dataplane"]["address"]
    with in_netns(lab.worker_ns(0)):
        client = join((address, job["port"]), "busy", 0, job["token"], bind=(lab.worker_ip(0), 0), timeout=10)
    stop = threading.Event()
    gaps: list[tuple[float, float]] = []     # (start, seconds) of each allreduce
    errors = []

    def traffic():
        x = np.arange(4 * 256, dtype=np.float32)   # 4 packets a round
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                out = client.allreduce(x)
                gaps.append((t0, time.monotonic() - t0))
                assert np.allclose(out, x, atol=1e-3)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        rss0 = process_memory(d.proc.pid)["rss"]
        begin = time.monotonic()
        spent, answers = status_while(d, lambda: d.call("jobs.create", name="big", world=2, slots=16384))
        end = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(30)
        client.close()
    assert not errors, errors
    big = d.call("jobs.show", job="big")
    assert big["slots"] == 16384 and big["userspace_slots"] > 0
    assert spent < 1.0, spent
    assert answers and max(answers) < 1.0, answers
    # every allreduce around the creation (started from 1 s before it to its end) was quick
    around = [s for t0, s in gaps if begin - 1.0 <= t0 <= end]
    assert around and max(around) < 1.0, around
    assert any(t0 > end for t0, _ in gaps)     # and the job's traffic went on after it
    # 16384 slots of 256 values are 512 MiB of sums: none of it made until used
    assert process_memory(d.proc.pid)["rss"] - rss0 < 64 * MIB


def test_the_memory_bench_opens_the_active_slots_it_measures():
    """`aggctl bench memory`'s active-slot rows count slots that really opened: its sender carries
    the member tag (without it every packet was dropped bad_tag, and the per-slot figure was the
    whole job's growth over 1)."""
    import secrets

    from aggd.bench import memory

    rows = memory.run(jobs=2, active=(64,), big_slots=1024, lab_name=f"bm{secrets.token_hex(2)}")
    active = [r for r in rows if r["case"] == "active_slots"]
    assert [r["active_slots"] for r in active] == [64], active
