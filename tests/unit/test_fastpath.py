"""The user-space fast path (aggd.dataplane.userspace.fastpath) against the plain model: random sequences of packets
(every strategy, swaps, retransmissions, late and early packets, re-reads, noise, deadlines) are
played once through ``AggregatorModel.process`` packet by packet and once through
``FastPath.process`` in batches of random sizes, the model serving what the kernel leaves; every
verdict, counter, drop and the slots' final state must be identical."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggd.dataplane.userspace import fastpath

from aggd.dataplane.userspace import kernels
from aggd.core.model import NO_JOB, AggregatorModel, BankState, Verdict
from aggd.core.robust import SUM, Combine, parse_combine
from aggd.core.strategy import StrategyTable, from_entry, parse
from aggd_client.mrecv import sockaddr_in
from aggd_client.protocol import HEADER_SIZE, DropReason, Flag, Header

from tests.fixtures.scenarios import E, JOB, addr, entry, job_config

from tests.fixtures.traffic import STRATEGY_TEXTS, Sent, Traffic, layout_of, swap_table

REC = (HEADER_SIZE + 4 * (E + 1) + 7) // 8 * 8   # the largest noise packet carries E + 1 values


def new_model(world: int, slots: int, entries, precision: int = 0, combine: Combine = SUM) -> AggregatorModel:
    m = AggregatorModel(E, userspace=True, arithmetic=kernels.KERNEL_ARITHMETIC)
    m.add_job(dataclasses.replace(job_config(world, slots, 8), precision=precision, combine=combine))
    m.set_strategy(JOB, entries)
    return m


def record(shape: int, ops: list[int], text: str, swaps: list[tuple[int, str, int]], precision: int = 0,
           combine: Combine = SUM):
    """The sequence through the plain model: [(sent, verdict) or ("swap", entries)], the model."""
    world, slots = (4, 4, 4, 3, 2, 1, 4, 4)[shape % 8], 1 + (shape >> 3) % 2
    chunks, window = (1, 2, 3, 4, 8)[(shape >> 4) % 5], 1 + (shape >> 7) % 4
    traffic = Traffic(world=world, slots=slots, chunks=layout_of(shape, chunks), max_chunks=8, window=window, elements=E,
                      junk=True, noise=bool(shape >> 9 & 1), precision=precision)
    entries = [entry(text)]
    m = new_model(world, slots, entries, precision, combine)
    table = StrategyTable(parse("sync"))
    table.entries = [(e.version, e.from_round, from_entry(e)) for e in entries]
    steps, pending = [], sorted(swaps)
    for i, op in enumerate(ops):
        while pending and pending[0][0] <= i:
            _, swap_text, ahead = pending.pop(0)
            new = swap_table(table, table.entries[-1][0] + 1, m, traffic, swap_text, ahead)
            m.set_strategy(JOB, new)
            steps.append(("swap", new))
        sent = traffic.next(op)
        v = m.process(sent.data, sent.src, sent.now_ns)
        traffic.observe(sent, v)
        steps.append((sent, v))
    return (world, slots, entries, precision, combine), steps, m


def replay(setup, steps, cuts: list[int], tally: collections.Counter | None = None):
    """The same packets through the fast path in batches (cut also at every swap); per packet
    (verdict, what the kernel did: fastpath.SLOW when the model decided), the model, the fast path.
    ``tally["model carried"]``: the late contributions the model carried (the rest, the kernel's)."""
    world, slots, entries, precision, combine = setup
    m = new_model(world, slots, entries, precision, combine)
    fp = fastpath.FastPath()
    fp.add_job(m, JOB)
    batch = fastpath.Batch(64, REC)
    stage = memoryview(batch.stage).cast("B")
    got: list[tuple[Verdict | None, int]] = []
    cuts = collections.deque(cuts)
    pos = 0
    while pos < len(steps):
        if steps[pos][0] == "swap":
            m.set_strategy(JOB, steps[pos][1])
            fp.refresh(JOB)
            pos += 1
            continue
        size = 1 + (cuts[0] if cuts else 63) % 64
        cuts.rotate(-1)
        packets = []
        while pos < len(steps) and steps[pos][0] != "swap" and len(packets) < size:
            packets.append(steps[pos][0])
            pos += 1
        for i, sent in enumerate(packets):
            assert len(sent.data) <= REC
            batch.stage[i, :len(sent.data)] = np.frombuffer(sent.data, np.uint8)
            batch.sizes[i] = len(sent.data)
            batch.names[i] = np.frombuffer(sockaddr_in(sent.src), np.uint8)
            batch.nows[i] = sent.now_ns

        def slow(i, packets=packets):
            before = m.counter(JOB, "carried")
            v = m.process(stage[i * REC:i * REC + int(batch.sizes[i])], packets[i].src, packets[i].now_ns)
            if tally is not None:
                tally["model carried"] += m.counter(JOB, "carried") - before
            return v

        slow_verdicts = fp.process(batch, len(packets), slow)
        for i, sent in enumerate(packets):
            if i in slow_verdicts:
                assert batch.out_kind[i] == fastpath.SLOW
                got.append((slow_verdicts[i], fastpath.SLOW))
            else:
                got.append((fp.verdict(batch, i, sent.src), int(batch.out_kind[i])))
    return got, m, fp


def bank_state(m: AggregatorModel):
    """Every slot's banks (a robust job's rows of its members too) and late memories (slots are
    made when first used: each is looked at, so a slot one model made and the other did not
    compares too)."""
    slots = m.jobs[JOB].slots
    return [[(b.state, b.key, b.bitmap, b.late, b.n_contrib, b.carried, b.exponent, b.flags, b.version, b.kind, b.param,
              b.timeout_us, b.t_first, b.unannounced, b.holding, [x & 0xFF for x in b.steps], b.values.tolist(),
              None if b.rows is None else [(b.rows[r].tolist(), int(b.row_exp[r]))
                                           for r in range(len(b.rows)) if b.bitmap >> r & 1])
             for b in slot.banks] + [sorted((r, mem.round, mem.refused, mem.carried) for r, mem in slot.late.items()
                                            if (mem.round, mem.refused, mem.carried) != (None, 0, 0))]
            for slot in (slots[s] for s in range(len(slots)))]


def describe(v: Verdict | None) -> str:
    if v is None or v.out is None:
        return repr(v)
    return f"{v.action} {v.dest} {v.addrs} {Header.unpack(v.out)} {np.frombuffer(v.out, '<i4', offset=HEADER_SIZE)}"


def same_verdicts(got, steps):
    """Each replayed packet's (verdict, who decided it), once its verdict is the model's."""
    expected = [v for s, v in steps if s != "swap"]
    assert len(got) == len(expected)
    for i, ((v, kind), want) in enumerate(zip(got, expected)):
        assert v == want, (f"packet {i} ({'model' if kind == fastpath.SLOW else 'kernel'}): got {describe(v)}, "
                           f"model {describe(want)}")
        yield v, kind


KIND_TEXTS = STRATEGY_TEXTS + ("quorum:2:1ms",)
decided = collections.Counter()


def sequence_property(texts, examples: int, **extra):
    """The property tests' settings and a sequence's arguments (shape, ops, text, swaps, cuts), its
    strategies from ``texts``; ``extra``: a test's other arguments."""
    args = given(shape=st.integers(0, 2**10 - 1), ops=st.lists(st.integers(0, 2**32 - 1), min_size=20, max_size=120),
                 text=st.sampled_from(texts),
                 swaps=st.lists(st.tuples(st.integers(0, 119), st.sampled_from(texts), st.integers(0, 2)), max_size=3),
                 cuts=st.lists(st.integers(0, 63), min_size=1, max_size=8), **extra)
    return lambda test: settings(max_examples=examples, deadline=None, database=None,
                                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(args(test))


@sequence_property(KIND_TEXTS, 400, precision=st.sampled_from((0, 0, 1, 2)))
def test_fast_path_decides_as_the_model(shape, ops, text, swaps, cuts, precision):
    setup, steps, ref = record(shape, ops, text, swaps, precision)
    tally = collections.Counter()
    got, m, fp = replay(setup, steps, cuts, tally)
    decided["carried"] += m.counter(JOB, "carried") - tally["model carried"]   # rule 4, by the kernel
    for v, kind in same_verdicts(got, steps):
        decided[kind] += 1
        if precision and kind != fastpath.SLOW:
            decided["narrow"] += 1
        if kind == fastpath.DROPPED:
            decided[v.reason] += 1
        if kind == fastpath.TO_SENDER and Header.unpack(v.out).flags & Flag.REREAD:
            decided["reread"] += 1             # rule 2: a retransmission into its released round
    fp.sync()
    assert m.counters(JOB).tolist() == ref.counters(JOB).tolist()
    assert m.drops(JOB).tolist() == ref.drops(JOB).tolist()
    assert m.drops(NO_JOB).tolist() == ref.drops(NO_JOB).tolist()
    assert m.stats() == ref.stats()
    assert bank_state(m) == bank_state(ref)
    assert m.jobs[JOB].members.tolist() == ref.jobs[JOB].members.tolist()    # per-member counters


ROBUST_TEXTS = ("sync", "quorum:3:10ms", "quorum:2:10ms", "ssp:1", "ssp:2", "quorum:2:1ms")


@sequence_property(ROBUST_TEXTS, 150, precision=st.sampled_from((0, 1, 2)),
                   how=st.sampled_from(("median", "trimmed:1", "zeno")))
def test_fast_path_decides_as_the_model_for_robust_jobs(shape, ops, text, swaps, cuts, precision, how):
    """A robust job's rows, results and score terms (docs/protocol.md, "Robust jobs"): the kernel
    keeps rows and combines them at the release as the model does."""
    setup, steps, ref = record(shape, ops, text, swaps, precision, parse_combine(how))
    got, m, fp = replay(setup, steps, cuts)
    for v, kind in same_verdicts(got, steps):
        decided["robust " + ("model" if kind == fastpath.SLOW else "kernel")] += 1
        if kind == fastpath.TO_GROUP:
            decided["robust released"] += 1
    fp.sync()
    assert m.stats() == ref.stats()
    assert bank_state(m) == bank_state(ref)
    assert m.jobs[JOB].members.tolist() == ref.jobs[JOB].members.tolist()
    assert np.allclose(m.jobs[JOB].scores, ref.jobs[JOB].scores, rtol=1e-9, atol=0)


def test_the_kernel_decided_most_packets():
    """The property above is not vacuous: most of its packets were the kernel's, of every kind
    (it runs first)."""
    if not decided:
        test_fast_path_decides_as_the_model()
    kernel = sum(decided[k] for k in (fastpath.ABSORBED, fastpath.DROPPED, fastpath.TO_GROUP, fastpath.TO_SENDER))
    assert kernel > decided[fastpath.SLOW] > 0, decided
    assert decided["narrow"] > 0, decided          # int8 and int16 jobs' packets too
    if decided["robust kernel"]:                    # (when the robust property ran before)
        assert decided["robust released"] > 0, decided
    for what in (fastpath.ABSORBED, fastpath.TO_GROUP, fastpath.TO_SENDER, DropReason.BUSY, DropReason.DUPLICATE,
                 "reread", "carried"):
        assert decided[what] > 0, (what, decided)


def test_rounds_full_of_carries_as_the_model():
    """The fixture scenario of a quorum round full of carries (tests/fixtures/scenarios.py): the
    kernel's carries count as the model's, and what it leaves to the model (a carry past a full
    round) is decided there, in batches of every size."""
    from tests.fixtures.scenarios import SCENARIOS, T0_NS
    sc = SCENARIOS["a quorum round full of carries takes no more: the straggler's later ones go on to later rounds"]
    ref = new_model(sc.world, sc.slots, list(sc.table))
    steps = []
    for t_us, pkt, _ in sc.steps:
        sent = Sent(pkt.build(E), addr(pkt.rank), T0_NS + t_us * 1000)
        steps.append((sent, ref.process(sent.data, sent.src, sent.now_ns)))
    for cut in (0, 1, 2, 5, 63):
        got, m, fp = replay((sc.world, sc.slots, list(sc.table), 0, SUM), steps, [cut])
        kinds = collections.Counter(kind for _, kind in same_verdicts(got, steps))
        assert kinds[fastpath.SLOW] < len(steps)
        fp.sync()
        assert m.counters(JOB).tolist() == ref.counters(JOB).tolist()
        assert bank_state(m) == bank_state(ref)


def test_a_release_observer_sees_every_release():
    """With ``on_release`` set the model decides everything, so the observer misses nothing."""
    setup, steps, ref = record(0, list(range(0, 4 * 40)), "sync", [])
    world, slots, entries, precision, combine = setup
    m = new_model(world, slots, entries, precision, combine)
    fp = fastpath.FastPath()
    fp.add_job(m, JOB)
    released = []
    m.on_release = lambda job, bank, cause: released.append(bank.key)
    batch = fastpath.Batch(64, REC)
    sents = [s for s, _ in steps][:64]
    for i, sent in enumerate(sents):
        batch.stage[i, :len(sent.data)] = np.frombuffer(sent.data, np.uint8)
        batch.sizes[i] = len(sent.data)
        batch.names[i] = np.frombuffer(sockaddr_in(sent.src), np.uint8)
    verdicts = fp.process(batch, len(sents), lambda i: m.process(sents[i].data, sents[i].src, 0))
    assert len(verdicts) == len(sents)              # every packet was the model's
    assert len(released) == m.counter(JOB, "released") > 0


def test_state_changed_by_the_kernel_reaches_the_objects():
    """``sync`` (and a slow-path packet of the slot) bring the kernel's bank changes to the model's objects."""
    setup, steps, ref = record(0, [0, 1, 2], "sync", [])     # ranks 0-2 contribute to round 0, chunk 0
    world, slots, entries, precision, combine = setup
    m = new_model(world, slots, entries, precision, combine)
    fp = fastpath.FastPath()
    fp.add_job(m, JOB)
    batch = fastpath.Batch(4, REC)
    sents = [s for s, _ in steps]
    for i, sent in enumerate(sents):
        batch.stage[i, :len(sent.data)] = np.frombuffer(sent.data, np.uint8)
        batch.sizes[i] = len(sent.data)
        batch.names[i] = np.frombuffer(sockaddr_in(sent.src), np.uint8)
        batch.nows[i] = sent.now_ns
    bank = m.jobs[JOB].slots[0].banks[0]          # the slot's objects, made before the kernel runs
    assert fp.process(batch, len(sents), lambda i: None) == {}
    assert bank.state == BankState.EMPTY          # not synced yet
    fp.sync()
    assert (bank.state, bank.key) == (BankState.OPEN, (0, 0))
    assert bank_state(m) == bank_state(ref)


def test_packets_that_reach_no_slot_make_none():
    """A slot's objects are made only when the model's rules reach it: foreign packets naming
    chunks (not a member, a bad rank) leave every slot unmade."""
    setup, steps, ref = record(0, [0], "sync", [])
    world, slots, entries, precision, combine = setup
    m = new_model(world, slots, entries, precision, combine)
    fp = fastpath.FastPath()
    fp.add_job(m, JOB)
    batch = fastpath.Batch(4, REC)
    sent = steps[0][0]
    sends = [(0, ("10.9.9.9", 9)), (world, sent.src)]    # rank 0 from elsewhere; a rank past the world
    for i, (rank, src) in enumerate(sends):
        data = bytearray(sent.data)
        data[fastpath.O_RANK:fastpath.O_RANK + 2] = rank.to_bytes(2, "big")
        batch.stage[i, :len(data)] = np.frombuffer(bytes(data), np.uint8)
        batch.sizes[i] = len(data)
        batch.names[i] = np.frombuffer(sockaddr_in(src), np.uint8)
    verdicts = fp.process(batch, 2, lambda i: m.process(bytes(batch.stage[i, :batch.sizes[i]]), sends[i][1], 0))
    assert [v.reason for v in verdicts.values()] == [DropReason.NOT_MEMBER, DropReason.BAD_RANK]
    assert m.jobs[JOB].slots.made() == {}
