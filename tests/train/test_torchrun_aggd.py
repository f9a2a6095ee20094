"""The "aggd" backend under the real torchrun against the real aggd daemon in a lab (its XDP data
plane in the aggregator namespace, the workers in worker namespaces): DDP with
``init_process_group("aggd")`` and no comm hook trains tests/train/torchrun_ddp.py, and the final
parameters must equal a gloo run of the same script within the bound that follows from aggd's
quantisation bound (tests/harness/torchrun_launch.ddp_bound). Through the XDP path (two nodes,
one torchrun each, c10d rendezvous), through the daemon's user-space path (the job's slots all in
user space), and with torchrun restarting every worker once after one crashed mid-training."""
from __future__ import annotations

import json

import numpy as np
import pytest

from aggd.training import labtrain

from tests.harness.torchrun_launch import gloo_reference, lab_launch, ddp_bound

from . import ddp_run

pytestmark = pytest.mark.root

WORLD = 2


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    run = gloo_reference(tmp_path_factory.mktemp("gloo"), WORLD)
    assert run.returncodes == [0], run.output[-3000:]
    return run


@pytest.fixture
def daemon(make_lab):
    lab = make_lab(WORLD)
    d = labtrain.lab_daemon(lab)
    try:
        yield lab, d.start()
    finally:
        d.close()


def create_job(d, name: str, **kw) -> dict:
    return d.call("jobs.create", name=name, world=WORLD, strategy="sync", **kw)


def released(d, job: dict) -> dict:
    """Results each path (kernel, userspace) released for ``job``."""
    paths = d.call("jobs.show", job=job["name"])["paths"]
    return {name: p["counters"]["released"] for name, p in paths.items()}


def check_against_gloo(run, gloo, job: dict) -> dict:
    """Every rank finished, the replicas agree, and they are within the bound of gloo's."""
    assert run.returncodes and all(c == 0 for c in run.returncodes), run.output[-6000:]
    ranks = run.ranks
    world = len(ranks)
    assert all(r for r in ranks), run.output[-6000:]
    params = [r["params"] for r in ranks]
    assert all(np.array_equal(params[0], p) for p in params)
    sent = [list(r["sent"]) for r in ranks]
    assert all(len(s) == len(sent[0]) for s in sent) and len(sent[0]) >= ddp_run.STEPS
    bound = ddp_bound(sent, job["elements"], ddp_run.STEPS, ddp_run.LR, params[0])
    ref = gloo.ranks[0]["params"]
    diff = float(np.abs(params[0] - ref).max())
    moved = float(np.abs(ref - ddp_run.train_start("float32")).max())
    print(f"max |aggd - gloo| {diff:.3g}, bound {bound:.3g}, training moved the model {moved:.3g}")
    assert diff <= bound, (diff, bound)
    assert moved > 10 * bound
    info = json.loads(str(ranks[0]["info"]))
    assert info["strategy"] == "sync" and info["n_contrib"]["min"] == world, info
    return info


def test_ddp_over_the_xdp_path_two_nodes_equals_gloo_within_the_bound(daemon, gloo, tmp_path):
    lab, d = daemon
    job = create_job(d, "tr-xdp")
    run = lab_launch(lab, f"{lab.agg_ip}:{job['port']}", job, tmp_path, nodes=2, nproc_per_node=1)
    info = check_against_gloo(run, gloo, job)
    assert info["round_answered"] == len(run.ranks[0]["sent"]) - 1
    # the rounds went through the kernel: XDP's slots released them, nothing went up to user space
    assert job["kernel_slots"] > 0, job
    paths = released(d, job)
    assert paths["kernel"] > 0 and paths["userspace"] == 0, paths


def test_ddp_over_the_userspace_path_equals_gloo_within_the_bound(daemon, gloo, tmp_path):
    lab, d = daemon
    job = create_job(d, "tr-user", kernel_slots=0)
    assert job["kernel_slots"] == 0 and job["userspace_slots"] > 0, job
    run = lab_launch(lab, f"{lab.agg_ip}:{job['port']}", job, tmp_path, nodes=1, nproc_per_node=2)
    check_against_gloo(run, gloo, job)
    paths = released(d, job)
    assert paths["userspace"] > 0 and paths["kernel"] == 0, paths


def test_torchrun_restarts_every_worker_after_a_crash_and_they_rejoin_where_the_job_is(daemon, gloo, tmp_path):
    lab, d = daemon
    job = create_job(d, "tr-restart")
    crash_step = 4
    run = lab_launch(lab, f"{lab.agg_ip}:{job['port']}", job, tmp_path, nodes=1, nproc_per_node=2,
                     max_restarts=1, crash=f"1:{crash_step}", timeout=400)
    assert f"rank 1: crashing before step {crash_step} (attempt 0)" in run.output
    info = check_against_gloo(run, gloo, job)
    first = [int(r["first_round"]) for r in run.ranks]
    assert [int(r["attempt"]) for r in run.ranks] == [1, 1]
    # the restarted group started where the job was (after the first attempt's rounds), by itself
    assert first[0] == first[1] > 0, first
    assert info["round_answered"] == first[0] + len(run.ranks[0]["sent"]) - 1, (first, info)


@pytest.mark.parametrize("fault", [None, "second aggregator's link goes down", "second daemon killed",
                                   "second aggregator's link goes down and comes back"])
def test_ddp_sharded_over_two_daemons_equals_gloo_within_the_bound(make_lab, gloo, tmp_path, fault):
    """The job on two aggregator hosts (two daemons in two aggregator namespaces, one token):
    AGGD_SERVER names both, AGGD_WEIGHTS cuts each bucket 1:2 and AGGD_REBALANCE_EVERY makes the
    members agree on maps through torchrun's store every 2 allreduces. Training equals gloo within
    the bound; both hosts released rounds in the kernel. With a fault, the second host's link goes
    down mid-training: the members fail over to the first (AGGD_FAILOVER_AFTER) and training
    still equals gloo within the bound. When the link comes back, rank 0's probe (AGGD_PROBE_EVERY)
    finds the host answering and every rank joins it again at the next agreed allreduce."""
    import signal
    import threading
    import time

    from aggd.lab.daemon import daemons_on

    lab = make_lab(WORLD, aggregators=2)
    with daemons_on(lab, prefix="aggdsh-", call_timeout=10, jobs={"default_slots": 64}) as daemons:
        job = create_job(daemons[0], "tr-shard")
        daemons[1].call("jobs.create", name="tr-shard", world=WORLD, strategy="sync", token=job["token"])
        servers = ",".join(f"{lab.agg_ip_of(i)}:{job['port']}" for i in range(2))
        settings = {"AGGD_WEIGHTS": "1,2", "AGGD_REBALANCE_EVERY": "2"}
        cut, back = threading.Event(), {}
        if fault:
            settings.update(AGGD_FAILOVER_AFTER="1", STEP_DELAY="0.2",   # the fault lands mid-training
                            AGGD_PROBE_EVERY="0.5")

            def kill_second():
                deadline = time.monotonic() + 200
                while time.monotonic() < deadline and released(daemons[1], job)["kernel"] < 3:
                    time.sleep(0.01)   # an allreduce or two in
                if fault == "second daemon killed":   # the host dies: no daemon, no XDP program
                    daemons[1].stop(signal.SIGKILL, 10)
                    lab.check_output(lab.agg_ns_of(1), ["ip", "link", "set", "dev", lab.agg_ifname, "xdp", "off"])
                else:
                    lab.set_aggregator_link(1, up=False)
                cut.set()
                if fault.endswith("comes back"):
                    time.sleep(2)
                    back["released"] = released(daemons[1], job)["kernel"]
                    lab.set_aggregator_link(1, up=True)
            killer = threading.Thread(target=kill_second, daemon=True)
            killer.start()
        run = lab_launch(lab, servers, job, tmp_path, nodes=2, nproc_per_node=1, settings=settings)
        info = check_against_gloo(run, gloo, job)
        assert info["round_answered"] == len(run.ranks[0]["sent"]) - 1   # calls, numbered from 0
        for d in daemons[:1] if fault and not back else daemons:
            paths = released(d, job)
            assert paths["kernel"] > 0 and paths["userspace"] == 0, paths
        if fault:
            assert cut.is_set() and "stopped answering" in run.output and "failed over" in run.output
            if back:    # found back by rank 0's probe, and its rounds went on
                assert "answers again" in run.output and released(daemons[1], job)["kernel"] > back["released"]
            # the stall: the slowest step over the usual one, on every rank
            for r in run.ranks:
                steps = np.asarray(r["step_seconds"])
                assert steps.max() - np.median(steps) < 2.0, steps


def test_ddp_over_two_racks_under_a_spine_equals_gloo_within_the_bound(make_lab, tmp_path):
    """Two racks behind a spine (docs/hierarchy.md): a node a rack, 2 workers each under torchrun,
    every worker's AGGD_SERVER its rack's daemon and AGGD_RANK=local (its rank in the rack's job);
    the rack jobs forward to the spine daemon's job. Training equals gloo on 4 workers within the
    bound, and every result counts all four."""
    from aggd.lab.daemon import daemons_on

    lab = make_lab(2, aggregators=3, racks=2)
    with daemons_on(lab, prefix="aggdrk-", call_timeout=10, jobs={"default_slots": 64}) as daemons:
        top = daemons[2].call("jobs.create", name="top", world=2)
        up = {"server": f"{lab.agg_ip_of(2)}:{top['port']}", "job": "top", "token": top["token"], "span": 4}
        job = daemons[0].call("jobs.create", name="rk", world=2, upstream={**up, "rank": 0})
        daemons[1].call("jobs.create", name="rk", world=2, token=job["token"], upstream={**up, "rank": 1})
        servers = [f"{lab.agg_ip_of(r)}:{job['port']}" for r in range(2)]
        run = lab_launch(lab, servers, job, tmp_path / "aggd", nodes=2, nproc_per_node=2,
                         settings={"AGGD_RANK": "local"})
        gloo4 = gloo_reference(tmp_path / "gloo", 4)
        assert gloo4.returncodes == [0], gloo4.output[-3000:]
        check_against_gloo(run, gloo4, job)
        for r in range(2):
            paths = daemons[r].call("jobs.show", job="rk")["paths"]
            assert paths["kernel"]["counters"]["forwarded"] > 0, paths
        assert released(daemons[2], top)["kernel"] > 0


def test_ddp_sharded_under_async_goes_on_when_the_second_daemon_dies(make_lab, gloo, tmp_path):
    """Failover under ``async`` (members not held within a call of each other), under torchrun: DDP
    on two daemons, the second SIGKILLed and its XDP program detached mid-training. Every rank
    finishes with no step stalled 2 s more than the usual one, both fail over from the same
    allreduce on, and training moves the model as gloo's does (an async replica applies running
    sums: its own gradient alone in some steps, so not within gloo's bound)."""
    import signal
    import threading
    import time

    from aggd.lab.daemon import daemons_on

    lab = make_lab(WORLD, aggregators=2)
    with daemons_on(lab, prefix="aggdsa-", call_timeout=10, jobs={"default_slots": 64}) as daemons:
        job = daemons[0].call("jobs.create", name="tr-async", world=WORLD, strategy="async")
        daemons[1].call("jobs.create", name="tr-async", world=WORLD, strategy="async", token=job["token"])
        servers = ",".join(f"{lab.agg_ip_of(i)}:{job['port']}" for i in range(2))
        cut = threading.Event()

        def kill_second():
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline and released(daemons[1], job)["kernel"] < 3:
                time.sleep(0.01)   # an allreduce or two in
            daemons[1].stop(signal.SIGKILL, 10)
            lab.check_output(lab.agg_ns_of(1), ["ip", "link", "set", "dev", lab.agg_ifname, "xdp", "off"])
            cut.set()
        killer = threading.Thread(target=kill_second, daemon=True)
        killer.start()
        run = lab_launch(lab, servers, job, tmp_path, nodes=2, nproc_per_node=1,
                         settings={"AGGD_WEIGHTS": "1,2", "AGGD_REBALANCE_EVERY": "2", "AGGD_FAILOVER_AFTER": "1",
                                   "STEP_DELAY": "0.2"})
        assert run.returncodes and all(c == 0 for c in run.returncodes), run.output[-6000:]
        assert cut.is_set() and "stopped answering" in run.output and "failed over" in run.output
        assert released(daemons[0], job)["kernel"] > 0
    ref = gloo.ranks[0]["params"]
    start = ddp_run.train_start("float32")
    moved = float(np.abs(ref - start).max())
    for rank, r in enumerate(run.ranks):
        steps = np.asarray(r["step_seconds"])
        assert steps.max() - np.median(steps) < 2.0, steps
        params = np.asarray(r["params"], np.float64)
        assert np.all(np.isfinite(params))
        print(f"rank {rank}: |aggd - gloo| {np.abs(params - ref).max():.3g}, "
              f"gloo moved {moved:.3g}, aggd moved {np.abs(params - start).max():.3g}")
        # trained, not diverged: it moved about as far as gloo's, towards where gloo's went
        assert np.abs(params - start).max() > 0.5 * moved
        assert np.abs(params - ref).max() < 0.75 * moved
