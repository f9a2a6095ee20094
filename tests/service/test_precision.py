"""Jobs of 8- and 16-bit contributions through a real daemon (docs/precision.md): workers in a lab
join with the token, learn the precision from the JOIN_ACK, and every result is within the narrow
precision's bound of the exact sum; the XDP program adds them in the kernel (native and generic
mode), and what it cannot take up goes through the daemon."""
from __future__ import annotations

import pytest

from aggd.lab.runner import LabJob, run_workers

from tests.harness import feedback_worker

pytestmark = pytest.mark.root

SIZES = "1,300,4096,100000"


def run(lab, d, name: str, bits: int, strategy: str = "sync", sizes: str = SIZES, **create) -> dict:
    job = d.call("jobs.create", name=name, world=4, slots=64, strategy=strategy, precision=bits, **create)
    assert job["precision"] == bits
    runs = run_workers(lab, LabJob(job=job["id"], workers=[0, 1, 2, 3], name=name, token=job["token"]),
                       timeout=180, extra=["--sizes", sizes, "--rounds", "4"])
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(r.records) == 4 * len(sizes.split(",")) and all(rec["within_bound"] for rec in r.records), \
            r.records
    return d.call("jobs.show", job=name)


@pytest.mark.parametrize("mode,room", [("native", "auto"), ("native", "never"), ("generic", "auto")])
def test_narrow_jobs_in_the_kernel(make_lab, make_daemon, mode, room):
    """Native XDP on the lab's veths cannot grow a frame: by default ("auto") the JOIN_ACK asks the
    workers for room for the result, and the program answers every contribution in its own frame;
    without ("never") each goes through the daemon's re-run of the program. Generic mode's frames
    grow."""
    lab = make_lab(4)
    d = make_daemon(lab, dataplane={"mode": mode, "narrow_room": room})
    for bits in (8, 16):
        shown = run(lab, d, f"p{bits}", bits)
        assert shown["kernel_slots"] == 64
        kernel = shown["paths"]["kernel"]
        user = shown["paths"]["userspace"]
        print(mode, bits, "kernel", kernel["counters"], "user", user["counters"])
        # every contribution was added somewhere exactly once: 4 members x 4 rounds x 4 sizes' chunks,
        # of 512 values at 8 bits (two a lane), 256 at 16
        per_packet = 512 if bits == 8 else 256
        chunks = sum(-(-int(s) // per_packet) for s in SIZES.split(","))
        added = kernel["counters"]["contributions"] + user["counters"]["contributions"]
        assert 4 * 4 * chunks <= added < 4 * 4 * sum(-(-int(s) // (per_packet - 1)) for s in SIZES.split(","))
        assert kernel["counters"]["contributions"] > 0
        assert kernel["drops"]["bad_precision"] == 0
        assert user["counters"]["contributions"] == 0     # a frame that could not grow: the kernel's slots
        if (mode, room) == ("native", "auto"):
            assert kernel["counters"]["to_userspace"] == 0   # room in every frame: none went up
        elif mode == "native":
            assert kernel["counters"]["to_userspace"] > 0    # re-run by the daemon, decided alike


def test_narrow_job_in_user_space(make_lab, make_daemon):
    """Every chunk in the daemon's user-space path (kernel_slots 0); the other strategies over
    narrow jobs: tests/client/test_precision.py and the equivalence sequences of tests/bpf."""
    lab = make_lab(4)
    d = make_daemon(lab)
    shown = run(lab, d, "u16", 16, kernel_slots=0)
    assert shown["kernel_slots"] == 0
    assert shown["paths"]["userspace"]["counters"]["contributions"] > 0
    assert shown["paths"]["kernel"]["counters"]["contributions"] == 0


@pytest.mark.parametrize("room", ["auto", "never"])
def test_narrow_jobs_in_multi_buffer_frames(make_lab, make_daemon, room):
    """At MTU 9000 (native XDP's largest packet, 2233 lanes: 4466 values at 8 bits, 2233 at 16) the
    program takes multi-buffer frames,
    which cannot grow: a narrow job's workers send room for the result and every contribution is
    answered in the kernel; without it each goes up and the daemon's re-run adds the room."""
    lab = make_lab(4, mtu=9000)
    d = make_daemon(lab, dataplane={"elements_per_packet": 2233, "narrow_room": room})
    for bits in (8, 16):
        shown = run(lab, d, f"f{bits}", bits, sizes="1,3000,100000")
        assert shown["kernel_slots"] >= 45    # every chunk of the largest tensor has a kernel slot
        kernel, user = shown["paths"]["kernel"], shown["paths"]["userspace"]
        print(room, bits, "kernel", kernel["counters"])
        chunks = (1 + 1 + 23) if bits == 8 else (1 + 2 + 45)
        assert 4 * 4 * chunks <= kernel["counters"]["contributions"] < 4 * 4 * (chunks + 1)
        assert user["counters"]["contributions"] == 0
        assert (kernel["counters"]["to_userspace"] == 0) == (room == "auto")


@pytest.mark.parametrize("path", ["kernel", "user"])
def test_error_feedback_delivers_the_gradients_when_members_scales_differ(make_lab, make_daemon, path):
    """Real worker processes with error feedback on an 8-bit job, one member's gradients 8 times
    the others' and last to send: with shared scales (the default) what 48 calls delivered stays
    within the first call's alignment of the gradients, period after period; with each member's
    own scale (shown on the kernel path) the aggregator's floors of partial sums pile up and no
    reset takes them back."""
    lab = make_lab(4)
    d = make_daemon(lab)
    job = d.call("jobs.create", name=f"ef{path}", world=4, precision=8,
                 kernel_slots=None if path == "kernel" else 0)
    for shared in ([True, False] if path == "kernel" else [True]):
        reports = feedback_worker.run(lab, job, 4, shared=shared)
        print(path, "shared" if shared else "own", [r["mean"] for r in reports])
        for r in reports:
            assert r["stats"]["resets"] == 3
            if shared:
                assert max(r["max"]) <= 2.1 and r["mean"][-1] <= r["mean"][0] + 0.1, r
            else:
                assert r["mean"][-1] > r["mean"][0] + 5, r
    paths = d.call("jobs.show", job=job["name"])["paths"]
    assert paths[path if path == "kernel" else "userspace"]["counters"]["contributions"] > 0
