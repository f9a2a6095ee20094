"""Workers in their own namespaces allreduce through the real XDP program on the lab's aggregator.

Every worker checks its own result against the exact float64 sum of all members' tensors and the
documented error bound (aggd.lab.worker), so each assertion here covers every member.
"""
from __future__ import annotations

import sys
import textwrap

import pytest

from aggd.lab.runner import LabJob, run_workers, xdp_aggregator

from tests.harness.lab_runs import assert_all_right

pytestmark = pytest.mark.root

DTYPES = ("float32", "float16", "float64")
ITEMSIZE = {"float16": 2, "float32": 4, "float64": 8}
SMALL = "1,256,257"  # one element, exactly one packet, one packet plus one element
MIB = 1 << 20


@pytest.mark.parametrize("world", [2, 4, 8])
def test_small_and_1mib_all_dtypes(make_lab, world):
    lab = make_lab(world)
    with xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=list(range(world)))
        dp.install_job(job.config(lab))
        for dtype in DTYPES:
            dp.install_job(job.config(lab))  # fresh slots: new worker processes start at round 0
            sizes = f"{SMALL},{MIB // ITEMSIZE[dtype]}"
            runs = run_workers(lab, job, timeout=300,
                               extra=["--sizes", sizes, "--dtypes", dtype, "--rounds", "2"])
            assert_all_right(runs, 4 * 2, dp)
        stats = dp.job_stats(1)
        assert stats.counters["released"] == 2 * (1 + 1 + 2 + MIB // 8 // 256)  # the float64 run
        assert sum(stats.drops.values()) == stats.drops["duplicate"]  # nothing malformed


#: every dtype with 2 workers; with 4 and 8 (the longest run) float32: float16's 64 MiB is twice
#: float32's values and packets (95 s of the suite with 8 workers, about 30 s with 4), and what a
#: dtype changes is the workers' own code, which 2 workers run as 8 do
@pytest.mark.parametrize("world, dtypes", [(2, DTYPES), (4, ("float32",)), (8, ("float32",))],
                         ids=["2", "4", "8"])
def test_64mib_all_dtypes(make_lab, world, dtypes):
    lab = make_lab(world)
    with xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=list(range(world)), slots=4096)
        dp.install_job(job.config(lab))
        for dtype in dtypes:
            dp.install_job(job.config(lab))
            runs = run_workers(lab, job, timeout=900,
                               extra=["--sizes", str(64 * MIB // ITEMSIZE[dtype]), "--dtypes", dtype])
            assert_all_right(runs, 1)


@pytest.mark.parametrize("frame", ["one page", "multi-buffer"])
def test_largest_packets_native_xdp_takes(make_lab, frame):
    """Native XDP's largest packets: in one page (PAGE_MAX_ELEMENTS int32, a 3410-byte frame at the
    3506-byte MTU a program without multi-buffer support takes), and at MTU 9000 (NATIVE_MAX_ELEMENTS,
    a 9014-byte frame in several buffers: the program built with XDP frags), the latter at 1% loss
    both ways, the workers receiving as NICs do (GRO). Sums are right, every packet was aggregated in
    the kernel (none handed up), and the workers read their results in trains."""
    from aggd.lab.namespaces import NATIVE_MAX_MTU, PAGE_MTU
    from aggd_client.protocol import NATIVE_MAX_ELEMENTS, PAGE_MAX_ELEMENTS

    frags = frame == "multi-buffer"
    mtu, elements = (NATIVE_MAX_MTU, NATIVE_MAX_ELEMENTS) if frags else (PAGE_MTU, PAGE_MAX_ELEMENTS)
    lab = make_lab(4, mtu=mtu, loss_percent=1.0 if frags else 0.0, gro=True)
    with xdp_aggregator(lab, elements=elements) as dp:
        assert dp.frags == frags
        job = LabJob(job=1, workers=list(range(4)))
        dp.install_job(job.config(lab))
        sizes = f"1,{elements},{elements + 1},{MIB // 4}"
        runs = run_workers(lab, job, timeout=300, elements=elements,
                           extra=["--sizes", sizes, "--dtypes", "float32", "--rounds", "2"])
        assert_all_right(runs, 4 * 2, dp)
        # the workers' veths have GRO on, as a NIC has, and results carry UDP checksums: trains of
        # them reach the client as one read each
        assert all(run.records[-1]["trains"] > 0 for run in runs), [run.records[-1] for run in runs]
        stats = dp.job_stats(1)
        assert stats.counters["released"] == 2 * (1 + 1 + 2 + -(-(MIB // 4) // elements))
        assert stats.counters["to_userspace"] == 0
        assert stats.counters["elements"] >= 4 * 2 * (MIB // 4)
        refused = {k for k, v in stats.drops.items() if v}
        assert refused <= ({"duplicate", "stale", "not_ready", "busy"} if frags else {"duplicate"}), stats.drops


def test_jumbo_packets_in_generic_mode(make_lab):
    """MAX_ELEMENTS int32 a packet (32 KiB, one datagram; no GSO) through the XDP program in generic
    (skb) mode on a lab with a 32 KiB MTU, 1% loss both ways: sums are right, every packet was
    aggregated in the kernel, and every chunk of the 4 MiB tensor was released in it."""
    from aggd_client.protocol import HEADER_SIZE, MAX_ELEMENTS

    lab = make_lab(4, mtu=HEADER_SIZE + 4 * MAX_ELEMENTS + 28, loss_percent=1.0)
    with xdp_aggregator(lab, elements=MAX_ELEMENTS, mode="generic", total_slots=128) as dp:
        job = LabJob(job=1, workers=list(range(4)), slots=128)
        dp.install_job(job.config(lab))
        sizes = f"1,{MAX_ELEMENTS},{MAX_ELEMENTS + 1},{4 * MIB // 4}"
        runs = run_workers(lab, job, timeout=300, elements=MAX_ELEMENTS, gso=False,
                           extra=["--sizes", sizes, "--dtypes", "float32", "--rounds", "2",
                                  "--give-up-after", "30"])
        assert_all_right(runs, 4 * 2, dp)
        stats = dp.job_stats(1)
        assert stats.counters["released"] == 2 * (1 + 1 + 2 + -(-(4 * MIB // 4) // MAX_ELEMENTS))
        assert stats.counters["to_userspace"] == 0
        assert stats.counters["elements"] >= 4 * 2 * (4 * MIB // 4)
        assert sum(stats.drops.values()) == stats.drops["duplicate"]


def test_native_mode_refuses_jumbo_packets(make_lab):
    from aggd.dataplane.xdp.loader import XdpError
    from aggd_client.protocol import MAX_ELEMENTS, NATIVE_MAX_ELEMENTS

    lab = make_lab(1)
    with pytest.raises(XdpError, match=f"at most {NATIVE_MAX_ELEMENTS} .*generic"):
        with xdp_aggregator(lab, elements=MAX_ELEMENTS):
            pass


def test_two_percent_loss_both_ways(make_lab):
    lab = make_lab(4, loss_percent=2.0)
    with xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=list(range(4)))
        dp.install_job(job.config(lab))
        retransmits = 0
        for dtype in DTYPES:
            dp.install_job(job.config(lab))
            runs = run_workers(lab, job, timeout=600,
                               extra=["--sizes", f"{SMALL},{MIB // ITEMSIZE[dtype]},{8 * MIB // ITEMSIZE[dtype]}",
                                      "--dtypes", dtype, "--rounds", "2", "--give-up-after", "30"])
            assert_all_right(runs, 5 * 2, dp)
            retransmits += dp.job_stats(1).counters["retransmits"]
        assert retransmits > 0  # the loss was real and was recovered from


def test_two_jobs_at_once_do_not_disturb_each_other(make_lab):
    lab = make_lab(4)
    with xdp_aggregator(lab) as dp:
        a = LabJob(job=1, workers=[0, 1], group=("239.77.0.1", 47001))
        b = LabJob(job=2, workers=[2, 3], group=("239.77.0.2", 47001))
        dp.install_job(a.config(lab))
        dp.install_job(b.config(lab))
        import concurrent.futures as cf
        with cf.ThreadPoolExecutor(2) as pool:
            fa = pool.submit(run_workers, lab, a, timeout=300,
                             extra=["--sizes", f"{SMALL},262144", "--rounds", "3", "--seed", "11"])
            fb = pool.submit(run_workers, lab, b, timeout=300,
                             extra=["--sizes", f"{SMALL},262144", "--rounds", "3", "--seed", "22"])
            assert_all_right(fa.result(), 4 * 3)
            assert_all_right(fb.result(), 4 * 3)
        for j in (1, 2):
            assert dp.job_stats(j).counters["released"] >= 3 * (3 + 1024)


ATTEMPT = textwrap.dedent("""
    import json, sys, numpy as np
    from aggd_client import AggClient, NotMemberError, UnknownJobError, NoAnswerError
    server, group, bind, job, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    addr = lambda t: (t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1]))
    try:
        with AggClient(addr(server), job, rank, 2, group=addr(group), bind=addr(bind), give_up_after=3) as c:
            c.allreduce(np.ones(10, np.float32))
        print(json.dumps({"error": None}))
    except (NotMemberError, UnknownJobError, NoAnswerError) as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
""")


def attempt(lab, worker, job, rank, port=40000):
    out = lab.check_output(lab.worker_ns(worker), [
        sys.executable, "-c", ATTEMPT, f"{lab.agg_ip}:47000", "239.77.0.1:47001",
        f"{lab.worker_ip(worker)}:{port}", str(job), str(rank)], timeout=60)
    import json
    return json.loads(out.strip().splitlines()[-1])


def test_non_member_and_forged_rank_are_refused_and_counted(make_lab):
    lab = make_lab(3)
    with xdp_aggregator(lab) as dp:
        job = LabJob(job=1, workers=[0, 1])
        dp.install_job(job.config(lab))
        outsider = attempt(lab, worker=2, job=1, rank=0)        # not a member at all
        assert outsider["error"] == "NotMemberError", outsider
        assert "job 1" in outsider["message"]
        forged = attempt(lab, worker=1, job=1, rank=0)          # member 1 claiming rank 0
        assert forged["error"] == "NotMemberError", forged
        unknown = attempt(lab, worker=0, job=9, rank=0)
        assert unknown["error"] == "UnknownJobError", unknown
        drops = dp.job_stats(1).drops
        assert drops["not_member"] >= 2
        assert dp.job_stats(None).drops["unknown_job"] >= 1
        # the job is untouched: its members still get exact sums
        runs = run_workers(lab, job, timeout=120, extra=["--sizes", SMALL, "--rounds", "2"])
        assert_all_right(runs, 3 * 2)
        # members x rounds x chunks (1 + 1 + 2): the refused packets added nothing
        assert dp.job_stats(1).counters["contributions"] == 2 * 2 * 4


def test_two_jobs_on_the_same_hosts(make_lab):
    """Two jobs whose members share both worker hosts, each 60 allreduces of 256 KiB with GSO at the
    same time: every result right and retransmissions a small share of the packets. (Before the
    client's RACK loss detection, frequent scans and timeout samples from chunks nobody overtook,
    each worker here retransmitted more packets than a run sends, ~17,000, and the runs took 5-10
    times as long as one job's.)"""
    import threading

    lab = make_lab(2)
    with xdp_aggregator(lab) as dp:
        jobs = [LabJob(job=10 + i, workers=[0, 1], group=(f"239.77.0.{i + 1}", 47001), port=40000 + i)
                for i in range(2)]
        for job in jobs:
            dp.install_job(job.config(lab))
        runs = {}

        def run(job):
            runs[job.job] = run_workers(lab, job, timeout=300, extra=[
                "--sizes", str(MIB // 4 // 4), "--rounds", "60", "--check", "last", "--reuse", "--give-up-after", "30"])

        threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(360)
        assert sorted(runs) == [10, 11]
        for job in jobs:
            for r in runs[job.job]:
                assert r.returncode == 0, f"job {job.job} rank {r.rank} failed:\n{r.stderr[-3000:]}"
                assert len(r.records) == 60 and all(rec["shape_ok"] for rec in r.records)
                last = r.records[-1]
                assert last["within_bound"], last
                assert last["retransmits"] <= 0.05 * last["packets_sent"], (job.job, last)
