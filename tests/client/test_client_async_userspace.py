"""allreduce_async and the strategies against the reference model (aggd.core.model) served by the
user-space aggregator (aggd.dataplane.userspace.server) on 127.0.0.1: the client and the aggregator's rules agree.

Skipped when the daemon package is not installed (the client does not depend on it).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from aggd_client import AggClient, StrategyInfo, WouldBlock
from aggd_client.protocol.definition import StrategyKind

from tests.harness.client_loops import (DELAYS, E, STRATEGIES, Workers, assert_close, check_training, close_all,
                                        grad, train)

userspace = pytest.importorskip("aggd.dataplane.userspace.server")
model = pytest.importorskip("aggd.core.model")
strategy = pytest.importorskip("aggd.core.strategy")

JOB = 13


@pytest.fixture
def agg(userspace_agg):
    return userspace_agg(E)


def job(agg, world: int, text: str, *, slots: int = 16, **kw) -> list[AggClient]:
    """Clients of a job under strategy ``text`` (quorum deadlines in the text: ``quorum:2:50ms``)."""
    kw.setdefault("give_up_after", 10.0)
    clients = [AggClient(agg.address, JOB, r, world, bind=("127.0.0.1", 0), elements=E,
                         slots=slots, **kw) for r in range(world)]
    agg.add_job(model.JobConfig(job=JOB, world=world, slots=slots, max_chunks=1 << 16,
                                members={r: c.address for r, c in enumerate(clients)},
                                elements=E, strategy=strategy.parse(text)))
    return clients


def drops(agg) -> dict:
    return {k: v for k, v in agg.stats()["jobs"][JOB]["drops"].items() if v}


def test_ssp_outstanding_rounds(agg):
    world = 2
    cs = job(agg, world, "ssp:2", slots=3)
    fast, slow = cs
    size = 10 * E - 3  # more chunks than slots: rounds share slots, keys must grow
    try:
        Workers(lambda r: cs[r].allreduce(grad(r, 0, size)), range(world)).join()
        assert fast.strategy == StrategyInfo(StrategyKind.SSP, 2, 0)
        hs = [fast.allreduce_async(grad(0, n, size)) for n in (1, 2, 3)]
        assert fast.must_wait()
        with pytest.raises(WouldBlock):
            fast.allreduce_async(grad(0, 4, size), block=False)
        slow_rounds = Workers(lambda r: [slow.allreduce(grad(1, n, size)) for n in (1, 2, 3, 4)], [1])
        h4 = fast.allreduce_async(grad(0, 4, size))
        assert hs[0].done()
        for n, h in enumerate(hs + [h4], start=1):
            assert_close(h.wait(), [grad(0, n, size), grad(1, n, size)], world, world)
        slow_rounds.join()
        # each slot keeps its round's last chunk for re-reads until both members sent it round + 3
        # (docs/protocol.md, rule 3): a later key may wait for a bank, never anything else. A
        # retransmission whose original was only slow (a loaded host) is a ``duplicate``, so those
        # are allowed up to the clients' retransmissions.
        dropped = drops(agg)
        assert set(dropped) <= {"busy", "duplicate"}, dropped
        retransmits = sum(c.stats["retransmits"] for c in cs)
        assert dropped.get("duplicate", 0) <= retransmits, (dropped, retransmits)
    finally:
        close_all(cs)


@pytest.mark.parametrize("text", ["ssp:2", "async"])
def test_many_chunks_a_slot_and_buckets_of_two_sizes(agg, text):
    """DDP-like: buckets of 527 and 218 chunks in turn on 64 slots (several chunk indices a slot),
    up to three rounds outstanding. Released rounds are taken strictly oldest first: when a newer
    one could be taken while an older kept one stayed, an older round of a chunk outlived its newer
    one, and rule 3's order test refused the chunk's next round for good (every member stuck on
    round 3, 64 chunks short)."""
    world = 4
    cs = job(agg, world, text, slots=64, give_up_after=10.0)
    sizes = (527 * E - 100, 218 * E - 50)

    def run(r):
        pending = []
        for n in range(10):
            pending.append((n, cs[r].allreduce_async(grad(r, n, sizes[n % 2]))))
            while len(pending) > 3 or (pending and pending[0][1].done()):
                n0, h = pending.pop(0)
                if text == "ssp:2":
                    assert_close(h.wait(), [grad(k, n0, sizes[n0 % 2]) for k in range(world)], world, world)
                else:
                    h.wait()
        for _, h in pending:
            h.wait()

    try:
        Workers(run, range(world)).join()
        assert set(drops(agg)) <= {"busy", "duplicate"}, drops(agg)
    finally:
        close_all(cs)


def test_wbsp_steps(agg):
    world = 2
    cs = job(agg, world, "wbsp")
    fast, slow = cs
    try:
        Workers(lambda r: cs[r].allreduce(grad(r, 0)), range(world)).join()
        steps = [grad(0, 1, step=s) for s in range(3)]
        hs = [fast.allreduce_async(g, op="mean") for g in steps]
        assert [h.step for h in hs] == [0, 1, 2]
        time.sleep(0.1)  # the steps reach the aggregator before the slow worker's contribution
        y = grad(1, 1)
        slow.allreduce(y, op="mean")
        res = [h.wait(timeout=5) for h in hs]
        assert all(r is res[0] for r in res) and hs[0].n_contrib.tolist() == [4] * 4
        assert_close(res[0], steps + [y], world, 4 * world, mean=True)
        assert drops(agg) == {}
    finally:
        close_all(cs)


def test_quorum_straggler_catches_up(agg):
    world = 3
    cs = job(agg, world, "quorum:2:10s")
    try:
        out = Workers(lambda r: [cs[r].allreduce(grad(r, n)) for n in range(5)], (0, 1)).join()
        # the straggler heard every release (fan-out to registered members): it has joined the
        # newest round seen; its call, whose tensor has as many chunks as it saw released of
        # round 4, knows round 4 is whole and joins round 5 as its own
        straggler = cs[2]
        assert not straggler.must_wait() and straggler.round == 4
        h = straggler.allreduce_async(grad(2, 5))
        # its wait runs beside rank 0's call: a packet of its lost on a loaded host (the
        # aggregator's socket full) is sent again only from there, and rank 0 needs it
        waiting = Workers(lambda r: h.wait(timeout=10), (2,))
        r0 = cs[0].allreduce(grad(0, 5))  # with rank 0 the quorum of 2 is there
        res = waiting.join()[2]
        assert h.round == 5 and np.array_equal(res, r0) and h.n_contrib.tolist() == [2] * 4
        assert_close(res, [grad(0, 5), grad(2, 5)], world, 2 * world)
        # rank 1 heard that release too: its next call is round 6
        assert not cs[1].must_wait() and cs[1].round == 6
        assert np.array_equal(out[0][4], out[1][4])
    finally:
        close_all(cs)


def test_quorum_deadline_driven_by_retransmissions(agg):
    world = 2
    cs = job(agg, world, "quorum:2:300ms", retransmit_timeout=0.02, max_retransmit_interval=0.04)
    try:
        c = cs[0]
        c.allreduce(grad(0, 0))  # only rank 0: released at the deadline
        assert c.strategy.kind == StrategyKind.QUORUM
        t0 = time.monotonic()
        h = c.allreduce_async(grad(0, 1))
        assert_close(h.wait(timeout=5), [grad(0, 1)], world, 2 * world)
        assert h.n_contrib.tolist() == [1] * 4
        assert time.monotonic() - t0 < 0.3 + 0.04 + 0.25
        assert agg.stats()["jobs"][JOB]["counters"]["timeouts"] >= 8
    finally:
        close_all(cs)


@pytest.mark.parametrize("text", STRATEGIES)  # the model admits async only 3 rounds ahead: no laggard gap
def test_one_training_loop_runs_under_every_strategy(agg, text):
    world, rounds = 3, 8
    full = text + ":50ms" if text.startswith("quorum") else text
    cs = job(agg, world, full, slots=8, retransmit_timeout=0.02, max_retransmit_interval=0.02,
             give_up_after=2.0 if text == "async" else 10.0)
    try:
        out = Workers(lambda r: train(cs[r], r, rounds, DELAYS[r]), range(world)).join()
        check_training(out, cs, text, rounds, world)
    finally:
        close_all(cs)


def test_quorum_with_more_chunks_than_slots_and_a_straggler(agg):
    """Several chunks share each slot while one member lags: the quorum's rounds never stall, every
    call completes, and no gradient is released twice. What is released, still held by an open
    round or counted ``uncarried`` (a straggler late for a round of a shared slot with no bank free
    to carry it) is the sum sent, less late contributions a quorum answered without them: a
    straggler's retransmission whose round is gone (it may be a copy of one counted, so it is never
    added: docs/protocol.md, rule 4) and a late one refused busy whose call returned before it was
    sent again. Those are few, and only stragglers' (a quorum goes on without them)."""
    world, rounds, size = 4, 15, 9 * E - 3          # 9 chunks over 4 slots
    cs = job(agg, world, "quorum:3:50ms", slots=4)
    released = []
    agg.model.on_release = lambda job_, bank, cause: released.append(
        float(np.ldexp(bank.values.astype(np.float64).sum(), -bank.exponent)))
    uncarried = []
    agg.model.on_uncarried = lambda job_, hdr, values: uncarried.append(
        float(np.ldexp(values[:hdr.count].astype(np.float64).sum(), -hdr.exponent)))
    sent = [0.0] * world

    def train_(r):
        c = cs[r]
        while c.round < rounds:
            time.sleep(0.002 * (4 if r == world - 1 else 1))
            x = np.full(size, float(1 + r + c.round % 5), np.float32)   # integers: exact sums
            c.allreduce(x)
            sent[r] += float(x.astype(np.float64).sum())
        return c.round

    try:
        assert min(Workers(train_, range(world)).join().values()) >= rounds

        def accounted() -> float:
            held = sum(float(np.ldexp(b.values.astype(np.float64).sum(), -b.exponent))
                       for s in agg.model.jobs[JOB].slots for b in s.banks
                       if b.state == model.BankState.OPEN)
            return sum(released) + held + sum(uncarried)

        # A straggler's call returns once the quorum's results are in, which can be before the
        # aggregator has read its own late packets: wait until they are counted too.
        deadline = time.monotonic() + 2
        while accounted() != sum(sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        short = sum(sent) - accounted()
        assert 0 <= short <= 0.05 * sum(sent), (short, sum(sent), agg.model.counter(JOB, "uncarried"))
    finally:
        agg.model.on_release = agg.model.on_uncarried = None
        close_all(cs)
