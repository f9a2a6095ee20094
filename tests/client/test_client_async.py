"""AggClient.allreduce_async and the strategies, against the reference model served on 127.0.0.1
(tests/harness/model_aggregator.py: every slot and strategy rule is ``aggd.core.model``'s, with a
log of every contribution and a pause). ``Scripted`` is a bare socket a test answers by hand, for
what an aggregator cannot be made to do on purpose (two answers to one chunk, junk, a later round's
result of another tensor). The same loops against the user-space aggregator (its fast path and
sockets): test_client_async_userspace.py. No privileges needed.
"""
from __future__ import annotations

import select
import socket
import threading
import time

import numpy as np
import pytest

import aggd_client
from aggd_client import (AggClient, AggdError, AllreduceHandle, NoAnswerError, ProtocolError, StrategyInfo,
                         WouldBlock, quant)
from aggd_client.client import ASYNC_OUTSTANDING, WBSP_MAX_STEPS
from aggd_client.protocol import HEADER_SIZE, Header
from aggd_client.protocol.definition import Flag, MsgType, StrategyKind

from tests.harness.client_loops import (DELAYS, E, STRATEGIES, Workers, assert_close, check_training, close_all,
                                        grad, train)
from tests.harness.model_aggregator import ModelAggregator

JOB = 5
SYNC, QUORUM, SSP, ASYNC, WBSP = (StrategyKind.SYNC, StrategyKind.QUORUM, StrategyKind.SSP,
                                  StrategyKind.ASYNC, StrategyKind.WBSP)


def model_aggregator(world: int, strategy, **kw) -> ModelAggregator:
    """The reference model serving job JOB (packets of E values) on 127.0.0.1."""
    return ModelAggregator(world, strategy, job=JOB, elements=E, **kw)


class Scripted:
    """A bare aggregator socket the test answers by hand."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = self.sock.getsockname()

    def close(self):
        self.sock.close()

    def contributions(self, n: int, timeout: float = 2.0) -> list[tuple[Header, np.ndarray, tuple]]:
        """The next ``n`` first sends (retransmissions, such as tail loss probes, are skipped)."""
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            r, _, _ = select.select([self.sock], [], [], 0.05)
            if r:
                data, src = self.sock.recvfrom(65536)
                hdr = Header.unpack(data)
                if not hdr.flags & Flag.RETRANSMIT:
                    got.append((hdr, np.frombuffer(data, "<i4", offset=HEADER_SIZE), src))
        assert len(got) == n, f"expected {n} contributions, got {len(got)}"
        return got

    def answer(self, to, round_: int, chunk: int, values, *, count: int, exponent: int = 0,
               n_contrib: int = 1, strategy=SYNC, param: int = 0, flags: int = 0, version=1):
        res = Header(type=MsgType.RESULT, job=JOB, rank=0xFFFF, round=round_, chunk=chunk,
                     count=count, exponent=exponent, n_contrib=n_contrib, strategy=strategy,
                     param=param, flags=flags, strategy_version=version)
        payload = np.zeros(E, "<i4")
        payload[:len(values)] = values
        self.sock.sendto(res.pack() + payload.tobytes(), to)


# -- helpers ---------------------------------------------------------------------------------------

def make_clients(agg, world: int, **kw) -> list[AggClient]:
    kw.setdefault("give_up_after", 10.0)
    kw.setdefault("elements", E)
    return [AggClient(agg.address, JOB, r, world, bind=("127.0.0.1", 0), **kw)
            for r in range(world)]


# -- the API -----------------------------------------------------------------------------------------

def test_exports():
    assert aggd_client.AllreduceHandle is AllreduceHandle and aggd_client.WouldBlock is WouldBlock
    assert issubclass(WouldBlock, AggdError)
    assert str(StrategyInfo.parse("quorum:3:20ms")) == "quorum:3"
    assert StrategyInfo.parse("ssp:2").max_outstanding == 3
    assert StrategyInfo.parse("async").max_outstanding == ASYNC_OUTSTANDING == 3
    assert StrategyInfo.parse("wbsp").max_outstanding == StrategyInfo().max_outstanding == 1
    assert quant.terms_for(4, WBSP) == 16 and quant.terms_for(4, QUORUM) == 8
    assert quant.terms_for(4, SSP) == quant.terms_for(4, ASYNC) == quant.terms_for(4, SYNC) == 4
    for bad in ("fast", "ssp", "quorum:x"):
        with pytest.raises(ValueError):
            StrategyInfo.parse(bad)


def test_sync_allreduce_is_allreduce_async_wait():
    world = 2
    with model_aggregator(world, "sync") as agg:
        cs = make_clients(agg, world)
        try:
            out = Workers(lambda r: [cs[r].allreduce_async(grad(r, n), op="mean").wait()
                                     for n in range(3)] + [cs[r].allreduce(grad(r, 3))],
                          range(world)).join()
            for n in range(4):
                for r in range(world):
                    assert_close(out[r][n], [grad(k, n) for k in range(world)], world, world,
                                 mean=n < 3)
            c = cs[0]
            assert c.round == 4 and c.outstanding == 0
            assert c.strategy == StrategyInfo(SYNC, 0, 1)
            # one round at a time: nothing refused (on a loaded host a retransmission may cross
            # its answer and be dropped as a duplicate)
            assert set(agg.drops) <= {"duplicate"}, agg.drops
        finally:
            close_all(cs)


def test_handles_carry_round_counts_and_strategy():
    world = 2
    with model_aggregator(world, "ssp:1") as agg:
        cs = make_clients(agg, world)
        try:
            hs = Workers(lambda r: [cs[r].allreduce_async(grad(r, 0))], range(world)).join()
            h = hs[0][0]
            h.wait()
            assert h.done() and h.round == 0 and h.step == 0
            assert h.n_contrib.tolist() == [2, 2, 2, 2]
            assert h.strategy == StrategyInfo(SSP, 1, 1) == cs[0].strategy
            assert "done" in repr(h)
        finally:
            close_all(cs)


def test_wait_timeout_then_completes():
    with model_aggregator(1, "sync") as agg:
        (c,) = make_clients(agg, 1)
        with c:
            agg.pause()
            h = c.allreduce_async(grad(0, 0))
            with pytest.raises(TimeoutError):
                h.wait(timeout=0.1)
            assert not h.done()
            agg.resume()
            assert_close(h.wait(timeout=5), [grad(0, 0)], 1, 1)


# -- ssp -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("slots", [16, 3], ids=["one-lap", "chunks-beyond-slots"])
def test_ssp_three_rounds_outstanding_then_waits(slots):
    world = 2
    size = 4 * E - 5 if slots == 16 else 10 * E - 3
    with model_aggregator(world, "ssp:2", slots=slots) as agg:
        cs = make_clients(agg, world, slots=slots)
        fast, slow = cs
        try:
            # round 0 together: the clients learn the strategy from its result
            Workers(lambda r: cs[r].allreduce(grad(r, 0, size)), range(world)).join()
            assert fast.strategy == StrategyInfo(SSP, 2, 1)
            t0 = time.monotonic()
            hs = [fast.allreduce_async(grad(0, n, size)) for n in (1, 2, 3)]
            assert time.monotonic() - t0 < 1.0  # nothing waited for the slow worker
            assert fast.outstanding == 3 and fast.round == 4 and fast.must_wait()
            assert not any(h.done() for h in hs)
            with pytest.raises(WouldBlock):
                fast.allreduce_async(grad(0, 4, size), block=False)
            assert fast.round == 4  # the refused call started nothing
            if slots == 16:  # every chunk of rounds 1..3 left before the slow worker's round 1
                assert agg.received(0, {(n, c, 0) for n in (1, 2, 3) for c in range(4)})
            else:  # keys grow per slot: round 2 waits until round 1 sent its chunks of a slot
                assert not any(r > 1 for r, _, _ in agg.sent_by(0))

            slow_rounds = Workers(lambda r: [slow.allreduce(grad(1, n, size)) for n in (1, 2, 3, 4)],
                                  [1])
            h4 = fast.allreduce_async(grad(0, 4, size))  # waits until round 1 is complete
            assert hs[0].done() and h4.round == 4
            results = [h.wait() for h in hs + [h4]]
            slow_results = slow_rounds.join()[1]
            for n, (a, b) in enumerate(zip(results, slow_results), start=1):
                contribs = [grad(0, n, size), grad(1, n, size)]
                assert_close(a, contribs, world, world)
                assert np.array_equal(a, b)
            # keys in order: nothing stale, nothing carried. The fast member's round 4 may be
            # refused busy at first: the slot keeps round 0's bank until the slow member sends a
            # round RESULT_WINDOW past it (rule 3), and the retransmission is admitted. Its tail
            # loss probes while its rounds wait for the slow one are duplicates.
            assert set(agg.drops) <= {"duplicate", "busy"} and agg.carried == 0, agg.drops
        finally:
            close_all(cs)


def test_pushing_too_early_only_wastes_packets():
    """A client that believes in ssp:2 while the job runs sync: the aggregator refuses its rounds
    ahead (busy), it retransmits them until admitted and learns the strategy from the results. (It
    believes so from round 0's result: a client's first round is answered before its next starts.)"""
    world = 2
    with model_aggregator(world, [(0, "ssp:2"), (1, "sync")]) as agg:
        cs = make_clients(agg, world, retransmit_timeout=0.02)
        try:
            Workers(lambda r: cs[r].allreduce(grad(r, 0)), range(world)).join()
            assert cs[0].strategy == StrategyInfo(SSP, 2, 1)
            hs = [cs[0].allreduce_async(grad(0, n)) for n in range(1, 4)]  # admitted by its belief
            assert cs[0].outstanding == 3
            slow = Workers(lambda r: [cs[1].allreduce(grad(1, n)) for n in range(1, 4)], [1])
            for n, h in enumerate(hs, 1):
                assert_close(h.wait(), [grad(0, n), grad(1, n)], world, world)
            slow.join()
            assert agg.drops["busy"] > 0
            assert cs[0].strategy == StrategyInfo(SYNC, 0, 2) and cs[0].must_wait() is False
        finally:
            close_all(cs)


def test_hot_swap_is_learnt_from_results():
    world = 2
    with model_aggregator(world, [(0, "sync"), (2, "ssp:2")]) as agg:
        cs = make_clients(agg, world)
        try:
            out = Workers(lambda r: [cs[r].allreduce_async(grad(r, n)) for n in range(3)],
                          range(world)).join()
            hs = out[0]
            for h in hs:
                h.wait()
            assert [h.strategy for h in hs] == [StrategyInfo(SYNC, 0, 1)] * 2 + [StrategyInfo(SSP, 2, 2)]
            assert cs[0].strategy == StrategyInfo(SSP, 2, 2)
            more = [cs[0].allreduce_async(grad(0, n)) for n in (3, 4, 5)]  # three outstanding now
            assert cs[0].must_wait()
            Workers(lambda r: [cs[1].allreduce(grad(1, n)) for n in (3, 4, 5)], [1]).join()
            for n, h in zip((3, 4, 5), more):
                assert_close(h.wait(), [grad(0, n), grad(1, n)], world, world)
        finally:
            close_all(cs)


# -- async ---------------------------------------------------------------------------------------------

def test_async_answers_at_once_with_the_running_sum():
    world = 3
    with model_aggregator(world, "async") as agg:
        cs = make_clients(agg, world)
        try:
            # only rank 0 works: every contribution is answered at once with the running sum
            h = cs[0].allreduce_async(grad(0, 0))
            assert_close(h.wait(timeout=2), [grad(0, 0)], world, world)
            assert h.n_contrib.tolist() == [1] * 4 and h.strategy.kind == ASYNC
            # up to three rounds outstanding: hold the aggregator so none is answered yet
            agg.pause()
            hs = [cs[0].allreduce_async(grad(0, n)) for n in (1, 2, 3)]
            assert cs[0].outstanding == 3 and cs[0].must_wait()
            with pytest.raises(WouldBlock):
                cs[0].allreduce_async(grad(0, 4), block=False)
            agg.resume()
            for n, h in zip((1, 2), hs):
                assert_close(h.wait(timeout=2), [grad(0, n)], world, world)
            # a slot holds at most three open async rounds (rule 3): round 3 waits, refused busy,
            # until round 0 is released
            with pytest.raises(TimeoutError):
                hs[2].wait(timeout=0.3)
            assert agg.drops["busy"] > 0
            # rank 1's round 0 joins the open bank: the running sum holds both
            h1 = cs[1].allreduce_async(grad(1, 0))
            assert_close(h1.wait(timeout=2), [grad(0, 0), grad(1, 0)], world, world)
            assert h1.n_contrib.tolist() == [2] * 4
            # rank 2 completes round 0: released to everybody, rank 0's finished round ignores it;
            # round 3 is admitted and answered with its running sum
            before = cs[0].stats["results"]
            h2 = cs[2].allreduce_async(grad(2, 0))
            assert_close(h2.wait(timeout=2), [grad(r, 0) for r in range(3)], world, world)
            assert h2.n_contrib.tolist() == [3] * 4
            assert_close(hs[2].wait(timeout=2), [grad(0, 3)], world, world)
            assert cs[0].stats["results"] == before + 4 and not cs[0].must_wait()
            assert agg.partials > 0 and set(agg.drops) <= {"busy", "duplicate"}, agg.drops
        finally:
            close_all(cs)


def test_first_result_of_a_chunk_wins_and_later_rounds_answer_stragglers():
    """Scripted answers: two results for one (round, chunk) -- the first counts; a result for a
    later round governed by quorum answers the chunk and the client catches up; one governed by
    ssp or sync does not."""
    srv = Scripted()
    try:
        with AggClient(srv.address, JOB, 0, 2, elements=E, bind=("127.0.0.1", 0),
                       retransmit_timeout=5.0, give_up_after=0.5) as c:   # (round 6 stays open)
            x = np.full(3, 1.0, np.float32)
            h = c.allreduce_async(x)
            (hdr, _, src), = srv.contributions(1)
            assert (hdr.round, hdr.chunk, hdr.count) == (0, 0, 3)
            srv.answer(src, 0, 0, [4, 4, 4], count=3, n_contrib=1, strategy=ASYNC)
            srv.answer(src, 0, 0, [8, 8, 8], count=3, n_contrib=2, strategy=ASYNC)
            assert h.wait(timeout=2).tolist() == [4.0] * 3 and h.n_contrib.tolist() == [1]
            h = c.allreduce_async(x)  # round 1
            (hdr, _, src), = srv.contributions(1)
            assert hdr.round == 1
            srv.answer(src, 7, 0, [9, 9, 9], count=3, strategy=SSP, param=2)    # not an answer
            srv.answer(src, 6, 0, [9, 9, 9], count=3, strategy=SYNC)            # nor this
            with pytest.raises(TimeoutError):
                h.wait(timeout=0.2)
            assert c.round == 2
            srv.answer(src, 5, 0, [5, 5, 5], count=3, strategy=QUORUM, param=1, flags=Flag.REREAD)
            assert h.wait(timeout=2).tolist() == [5.0] * 3
            assert h.round == 5 and h.strategy == StrategyInfo(QUORUM, 1, 1)
            assert c.round == 6 and c.strategy == StrategyInfo(QUORUM, 1, 1)
            c.allreduce_async(x)
            (hdr, _, _), = srv.contributions(1)
            assert hdr.round == 6  # caught up
    finally:
        srv.close()


# -- wbsp ----------------------------------------------------------------------------------------------

def test_wbsp_steps_share_the_round_result():
    world = 2
    with model_aggregator(world, "wbsp") as agg:
        cs = make_clients(agg, world)
        fast, slow = cs
        try:
            Workers(lambda r: cs[r].allreduce(grad(r, 0)), range(world)).join()
            assert fast.strategy.kind == WBSP
            steps = [grad(0, 1, step=s) for s in range(WBSP_MAX_STEPS)]
            hs = [fast.allreduce_async(g, op="mean") for g in steps[:3]]
            assert [h.step for h in hs] == [0, 1, 2] and fast.round == 2 and fast.outstanding == 1
            assert not fast.must_wait()  # a fourth step is still admitted
            with pytest.raises(WouldBlock):  # another shape is a new round: that waits
                fast.allreduce_async(np.ones(7, np.float32), op="mean", block=False)
            with pytest.raises(WouldBlock):  # so does another op
                fast.allreduce_async(steps[3], op="sum", block=False)
            hs.append(fast.allreduce_async(steps[3], op="mean"))
            assert hs[-1].step == 3 and fast.must_wait()
            with pytest.raises(WouldBlock):
                fast.allreduce_async(steps[0], op="mean", block=False)
            assert agg.received(0, {(1, c, s) for c in range(4) for s in range(WBSP_MAX_STEPS)})
            # quantised with wbsp's headroom: terms = 4 * world
            logged = {(c, s): e for _, k, r, c, s, _, e in agg.log if k == 0 and r == 1}
            for s, g in enumerate(steps):
                e = quant.quantise_flat(g, world, E, terms=4 * world)[1]
                assert [logged[c, s] for c in range(4)] == e.tolist()
            y = grad(1, 1)
            res = slow.allreduce(y, op="mean")
            results = [h.wait(timeout=5) for h in hs]
            assert all(r is results[0] for r in results)
            assert all(h.round == 1 and h.n_contrib.tolist() == [5] * 4 for h in hs)
            assert_close(results[0], steps + [y], world, 4 * world, mean=True)
            assert np.array_equal(res, results[0])
            assert fast.stats["steps"] == 3 and set(agg.drops) <= {"duplicate"}, agg.drops
        finally:
            close_all(cs)


# -- quorum ----------------------------------------------------------------------------------------------

def test_quorum_straggler_gets_newest_result_and_catches_up():
    world = 3
    with model_aggregator(world, "quorum:2", slots=16) as agg:
        cs = make_clients(agg, world)
        try:
            # ranks 0 and 1 run rounds 0..4 without rank 2 (the quorum of 2 releases each)
            out = Workers(lambda r: [cs[r].allreduce(grad(r, n)) for n in range(5)], (0, 1)).join()
            for n in range(5):
                assert_close(out[0][n], [grad(0, n), grad(1, n)], world, 2 * world)
            # the straggler's round 0 is late: carried into round 5, answered with round 4
            straggler = cs[2]
            x = grad(2, 0)
            h = straggler.allreduce_async(x)
            res = h.wait(timeout=5)
            assert h.round == 4 and h.strategy == StrategyInfo(QUORUM, 2, 1)
            assert np.array_equal(res, out[0][4])
            assert straggler.round == 5 and agg.carried == 4
            # round 5: the quorum of ranks 0 and 1 releases it with the carried contribution
            five = Workers(lambda r: cs[r].allreduce_async(grad(r, 5)), (0, 1)).join()
            for h5 in five.values():
                r5 = h5.wait()
                assert h5.n_contrib.tolist() == [3] * 4 and h5.round == 5
                # ranks 0/1 quantised for quorum (2 * world), the straggler for sync (world)
                assert_close(r5, [grad(0, 5), grad(1, 5), x], world, world)
            # round 5's release reaches the straggler too (the aggregator knows it now): it is
            # caught up before it sends again (its next call joins round 6 with its own gradient).
            # Its copies leave the aggregator after the others' (fan-out in rank order): poll.
            deadline = time.monotonic() + 5
            while straggler.round != 6 and time.monotonic() < deadline:
                straggler.must_wait()
                time.sleep(0.005)
            assert not straggler.must_wait() and straggler.round == 6
            assert {k for k, n, _, cause in agg.released if cause == "complete"} >= \
                {(n, c) for n in range(6) for c in range(4)}
        finally:
            close_all(cs)


def test_quorum_deadline_is_driven_by_retransmissions():
    """Only rank 0 of 2 contributes to a quorum:2 round: the deadline (0.3 s) passes unnoticed
    until a packet reaches the slot, so the client's retransmissions, capped at
    max_retransmit_interval under quorum, are what releases it."""
    world = 2
    cap = 0.04
    with model_aggregator(world, "quorum:2", timeout=0.3) as agg:
        (c,) = make_clients(agg, 1)[:0] or [AggClient(
            agg.address, JOB, 0, world, bind=("127.0.0.1", 0), elements=E, give_up_after=10,
            retransmit_timeout=0.02, max_retransmit_interval=cap)]
        with c:
            h = c.allreduce_async(grad(0, 0))  # sync assumed: backoff up to 1 s
            h.wait(timeout=5)
            assert h.n_contrib.tolist() == [1] * 4 and c.strategy.kind == QUORUM
            t0 = time.monotonic()
            h = c.allreduce_async(grad(0, 1))
            assert_close(h.wait(timeout=5), [grad(0, 1)], world, 2 * world)
            took = time.monotonic() - t0
            assert h.n_contrib.tolist() == [1] * 4
            assert took < 0.3 + cap + 0.25, took
            arrivals = sorted(t for t, k, r, ch, *_ in agg.log if r == 1 and ch == 0)
            gaps = np.diff(arrivals)
            assert len(arrivals) >= 5 and gaps.max() < cap + 0.05, gaps
            assert {cause for key, *_, cause in agg.released if key[0] == 1} == {"timeout"}


@pytest.mark.parametrize("chunks", [3, 100])
def test_under_quorum_few_chunks_in_flight_are_resent_every_timeout(chunks):
    """Under quorum, at most flow.QUORUM_STEADY_MAX chunks in flight are resent every timeout, not
    doubled (a chunk a shared slot refused ``busy`` is taken as soon as its bank frees); more
    (a round waiting for its slowest members) double up to max_retransmit_interval."""
    from aggd_client.flow import QUORUM_STEADY_MAX
    world = 2
    # rounds 0-2 under quorum:1 (answered at once: the window grows past 64), round 3 under
    # quorum:2 with rank 0 alone, released by its deadline
    with model_aggregator(world, [(0, "quorum:1"), (3, "quorum:2")], timeout=1.2, slots=128) as agg:
        c = AggClient(agg.address, JOB, 0, world, bind=("127.0.0.1", 0), elements=E, slots=128,
                      give_up_after=10, retransmit_timeout=0.03, max_retransmit_interval=0.5,
                      strategy="quorum:1")
        with c:
            for _ in range(4):
                c.allreduce(np.ones(chunks * E, np.float32))
            assert c.round == 4
            arrivals = sorted(t for t, k, r, ch, *_ in agg.log if k == 0 and r == 3 and ch == 0)
            gaps = np.diff(arrivals)
            if chunks <= QUORUM_STEADY_MAX:
                assert len(gaps) >= 15 and gaps.max() < 0.15, gaps       # every 30 ms or so
            else:
                assert len(gaps) <= 8 and gaps.max() > 0.2, gaps          # 30, 60, 120, 240, 480 ms...


def test_tail_loss_probes_do_not_back_the_timer_off():
    """A round's last chunk waits for the other member: probed three times within a few answer
    times (2, 4 and 8 srtt), then resent on its timeout (rto, 2, 4, 8 rto: 50, 100, 200, 400 ms on a
    quiet host), not on one already doubled by the probes (8, 16 rto: the chunk would wait that
    long once the member came). The wait is measured in the answer times the client learnt, which a
    loaded host stretches (CI: srtt of tens of ms, six sends in a fixed 0.8 s): 14 srtt + 20 rto
    holds the three probes and three timeouts, where timers doubled by the probes give one."""
    from aggd_client.flow import TAIL_PROBES
    world = 2
    with model_aggregator(world, "sync") as agg:
        cs = make_clients(agg, world, retransmit_timeout=0.05, give_up_after=30)
        try:
            for k in range(3):          # answer times learnt (srtt)
                hs = [c.allreduce_async(grad(r, k, E)) for r, c in enumerate(cs)]
                for h in hs:
                    h.wait(timeout=5)
            rtt = cs[0]._rtt
            wait = max(0.8, 14 * rtt.srtt + 20 * rtt.rto)
            h = cs[0].allreduce_async(grad(0, 3, E))
            expected = 1 + TAIL_PROBES + 3
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                h.done()
                sends = sorted(t for t, k, r, *_ in list(agg.log) if k == 0 and r == 3)
                if len(sends) >= expected:
                    break
                time.sleep(0.002)
            cs[1].allreduce_async(grad(1, 3, E))
            h.wait(timeout=5)
            assert len(sends) >= expected, (np.diff(sends), rtt.srtt, rtt.rto, wait)
        finally:
            close_all(cs)


def test_quorum_quantises_with_headroom_for_carried_contributions():
    world = 2
    with model_aggregator(world, "quorum:1") as agg:
        (c,) = make_clients(agg, 1)[:0] or [AggClient(
            agg.address, JOB, 0, world, bind=("127.0.0.1", 0), elements=E, strategy="quorum:1")]
        with c:
            x = grad(0, 0)
            c.allreduce(x)
            e = quant.quantise_flat(x, world, E, terms=2 * world)[1]
            assert [ex for *_, ex in sorted(agg.log, key=lambda t: t[3])] == e.tolist()


# -- errors ----------------------------------------------------------------------------------------------

def test_no_answer_fails_every_outstanding_round():
    with model_aggregator(1, "async") as agg:
        c = AggClient(agg.address, JOB, 0, 1, bind=("127.0.0.1", 0), elements=E,
                      give_up_after=0.5, strategy="async")
        with c:
            c.allreduce(grad(0, 0))   # (a round that sends new chunk indices is answered before the next)
            agg.pause()
            hs = [c.allreduce_async(grad(0, n)) for n in range(1, 4)]
            with pytest.raises(NoAnswerError) as ei:
                hs[1].wait()
            assert "rounds 1, 2, 3" in str(ei.value)
            for h in hs:
                assert h.done()
                with pytest.raises(NoAnswerError):
                    h.wait()
            assert c.outstanding == 0 and not c.must_wait()
            agg.resume()
            assert_close(c.allreduce(grad(0, 4)), [grad(0, 4)], 1, 1)  # usable again


def test_closed_client_refuses():
    with model_aggregator(1, "sync") as agg:
        (c,) = make_clients(agg, 1, give_up_after=0.5)   # close() delivers for this long
        agg.pause()
        h = c.allreduce_async(grad(0, 0))
        c.close()
        with pytest.raises(AggdError):
            h.wait()
        with pytest.raises(AggdError):
            c.must_wait()


# -- one training loop, every strategy --------------------------------------------------------------------


def run_training(agg, strategy: str, world: int = 3, rounds: int = 8):
    cs = make_clients(agg, world, slots=8, retransmit_timeout=0.02, max_retransmit_interval=0.02)
    try:
        out = Workers(lambda r: train(cs[r], r, rounds, DELAYS[r]), range(world)).join()
        check_training(out, cs, strategy, rounds, world)
        return cs
    finally:
        close_all(cs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_training_loop_runs_under_every_strategy(strategy):
    with model_aggregator(3, strategy, slots=8, timeout=0.05) as agg:
        cs = run_training(agg, strategy)
    if strategy == "wbsp":
        assert sum(c.stats["steps"] for c in cs) > 0  # the fast ones pushed steps


def test_keys_are_flagged_ordered_once_a_round_had_more_chunks_than_slots():
    """A round of 3 chunks on 2 slots makes the client wait for a slot's previous key's answer
    before its next one; from that round on it says so (Flag.ORDERED), and never before."""
    srv = Scripted()
    try:
        with AggClient(srv.address, JOB, 0, 1, elements=E, bind=("127.0.0.1", 0), slots=2,
                       retransmit_timeout=5.0) as c:
            def call(n_chunks: int) -> list[tuple[int, int, int]]:
                seen = []

                def answer(hdr, src):  # (chunk 2 is sent once chunk 0 is answered)
                    seen.append((hdr.round, hdr.chunk, hdr.flags & Flag.ORDERED))
                    srv.answer(src, hdr.round, hdr.chunk, [1] * E, count=E)
                t = _serve(srv, n_chunks, answer)
                c.allreduce(np.ones(n_chunks * E, np.float32))
                t.join()
                return sorted(seen)
            assert call(1) == [(0, 0, 0)]
            assert call(3) == [(1, ch, Flag.ORDERED) for ch in range(3)]
            assert call(1) == [(2, 0, Flag.ORDERED)]
    finally:
        srv.close()


def _serve(srv: Scripted, n: int, answer=None) -> threading.Thread:
    """Answer the next ``n`` contributions as they come, each with its own round's result of ones
    (``answer(hdr, src)``: instead, what to send), in a thread."""
    def serve():
        for _ in range(n):
            (hdr, _, src), = srv.contributions(1)
            if answer is None:
                srv.answer(src, hdr.round, hdr.chunk, [1] * E, count=hdr.count)
            else:
                answer(hdr, src)
    t = threading.Thread(target=serve)
    t.start()
    return t


def test_a_later_rounds_result_of_another_tensor():
    """A quorum answers a straggler's late contribution with its chunk's newest result, a later
    round's, which may hold another tensor. Where slots serve several chunk indices the aggregator
    keeps the straggler's own round for it, so one whose count is not this round's there answers
    nothing; else it answers the call as a quorum answers its stragglers. A result of our own
    round with another count fails the call: the members made different calls."""
    srcs = []

    def later(hdr, src):
        srcs.append(src)
        srv.answer(src, 9, 0, [7] * E, count=E, n_contrib=2, strategy=QUORUM, param=1, flags=Flag.REREAD)

    for slots in (1, 16):
        srv = Scripted()
        try:
            with AggClient(srv.address, JOB, 0, 2, elements=E, bind=("127.0.0.1", 0), slots=slots,
                           retransmit_timeout=5.0, catch_up=False) as c:
                t = _serve(srv, 2)
                c.allreduce(np.ones(2 * E, np.float32))      # on one slot: it serves two chunk indices
                t.join()
                t = _serve(srv, 1, later)
                h = c.allreduce_async(np.ones(3, np.float32))
                if slots == 1:
                    with pytest.raises(TimeoutError):
                        h.wait(timeout=0.3)
                    t.join()
                    srv.answer(srcs[-1], 1, 0, [5, 5, 5], count=3, n_contrib=2, strategy=QUORUM, param=1,
                               flags=Flag.REREAD)
                    assert h.wait(timeout=2).tolist() == [5.0] * 3
                else:
                    assert h.wait(timeout=2).tolist() == [7.0] * 3 and h.round == 9
                    t.join()
                    continue
                t = _serve(srv, 1, lambda hdr, src: srv.answer(src, hdr.round, 0, [5, 5, 5], count=1,
                                                               n_contrib=2, strategy=QUORUM, param=1))
                with pytest.raises(ProtocolError, match="count 1"):
                    c.allreduce(np.ones(3, np.float32))
                t.join()
        finally:
            srv.close()


def test_a_later_rounds_result_answering_an_older_rounds_late_packet():
    """Tensors of several sizes, two chunk indices on one slot: a quorum's result of our round 1
    (another member's, not listing us) completes the call while our contribution is still
    unanswered, and round 2 starts. The aggregator's answer to that late packet is the chunk's
    newest result, a later round's of another tensor with round 2's count there: it stops round
    1's retransmission and does not answer round 2, which waits for its own result (seen on CI as
    a call answered by the next round of a 300/5000-value job under 5% loss)."""
    srv = Scripted()
    try:
        with AggClient(srv.address, JOB, 0, 2, elements=E, bind=("127.0.0.1", 0), slots=1,
                       retransmit_timeout=5.0, catch_up=False) as c:
            t = _serve(srv, 2)
            c.allreduce(np.ones(2 * E, np.float32))          # one slot serves chunk indices 0 and 1
            t.join()
            h1 = c.allreduce_async(np.ones(E, np.float32))
            (hdr, _, src), = srv.contributions(1)
            assert (hdr.round, hdr.chunk) == (1, 0)
            srv.answer(src, 1, 0, [3] * E, count=E, n_contrib=1, strategy=QUORUM, param=1)
            assert h1.wait(timeout=2).tolist() == [3.0] * E and h1.round == 1
            h2 = c.allreduce_async(np.ones(E + 3, np.float32))
            (hdr, _, _), = srv.contributions(1)
            assert (hdr.round, hdr.chunk, hdr.count) == (2, 0, E)
            srv.answer(src, 9, 0, [7] * E, count=E, n_contrib=2, strategy=QUORUM, param=1, flags=Flag.REREAD)
            with pytest.raises(TimeoutError):
                h2.wait(timeout=0.3)
            assert not any(s.rnd.number == 1 for s in c._sends), "round 1's packet is still unanswered"
            keys = []

            def own(hdr, src):           # chunk 1 leaves once chunk 0 is answered (one slot)
                keys.append((hdr.round, hdr.chunk, hdr.count))
                srv.answer(src, 2, 1, [5] * 3, count=3, n_contrib=2, strategy=QUORUM, param=1, flags=Flag.REREAD)
            t = _serve(srv, 1, own)
            srv.answer(src, 2, 0, [5] * E, count=E, n_contrib=2, strategy=QUORUM, param=1, flags=Flag.REREAD)
            assert h2.wait(timeout=5).tolist() == [5.0] * (E + 3) and h2.round == 2
            t.join()
            assert keys == [(2, 1, 3)]
    finally:
        srv.close()


def test_close_gives_a_late_contribution_of_an_answered_round_a_short_linger():
    """A quorum released our round without us: its result completes the call while our
    contribution, late, is retransmitted to be carried. At a job's end no later round takes it
    and the aggregator refuses it until give_up_after: close() gives it ``linger`` seconds, then
    counts it abandoned. A contribution nobody has answered yet is waited for as before."""
    srv = Scripted()
    try:
        c = AggClient(srv.address, JOB, 0, 2, elements=E, bind=("127.0.0.1", 0), give_up_after=20.0,
                      catch_up=False)
        t = _serve(srv, 1, lambda hdr, src: srv.answer(src, hdr.round, 0, [3] * 3, count=3, n_contrib=1,
                                                       strategy=QUORUM, param=1))
        assert c.allreduce(np.ones(3, np.float32)).tolist() == [3.0] * 3
        t.join()
        t0 = time.monotonic()
        c.close(linger=0.3)
        assert time.monotonic() - t0 < 5.0
        assert c.stats["abandoned"] == 1

        c = AggClient(srv.address, JOB, 0, 2, elements=E, bind=("127.0.0.1", 0), give_up_after=20.0,
                      catch_up=False)
        h = c.allreduce_async(np.ones(3, np.float32))
        (hdr, _, src), = srv.contributions(1)
        threading.Timer(1.0, lambda: srv.answer(src, hdr.round, 0, [2] * 3, count=3, n_contrib=2)).start()
        t0 = time.monotonic()
        c.close(linger=0.0)
        assert time.monotonic() - t0 >= 0.9 and c.stats["abandoned"] == 0
        assert h.done()
    finally:
        srv.close()
