"""AggClient against a tiny fake aggregator on 127.0.0.1 (no privileges needed):
tests/harness/fake_aggregator.py."""
from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from aggd_client import (AggClient, AggdError, AggregationOverflowError, NoAnswerError,
                         NotMemberError, UnknownJobError)
from aggd_client.protocol import packet_dtype
from aggd_client.protocol.definition import MAGIC, MAX_ELEMENTS, VERSION, MsgType

from tests.harness.fake_aggregator import (JOB, FakeAggregator, check_close, expected_and_bound, make_arrays,
                                           run_workers)

ELEMENTS = 256


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("size", [1, ELEMENTS, ELEMENTS + 1, 3 * ELEMENTS - 5])
@pytest.mark.parametrize("world", [1, 3])
def test_sum_small(dtype, size, world, path):
    arrays = make_arrays(world, size, dtype, seed=size + world)
    with FakeAggregator(world) as fake:
        results, _ = run_workers(fake, arrays)
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    for (res,) in results:
        assert res.dtype == np.dtype(dtype)
        check_close(res, exact, bound)
    # every worker gets bit-identical results
    for (res,) in results[1:]:
        assert np.array_equal(res, results[0][0])


@pytest.mark.parametrize("dtype,world,gso", [(np.float32, 4, True), (np.float64, 2, False),
                                             (np.float16, 3, True)])
def test_sum_few_mib(dtype, world, gso, path):
    size = (3 << 20) // np.dtype(dtype).itemsize + 123  # ~3 MiB, not a multiple of a packet
    arrays = make_arrays(world, size, dtype, seed=world, scale=0.01)
    arrays = [a.reshape(-1, 1) for a in arrays]
    with FakeAggregator(world) as fake:
        # a window the fake's socket buffer takes from all workers at once; the fake (Python,
        # sharing the GIL with every worker) is slow: no needless retransmissions
        results, clients = run_workers(fake, arrays, gso=gso, window=128, retransmit_timeout=0.2)
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    for (res,) in results:
        assert res.shape == (size, 1)
        check_close(res, exact, bound)
    assert all(c.stats["results"] == -(-size // ELEMENTS) for c in clients)


def test_mean_and_rounds(path):
    world = 4
    arrays = make_arrays(world, 1000, np.float32, seed=3)
    with FakeAggregator(world) as fake:
        results, clients = run_workers(fake, arrays, op="mean", rounds=3)
        assert {k[0] for k in fake.released} == {0, 1, 2}
    exact, bound = expected_and_bound(arrays, world, ELEMENTS, op="mean")
    for rs in results:
        for res in rs:
            check_close(res, exact, bound)
    assert all(c.round == 3 for c in clients)


def test_mean_uses_n_contrib_of_result():
    # a result that says it holds 2 contributions is divided by 2, whatever the world size
    arrays = [np.full(300, 1.5, np.float32), np.full(300, 2.5, np.float32)]
    with FakeAggregator(2, n_contrib=1) as fake:
        results, _ = run_workers(fake, arrays, op="mean")
    assert np.allclose(results[0][0], 4.0, atol=1e-6)


def test_shapes_and_zeros():
    world = 2
    arrays = [np.zeros((3, 5, 7), np.float32), np.zeros((3, 5, 7), np.float32)]
    arrays[1][1, 2, 3] = -2.0
    with FakeAggregator(world) as fake:
        results, _ = run_workers(fake, arrays, elements=16)
    expected = arrays[0] + arrays[1]
    assert results[0][0].shape == (3, 5, 7)
    assert np.array_equal(results[0][0], expected)


def test_small_window_and_slots(path):
    # window 3 of 4 slots over 50 chunks: exercises the slot rule and ring wrap-around
    world = 3
    arrays = make_arrays(world, 50 * 32 - 7, np.float32, seed=9)
    with FakeAggregator(world) as fake:
        results, _ = run_workers(fake, arrays, elements=32, slots=4, window=3, rounds=2)
    exact, bound = expected_and_bound(arrays, world, 32)
    for rs in results:
        for res in rs:
            check_close(res, exact, bound)


def test_lossy_aggregator_still_correct(path):
    world = 3
    arrays = make_arrays(world, 400 * ELEMENTS + 17, np.float32, seed=5)
    with FakeAggregator(world, drop=0.05, seed=42) as fake:
        results, clients = run_workers(fake, arrays, rounds=2, retransmit_timeout=0.02,
                                       slots=128)
        assert fake.dropped > 50
        assert fake.retransmits > 0 and fake.rereads > 0
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    for rs in results:
        for res in rs:
            check_close(res, exact, bound)
    assert sum(c.stats["retransmits"] for c in clients) > 0


# small-window: a tail loss probe fires whenever at most 16 chunks are in flight, and on a loaded
# host an answer now and then comes after its probe (19 and 43 of 600 packets seen in CI runs):
# 60, a tenth of the packets, still tells probes from a storm (a retransmission of every packet)
@pytest.mark.parametrize("lost,most,slots", [(5, 4, 1024), (299, 16, 1024), (0, 60, 4)],
                         ids=["rack", "tail-probe", "small-window"])
def test_a_lost_chunk_is_resent_without_waiting_for_the_timeout(path, lost, most, slots):
    """A contribution of rank 0 lost, the retransmission timeout 5 s (beyond the 3 s give-up: the
    round would fail). ``rack``: a chunk lost while later ones are answered is resent a reordering
    window after their answers (RACK). ``tail-probe``: the round's last chunk, with nothing sent
    after it to reveal the loss, is resent two answer times after the last answer.
    ``small-window``: 4 slots, so 4 chunks in flight, sent together, and chunk 4 (then every
    later one) held until chunk 0, the one lost, is answered: nothing sent after it either."""
    world = 2
    arrays = make_arrays(world, 300 * ELEMENTS, np.float32, seed=4)
    with FakeAggregator(world, lose_once={(0, lost, 0)}) as fake:
        results, clients = run_workers(fake, arrays, retransmit_timeout=5.0, give_up_after=3.0, slots=slots)
        assert fake.dropped == 1 and not fake.lose_once
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    for res in results:
        check_close(res[0], exact, bound)
    assert clients[0].stats["retransmits"] >= 1
    assert sum(c.stats["retransmits"] for c in clients) <= most, [c.stats for c in clients]


def test_a_slow_member_does_not_shrink_the_window():
    """Timeouts while nothing later is answered are the round waiting for its slowest member, not
    losses: the fast member retransmits but keeps its window (and grows it once answers come)."""
    from aggd_client.flow import INITIAL_WINDOW
    world = 2
    arrays = make_arrays(world, 300 * ELEMENTS, np.float32, seed=3)
    with FakeAggregator(world) as fake:
        clients = [AggClient(fake.address, JOB, r, world, bind=("127.0.0.1", 0), slots=1024,
                             retransmit_timeout=0.02) for r in range(world)]
        try:
            fast = clients[0].allreduce_async(arrays[0])
            fast.done()
            time.sleep(0.05)
            for _ in range(15):  # 0.3 s of timeouts while rank 1 has sent nothing
                fast.done()
                time.sleep(0.02)
            assert clients[0].stats["retransmits"] > 0
            assert clients[0].window >= INITIAL_WINDOW
            slow = clients[1].allreduce_async(arrays[1])
            results = [None, None]
            t = threading.Thread(target=lambda: results.__setitem__(1, slow.wait(30)))
            t.start()
            results[0] = fast.wait(30)
            t.join(30)
            assert clients[0].window > INITIAL_WINDOW
        finally:
            for c in clients:
                c.close()
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    for res in results:
        check_close(res, exact, bound)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_memory_stays_modest(dtype):
    """Beyond the returned array the client needs a ring of packets, not a copy of the tensor."""
    import tracemalloc
    x = np.random.default_rng(0).standard_normal(1 << 19).astype(dtype)
    with FakeAggregator(1, remember=False) as fake:
        with AggClient(fake.address, JOB, 0, 1, bind=("127.0.0.1", 0), slots=64) as c:
            c.allreduce(x[:1000])  # sockets, ring and kernels set up
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                out = c.allreduce(x)
                peak = tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()
    assert out.shape == x.shape
    print(f"peak {peak / 2**20:.2f} MiB for a {x.nbytes / 2**20:.1f} MiB tensor")
    assert peak <= 2 * x.nbytes, f"peak {peak / 2**20:.1f} MiB for a {x.nbytes / 2**20:.1f} MiB tensor"


def test_unknown_job_nack():
    with FakeAggregator(1, job=JOB + 1) as fake:
        with pytest.raises(UnknownJobError) as ei:
            run_workers(fake, [np.ones(10, np.float32)])
    assert f"job {JOB}" in str(ei.value)
    assert f"{fake.address[0]}:{fake.address[1]}" in str(ei.value)


def test_not_member_nack():
    with FakeAggregator(2, members={0: ("127.0.0.1", 1), 1: ("127.0.0.1", 2)}) as fake:
        with pytest.raises(NotMemberError) as ei:
            run_workers(fake, [np.ones(10, np.float32)] * 2)
    assert "not a member" in str(ei.value) and f"job {JOB}" in str(ei.value)


def test_overflow_flag_raises():
    with FakeAggregator(2, overflow=True) as fake:
        with pytest.raises(AggregationOverflowError) as ei:
            run_workers(fake, [np.ones(10, np.float32)] * 2)
    assert ei.value.chunk == 0 and ei.value.job == JOB
    # what the sum held, to tell a forged or buggy sender from a round over its terms
    assert ei.value.n_contrib == 2 and "holds 2 contributions" in str(ei.value)


def test_no_server_gives_up_in_time():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # takes packets, never answers
    silent.bind(("127.0.0.1", 0))
    addr = silent.getsockname()
    try:
        with AggClient(addr, JOB, 0, 2, give_up_after=0.5, retransmit_timeout=0.05) as c:
            t0 = time.monotonic()
            with pytest.raises(NoAnswerError) as ei:
                c.allreduce(np.ones(1000, np.float32))
            waited = time.monotonic() - t0
            assert c.round == 1
    finally:
        silent.close()
    assert 0.5 <= waited < 1.5
    msg = str(ei.value)
    assert f"127.0.0.1:{addr[1]}" in msg and f"job {JOB}" in msg and "0.5" in msg
    assert isinstance(ei.value, AggdError)


def test_ignores_foreign_and_stale_results():
    """Results of other rounds, other jobs, garbage and duplicates are ignored."""
    world = 1
    fake = FakeAggregator(world)
    with fake:
        c = AggClient(fake.address, JOB, 0, world, bind=("127.0.0.1", 0))
        with c:
            junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            pkt = np.zeros(1, packet_dtype(ELEMENTS))
            pkt["hdr"]["magic"], pkt["hdr"]["version"] = MAGIC, VERSION
            pkt["hdr"]["type"], pkt["hdr"]["job"] = MsgType.RESULT, JOB
            pkt["hdr"]["round"], pkt["hdr"]["count"] = 5, ELEMENTS  # a future/other round
            pkt["payload"] = 12345
            junk.sendto(pkt.tobytes(), c.address)
            pkt["hdr"]["round"], pkt["hdr"]["job"] = 0, JOB + 1  # other job
            junk.sendto(pkt.tobytes(), c.address)
            junk.sendto(b"garbage", c.address)
            junk.close()
            x = np.arange(ELEMENTS * 2, dtype=np.float64)
            r0 = c.allreduce(x)
            r1 = c.allreduce(x * 2)
    assert np.array_equal(r0, x) and np.array_equal(r1, 2 * x)


def test_bad_arguments():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(ValueError):
            AggClient(silent.getsockname(), JOB, 2, 2)
        with pytest.raises(ValueError):
            AggClient(silent.getsockname(), JOB, 0, 65)
        with pytest.raises(ValueError):
            AggClient(silent.getsockname(), JOB, 0, 1, elements=MAX_ELEMENTS + 1)
        with AggClient(silent.getsockname(), JOB, 0, 1) as c:
            with pytest.raises(TypeError):
                c.allreduce(np.ones(4, np.int32))
            with pytest.raises(ValueError):
                c.allreduce(np.array([1.0, np.nan]))
            with pytest.raises(ValueError):
                c.allreduce(np.ones(3), op="max")
            assert c.round == 0  # nothing was sent
            assert c.allreduce(np.zeros(0, np.float32)).shape == (0,)
            assert c.round == 1
        with pytest.raises(AggdError):
            c.allreduce(np.ones(3))
    finally:
        silent.close()


def test_gso_refused_falls_back(monkeypatch):
    world = 2
    arrays = make_arrays(world, 70 * ELEMENTS, np.float32, seed=1)
    calls = []

    class NoGsoSocket(socket.socket):
        def sendmsg(self, *a, **kw):
            calls.append(1)
            raise OSError(5, "Input/output error")  # EIO: no checksum offload

    import aggd_client.client as client_mod
    monkeypatch.setattr(client_mod.socket, "socket", NoGsoSocket)
    with FakeAggregator(world) as fake:
        results, clients = run_workers(fake, arrays, gso=True)
    assert all(not c.gso and c.stats["gso_fallbacks"] == 1 for c in clients)
    assert len(calls) == world
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    check_close(results[0][0], exact, bound)


def test_gso_used_on_loopback():
    world = 2
    arrays = make_arrays(world, 200 * ELEMENTS, np.float32, seed=2)
    with FakeAggregator(world) as fake:
        results, clients = run_workers(fake, arrays, gso=True)
    assert all(c.gso and c.stats["gso_fallbacks"] == 0 for c in clients)
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    check_close(results[1][0], exact, bound)


def test_multicast_group_on_loopback():
    """Results multicast to a group on lo reach every member's group socket."""
    world = 3
    group = ("239.77.0.%d" % random.randint(1, 250), random.randint(40000, 60000))
    arrays = make_arrays(world, 3 * ELEMENTS + 3, np.float32, seed=4)
    with FakeAggregator(world, group=group) as fake:
        results, _ = run_workers(fake, arrays, group=group, rounds=2)
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    for rs in results:
        for res in rs:
            check_close(res, exact, bound)


def test_out_receives_the_result_and_bad_out_is_refused(path):
    world = 2
    arrays = make_arrays(world, 5 * ELEMENTS + 3, np.float32, seed=9)
    bufs = [np.full_like(a, np.nan) for a in arrays]
    with FakeAggregator(world) as fake:
        clients = [AggClient(fake.address, JOB, r, world, bind=("127.0.0.1", 0)) for r in range(world)]
        try:
            results = [None, None]

            def work(r):
                results[r] = [clients[r].allreduce(arrays[r], out=bufs[r]) for _ in range(2)]
            threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            c = clients[0]
            with pytest.raises(ValueError, match="shape"):
                c.allreduce(arrays[0], out=np.empty(3, np.float32))
            with pytest.raises(ValueError, match="dtype"):
                c.allreduce(arrays[0], out=np.empty_like(arrays[0], dtype=np.float64))
            with pytest.raises(ValueError, match="share memory"):
                c.allreduce(arrays[0], out=arrays[0])
            with pytest.raises(ValueError, match="contiguous"):
                c.allreduce(arrays[0], out=np.empty(arrays[0].size * 2, np.float32)[::2])
            with pytest.raises(TypeError):
                c.allreduce(arrays[0], out=[0.0] * arrays[0].size)
        finally:
            for c in clients:
                c.close()
    exact, bound = expected_and_bound(arrays, world, ELEMENTS)
    for r in range(world):
        for res in results[r]:
            assert res is bufs[r]  # the caller's buffer, filled in place
        check_close(bufs[r], exact, bound)


def _load_kernels_lazily() -> None:
    """Run in a fresh process (the kernels load once a process): see the test below."""
    from aggd_client import _fast, client as client_mod
    client_mod.FAST_AFTER_VALUES = 3 * ELEMENTS
    x = np.arange(2 * ELEMENTS, dtype=np.float32)
    with FakeAggregator(1) as fake:
        with AggClient(fake.address, JOB, 0, 1, bind=("127.0.0.1", 0), slots=64, fast=False) as never:
            for _ in range(4):
                np.testing.assert_array_equal(never.allreduce(x), x)
            assert not never._fast and not _fast.warmed()
        with AggClient(fake.address, JOB, 0, 1, bind=("127.0.0.1", 0), slots=64, first_round=4) as c:
            np.testing.assert_array_equal(c.allreduce(x), x)
            assert c._fast_loader is None and not _fast.warmed()   # 2 E values of 3 E
            np.testing.assert_array_equal(c.allreduce(x), x)       # 4 E: the load starts, numpy meanwhile
            assert not c._fast and c._fast_loader is not None
            c._fast_loader.join(60)
            assert _fast.warmed() and not c._fast
            np.testing.assert_array_equal(c.allreduce(x), x)       # the first call after it: numba
            assert c._fast
        with AggClient(fake.address, JOB, 0, 1, bind=("127.0.0.1", 0), slots=64, first_round=7) as later:
            assert later._fast                                 # already loaded in this process
    print("ok")


def test_numba_kernels_load_once_a_client_has_reduced_enough_values():
    """Loading the kernels costs a process 0.5-0.7 s of CPU: a client loads them in a thread once
    it has reduced ``FAST_AFTER_VALUES`` values and uses them from the first call after that, so a
    worker of small tensors never pays it and no call waits for it; ``fast=True`` loads them at
    once, ``fast=False`` never. The results are the same either way. Each case in a fresh
    process."""
    from aggd_client import _fast
    if not _fast.AVAILABLE:
        pytest.skip("numba not installed")
    scripts = ["from tests.client.test_client import _load_kernels_lazily; _load_kernels_lazily()"]
    for fast in ("True", "None"):
        scripts.append("from aggd_client import AggClient, _fast; "
                       f"c = AggClient(('127.0.0.1', 9), 1, 0, 1, fast={fast}); print(_fast.warmed())")
    outs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
            for script in scripts]
    assert [o.stdout.split() for o in outs] == [["ok"], ["True"], ["False"]], outs


def test_join_with_bind_none_takes_any_address():
    """``join(..., bind=None)`` binds any address and port (it raised a TypeError)."""
    from aggd_client import join
    from tests.harness.loopback_aggd import LoopbackAggd
    with LoopbackAggd() as agg:
        job = agg.create_job("anywhere", 1)
        with join(agg.address, "anywhere", 0, job.token, bind=None) as client:
            assert client.allreduce(np.ones(10, np.float32)).tolist() == [1.0] * 10
