"""The "aggd" torch.distributed backend (aggd_client.torch) against a daemon-like aggregator on
127.0.0.1 (tests/harness/loopback_aggd.py: the registry's JOIN handling before a user-space
aggregator), with worker processes spawned by torch.multiprocessing and their settings in AGGD_*."""
from __future__ import annotations

import datetime
import socket

import numpy as np
import pytest
import torch  # a dev requirement (requirements-dev.txt): never skipped
import torch.distributed as dist

from aggd_client import quant
import aggd_client.torch as at
from aggd_client.torch.convert import stage_in, stage_out
from aggd_client.torch.settings import Settings, SettingsError

from tests.harness.allreduce_bound import allreduce_bound
from tests.harness.loopback_aggd import ELEMENTS, LoopbackAggd

from . import pg_run


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def loopback():
    with LoopbackAggd() as agg:
        yield agg


def spawn(fn, world: int, env: dict, timeout: float = 240):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = mp.spawn(fn, nprocs=world, join=False,
                     args=(world, f"tcp://127.0.0.1:{free_port()}", env, q))
    results = {}
    for _ in range(world):  # before join: the pipe is small
        status, rank, value = q.get()
        assert status == "ok", value
        results[rank] = value
    while not procs.join(timeout=timeout):
        pass
    return results


def test_allreduce_of_every_dtype_and_op_within_the_bound_plus_async_refusals_and_gloo(loopback):
    world = 2
    job = loopback.create_job("pg", world)
    reports = spawn(pg_run.collectives, world, loopback.env(job))
    r0, r1 = reports[0], reports[1]
    assert len(r0["calls"]) == len(pg_run.DTYPES) * len(pg_run.SIZES) * 2
    for c0, c1 in zip(r0["calls"], r1["calls"]):
        assert (c0["dtype"], c0["size"], c0["op"]) == (c1["dtype"], c1["size"], c1["op"])
        mean = c0["op"] == "AVG"
        np.testing.assert_array_equal(c0["got"], c1["got"])          # replicas agree
        exact = (c0["sent"] + c1["sent"]) / (world if mean else 1)
        bound = allreduce_bound([c0["sent"], c1["sent"]], ELEMENTS, c0["dtype"], mean=mean,
                                terms=world * quant.MAX_HEADROOM)   # the job's headroom
        err = np.abs(c0["got"] - exact)
        assert np.all(err <= bound), (c0["dtype"], c0["size"], c0["op"], err.max(), bound[err.argmax()])
        info = c0["info"]
        assert info["round_asked"] == info["round_answered"] == c0["call"]
        assert info["strategy"] == "sync" and info["op"] == ("mean" if mean else "sum")
        assert info["n_contrib"] == {"min": world, "max": world, "mean": float(world)}
        assert info["elements"] == c0["size"] and info["chunks"] == -(-c0["size"] // ELEMENTS)
    # two tensors, one round
    for i in range(2):
        exact = r0["pair_sent"][i] + r1["pair_sent"][i]
        assert np.abs(r0["pair_got"][i] - exact).max() < 1e-5 * max(1, np.abs(exact).max())
    assert r0["pair_info"]["elements"] == 370 and r0["pair_info"]["round_asked"] == len(r0["calls"])
    # async: rank 0's call returned before rank 1 had contributed; wait() gave the sum
    assert r0["async_returned_after"] < 0.5 and r0["async_completed_at_return"] is False
    assert r0["async_waited"] >= 0.5
    for r in (r0, r1):
        np.testing.assert_array_equal(r["async_x"], [3.0] * 3)
        np.testing.assert_array_equal(r["async_future"], [3.0] * 3)
        np.testing.assert_allclose(r["async_y"], [1.5] * 3, rtol=1e-6)
        ref = r["refusals"]
        assert "ReduceOp.MAX" in ref["max"] and ref["max"].startswith("ValueError"), ref
        assert "torch.int64" in ref["int"] and ref["int"].startswith("TypeError"), ref
        assert "meta" in ref["meta"], ref
        # refused before anything is queued: the group goes on ("after" below)
        assert ref["mixed"].startswith("TypeError") and "share a dtype" in ref["mixed"], ref
        np.testing.assert_array_equal(r["broadcast"], [1.0] * 5)
        assert [list(p) for p in r["all_gather"]] == [[0.0] * 3, [1.0] * 3]
        assert list(r["all_gather_into_tensor"]) == [10.0] * 3 + [11.0] * 3
        assert r["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert r["backend"] == "aggd"
        np.testing.assert_array_equal(r["after"], [3.0, 3.0])


def test_a_round_nobody_answers_fails_after_the_groups_timeout_and_so_do_later_ones(loopback):
    job = loopback.create_job("late", 2)
    reports = spawn(pg_run.failing, 2, loopback.env(job))
    r = reports[0]
    assert r["wait"] is not None and "timed out" in r["wait"] and "3 s" in r["wait"], r
    assert 2.5 <= r["waited"] <= 10, r
    assert r["next"] is not None and "an earlier allreduce failed" in r["next"], r
    assert r["next_took"] < 1.0


def test_a_failed_round_under_ddp_raises_from_backward_without_crashing(loopback):
    """torch's Future.set_exception is only a Python-side error: handed to DDP's C++ reducer as it
    is, it segfaulted the worker (aggd_client.torch.work explains the continuation that fixes it)."""
    job = loopback.create_job("ddpfail", 2)
    r = spawn(pg_run.ddp_timeout, 2, loopback.env(job))[0]
    steps = r["steps"]
    assert [s[1] for s in steps[:2]] == [None, None], steps
    assert len(steps) == 4, steps
    assert steps[2][1].startswith("RuntimeError") and "timed out" in steps[2][1] and "3 s" in steps[2][1], steps
    assert 2.5 <= steps[2][2] <= 10, steps
    assert "an earlier allreduce failed" in steps[3][1] and steps[3][2] < 1.0, steps


def _init_alone(**pg_options):
    dist.init_process_group("aggd", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20), pg_options=pg_options or None)


@pytest.fixture
def no_aggd_env(monkeypatch):
    for name in ("SERVER", "JOB", "TOKEN", "BIND", "GIVE_UP_AFTER", "JOIN_TIMEOUT", "ACCEPT_NEWER", "WEIGHTS",
                 "REBALANCE_EVERY", "FAILOVER_AFTER"):
        monkeypatch.delenv("AGGD_" + name, raising=False)


def test_a_missing_or_wrong_setting_is_an_error_at_init_naming_it(loopback, no_aggd_env, monkeypatch):
    job = loopback.create_job("solo", 1)
    with pytest.raises(SettingsError, match="AGGD_SERVER is not set"):
        _init_alone()
    assert not dist.is_initialized()
    env = loopback.env(job)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AGGD_TOKEN")
    with pytest.raises(SettingsError, match="AGGD_TOKEN is not set"):
        _init_alone()
    monkeypatch.setenv("AGGD_TOKEN", "wrong")
    with pytest.raises(Exception, match="the token was refused"):
        _init_alone()
    assert not dist.is_initialized()
    with pytest.raises(Exception, match="does not know job|no job 'nope'"):
        _init_alone(job="nope", token=job.token, join_timeout=3)
    with pytest.raises(SettingsError, match="AGGD_GIVE_UP_AFTER must be positive"):
        monkeypatch.setenv("AGGD_GIVE_UP_AFTER", "-1")
        _init_alone()
    monkeypatch.setenv("AGGD_GIVE_UP_AFTER", "5")
    with pytest.raises(SettingsError, match="unknown aggd pg_options"):
        _init_alone(srever="x")
    with pytest.raises(SettingsError, match="pg_options\\['server'\\] must be host:port"):
        _init_alone(server="localhost")
    # right, from pg_options over a wrong environment: init works and reduces
    _init_alone(token=job.token)
    try:
        t = torch.arange(5, dtype=torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.tolist() == [0, 1, 2, 3, 4]
        assert at.last_round_info()["n_contrib"]["min"] == 1
    finally:
        dist.destroy_process_group()


def test_a_job_of_another_size_is_refused_at_init(loopback, no_aggd_env, monkeypatch):
    job = loopback.create_job("pair", 2)
    for name, value in loopback.env(job).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="job 'pair' has 2 members but the process group has 1 ranks"):
        _init_alone()


def test_settings_from_the_environment():
    s = Settings.resolve(None, {"AGGD_SERVER": "10.0.0.1:47000", "AGGD_JOB": "7", "AGGD_TOKEN": "t ",
                                "AGGD_BIND": "10.0.0.9:41000", "AGGD_ACCEPT_NEWER": "1"})
    assert s.server == ("10.0.0.1", 47000) and s.job == 7 and s.token == "t"
    assert s.bind == ("10.0.0.9", 41000) and s.accept_newer is True and s.give_up_after == 60.0
    assert Settings.resolve({"job": "resnet"}, {"AGGD_SERVER": "h:1", "AGGD_TOKEN": "x",
                                                 "AGGD_BIND": "10.0.0.9"}).bind == ("10.0.0.9", 0)


def test_the_member_rank_setting():
    """AGGD_RANK: a rack job's member rank is not the group's (docs/hierarchy.md)."""
    env = {"AGGD_SERVER": "10.0.0.1:47000", "AGGD_JOB": "rk", "AGGD_TOKEN": "t"}
    assert Settings.resolve(None, env).member_rank(5) == 5
    assert Settings.resolve(None, {**env, "AGGD_RANK": "3"}).member_rank(5) == 3
    local = Settings.resolve(None, {**env, "AGGD_RANK": "local"})
    assert local.member_rank(5, {"LOCAL_RANK": "1"}) == 1
    with pytest.raises(SettingsError, match="needs LOCAL_RANK"):
        local.member_rank(5, {})
    for bad in ("x", "64", "-1"):
        with pytest.raises(SettingsError, match="AGGD_RANK must be `local` or a rank"):
            Settings.resolve(None, {**env, "AGGD_RANK": bad})


def test_sharded_settings():
    env = {"AGGD_SERVER": "10.0.0.1:47000,10.0.0.2:47000", "AGGD_JOB": "j", "AGGD_TOKEN": "t",
           "AGGD_WEIGHTS": "1,2.5", "AGGD_REBALANCE_EVERY": "50"}
    s = Settings.resolve(None, env)
    assert s.server == ("10.0.0.1", 47000) and s.servers == (("10.0.0.1", 47000), ("10.0.0.2", 47000))
    assert s.weights == (1.0, 2.5) and s.rebalance_every == 50 and s.failover_after is None
    assert Settings.resolve(None, {**env, "AGGD_FAILOVER_AFTER": "3"}).failover_after == 3.0
    assert s.probe_every == 5.0 and Settings.resolve(None, {**env, "AGGD_PROBE_EVERY": "0.5"}).probe_every == 0.5
    for never in ("0", "0.0", "0.00", " 0 "):
        assert Settings.resolve(None, {**env, "AGGD_PROBE_EVERY": never}).probe_every is None, never
    for bad, text in ((("AGGD_WEIGHTS", "1"), "AGGD_WEIGHTS has 1 weights for 2 servers"),
                      (("AGGD_WEIGHTS", "1,x"), "could not convert|AGGD_WEIGHTS"),
                      (("AGGD_WEIGHTS", "0,0"), "AGGD_WEIGHTS: at least one weight must be above 0"),
                      (("AGGD_REBALANCE_EVERY", "0"), "AGGD_REBALANCE_EVERY must be at least 1"),
                      (("AGGD_SERVER", "h:1,h:1"), "names a server twice"),
                      (("AGGD_FAILOVER_AFTER", "-2"), "AGGD_FAILOVER_AFTER must be positive"),
                      (("AGGD_PROBE_EVERY", "soon"), "AGGD_PROBE_EVERY must be a number of seconds")):
        with pytest.raises((SettingsError, ValueError), match=text):
            Settings.resolve(None, {**env, bad[0]: bad[1]})
    with pytest.raises(SettingsError, match="AGGD_REBALANCE_EVERY needs several servers"):
        Settings.resolve(None, {**env, "AGGD_SERVER": "h:1", "AGGD_WEIGHTS": "1"})


def test_a_job_on_two_aggregators_from_one_setting(no_aggd_env, monkeypatch):
    """AGGD_SERVER naming two aggregators with the job (one token): init joins both, every
    allreduce is cut between them (AGGD_WEIGHTS) and the maps are agreed through the group's store."""
    with LoopbackAggd() as a, LoopbackAggd() as b:
        job = a.create_job("two", 1)
        b.create_job("two", 1, token=job.token)
        for name, value in {**a.env(job), "AGGD_SERVER": f"127.0.0.1:{a.address[1]},127.0.0.1:{b.address[1]}",
                            "AGGD_WEIGHTS": "1,3", "AGGD_REBALANCE_EVERY": "2", "AGGD_FAILOVER_AFTER": "5"}.items():
            monkeypatch.setenv(name, value)
        _init_alone()
        try:
            for i in range(5):
                t = torch.arange(10 * ELEMENTS + 7, dtype=torch.float32) * (i + 1)
                dist.all_reduce(t)
                assert torch.equal(t, torch.arange(10 * ELEMENTS + 7, dtype=torch.float32) * (i + 1))
                info = at.last_round_info()
                assert info["round_asked"] == info["round_answered"] == i
            assert at.last_round_info()["chunks"] == 11
        finally:
            dist.destroy_process_group()
        assert a.agg.job_stats(job.id).counters["released"] > 0
        assert b.agg.job_stats(job.id).counters["released"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_staging_concatenates_and_copies_back_in_place(dtype):
    """The path a CUDA tensor takes (copied to host, reduced, copied back with ``copy_``), shown on
    CPU tensors including a non-contiguous one."""
    d = getattr(torch, dtype)
    a = torch.arange(6, dtype=torch.float32).to(d)
    b = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(d).t()  # not contiguous
    flat, got = stage_in([a, b])
    assert got == d and flat.size == 18 and flat.dtype == (np.float32 if dtype == "bfloat16" else np.dtype(dtype))
    stage_out([a, b], flat * 2, got)
    assert a.tolist() == [0, 2, 4, 6, 8, 10]
    assert b.tolist() == (torch.arange(12).reshape(3, 4).t() * 2).tolist() and b.dtype == d
    with pytest.raises(TypeError, match="share a dtype"):
        stage_in([a.float(), a.double()])


def test_a_tensor_at_a_freed_ones_address_does_not_inherit_its_residual():
    """The backend keys error feedback by the tensors' addresses: a tensor reduced at the address
    of one freed since (views of one buffer, temporaries the allocator places alike) took the freed
    one's residual. At 8 bits, a small tensor after a large one at the same address came back off
    by a step of the large one's scale (4.7 where the sum was 0.01)."""
    from aggd_client import AggClient
    from aggd_client.feedback import ErrorFeedback
    from aggd_client.torch.reducer import Reducer
    from tests.harness.fake_aggregator import JOB, PrecisionFake

    buf = torch.empty(1000)
    with PrecisionFake(1, quant.precision_of(8)) as fake:
        client = AggClient(fake.address, JOB, 0, 1, bind=("127.0.0.1", 0), elements=64, precision=8, seed=3,
                           give_up_after=10.0)
        reducer = Reducer(client, 60, feedback=ErrorFeedback(client, reset_every=None))
        try:
            rng = np.random.default_rng(0)
            large = buf.view(1000)
            large.copy_(torch.from_numpy(rng.standard_normal(1000).astype(np.float32) * 1000))
            reducer.submit([large], "sum").wait()
            address = large.data_ptr()
            del large                                   # the view is freed; the buffer is not
            small = buf.view(1000)
            assert small.data_ptr() == address
            want = rng.standard_normal(1000).astype(np.float32) * 0.01
            small.copy_(torch.from_numpy(want))
            reducer.submit([small], "sum").wait()
            # an 8-bit chunk's step at this scale is under 0.01 / 127 * 2; the large one's ~8
            assert np.abs(small.numpy() - want).max() < 0.001
        finally:
            reducer.close()
