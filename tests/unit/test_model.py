"""The reference model against docs/protocol.md: fixture tables and property tests."""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.core.model import (NO_JOB, RESULT_RANK, AggregatorModel, JobConfig, Strategy, StrategyTable,
                        Verdict)
from aggd_client.protocol import (HEADER_SIZE, ZERO_EXPONENT, Counter, DropReason, Flag, Header,
                                  MsgType, NackCode, StrategyKind, VERSION, decode)

E = 8  # small packets keep the tables readable; one test uses the default size
GROUP = ("239.1.1.1", 47001)


def addr(rank: int, job: int = 1) -> tuple[str, int]:
    return (f"10.0.{job}.{rank + 1}", 40000 + rank)


def cfg(job: int = 1, world: int = 3, slots: int = 2, max_chunks: int = 8, group=GROUP) -> JobConfig:
    return JobConfig(job=job, world=world, slots=slots, max_chunks=max_chunks,
                     members={r: addr(r, job) for r in range(world)}, group=group)


def model(*cfgs: JobConfig, elements: int = E, **kw) -> AggregatorModel:
    m = AggregatorModel(elements, **kw)
    for c in cfgs or (cfg(),):
        m.add_job(c)
    return m


def pkt(values=(), *, elements: int = E, count: int | None = None, payload_elems: int | None = None,
        **hdr) -> bytes:
    """An aggd message; ``values`` fill the front of an ``elements``-long zero payload."""
    payload = np.zeros(elements if payload_elems is None else payload_elems, np.int32)
    payload[:len(values)] = values
    h = Header(**hdr)
    h.count = (len(values) or 1) if count is None else count
    return h.pack() + payload.astype("<i4").tobytes()


def contrib(rank: int, values=(1,), job: int = 1, **hdr) -> tuple[bytes, tuple[str, int]]:
    return pkt(values, type=MsgType.CONTRIB, job=job, rank=rank, **hdr), addr(rank, job)


def reread(rank: int, job: int = 1, **hdr) -> tuple[bytes, tuple[str, int]]:
    return pkt((0,), type=MsgType.REREAD, job=job, rank=rank, **hdr), addr(rank, job)


# ---------------------------------------------------------------------------------------------
# Scenario tables: (packet, sender) steps with the verdict expected after each.

@dataclass
class Expect:
    action: str
    reason: DropReason | None = None
    dest: str | None = None
    hdr: dict = field(default_factory=dict)      # expected header fields of ``out``
    values: list | None = None                   # expected leading payload values of ``out``


ABSORBED = Expect("drop")
RELEASE = Expect("tx", dest="group", hdr=dict(type=MsgType.RESULT, rank=RESULT_RANK, flags=0))


def drop(reason: DropReason) -> Expect:
    return Expect("drop", reason)


def released(values, **hdr) -> Expect:
    return Expect("tx", dest="group", values=values,
                  hdr=dict(type=MsgType.RESULT, rank=RESULT_RANK, flags=0) | hdr)


def resent(values, **hdr) -> Expect:
    return Expect("tx", dest="sender", values=values,
                  hdr=dict(type=MsgType.RESULT, rank=RESULT_RANK, flags=Flag.REREAD) | hdr)


SCENARIOS: dict[str, list] = {
    "contributions accumulate, the last releases": [
        (contrib(0, [1, 2, 3], round=7, chunk=1), ABSORBED),
        (contrib(1, [10, 20, 30], round=7, chunk=1), ABSORBED),
        (contrib(2, [100, -200, 300], round=7, chunk=1),
         released([111, -178, 333, 0, 0, 0, 0, 0], job=1, round=7, chunk=1, count=3, exponent=0,
                  contributors=0b111, n_contrib=3, strategy_version=0, code=0, step=0)),
    ],
    "a duplicate does not count twice": [
        (contrib(0, [5]), ABSORBED),
        (contrib(0, [5], flags=Flag.RETRANSMIT), drop(DropReason.DUPLICATE)),
        (contrib(1, [5]), ABSORBED),
        (contrib(2, [5]), released([15], contributors=0b111, n_contrib=3)),
    ],
    "retransmit after release re-sends the result to the sender": [
        (contrib(0, [1]), ABSORBED), (contrib(1, [2]), ABSORBED), (contrib(2, [3]), released([6])),
        (contrib(1, [2], flags=Flag.RETRANSMIT), resent([6], contributors=0b111, n_contrib=3)),
        (reread(2), resent([6])),
    ],
    "re-read of an open round is not ready": [
        (contrib(0, [1]), ABSORBED),
        (reread(1), drop(DropReason.NOT_READY)),
        (reread(1, round=5), drop(DropReason.NOT_READY)),   # newer key: nothing opened
        (contrib(1, [1]), ABSORBED), (contrib(2, [1]), released([3])),
    ],
    "a newer round while the slot is open is busy": [
        (contrib(0, [1], round=0, chunk=0), ABSORBED),
        (contrib(1, [1], round=1, chunk=0), drop(DropReason.BUSY)),
        (contrib(1, [1], round=0, chunk=2), drop(DropReason.BUSY)),   # same slot (2 % 2)
        (contrib(1, [1], round=0, chunk=1), ABSORBED),               # other slot
    ],
    "released rounds stay for re-reads while the slot's four banks hold them; older keys are stale": [
        *[(contrib(r, [r + 1], round=0), RELEASE) if r == 2 else (contrib(r, [r + 1], round=0), ABSORBED)
          for r in range(3)],
        (contrib(0, [10], round=1), ABSORBED),
        (reread(1, round=0), resent([6], round=0)),                   # an older bank
        (contrib(1, [10], round=1), ABSORBED),
        (contrib(2, [10], round=1), released([30], round=1)),
        *[(contrib(r, [1], round=rnd), RELEASE if r == 2 else ABSORBED) for rnd in (2, 3) for r in range(3)],
        (reread(0, round=0), resent([6], round=0)),                   # 4 banks: rounds 0..3
        (contrib(0, [1], round=4), ABSORBED),                         # reuses round 0's bank
        (reread(0, round=0), drop(DropReason.STALE)),
        (contrib(0, [1], round=0, flags=Flag.RETRANSMIT), drop(DropReason.STALE)),
        (contrib(1, [1], round=0, flags=Flag.RETRANSMIT), drop(DropReason.STALE)),
        (reread(0, round=1), resent([30], round=1)),
        (contrib(0, [1], round=1, flags=Flag.RETRANSMIT), resent([30], round=1)),
    ],
    "exponents align to the smallest; the finer is shifted right": [
        (contrib(0, [64, -64, 7], exponent=4), ABSORBED),             # 4.0, -4.0, 0.4375
        (contrib(1, [3, 3, 3], exponent=1), ABSORBED),                # 1.5 each; bank shifted by 3
        (contrib(2, [256, 1, -1], exponent=6), released([8 + 3 + 8, -8 + 3 + 0, 0 + 3 - 1], exponent=1)),
    ],
    "an all-zero chunk never lowers the scale": [
        (contrib(0, [0], exponent=ZERO_EXPONENT), ABSORBED),
        (contrib(1, [5, 6], exponent=20), ABSORBED),
        (contrib(2, [0], exponent=ZERO_EXPONENT), released([5, 6], exponent=20)),
    ],
    "all-zero contributions keep the zero exponent": [
        *[(contrib(r, [0], exponent=ZERO_EXPONENT), ABSORBED) for r in range(2)],
        (contrib(2, [0], exponent=ZERO_EXPONENT), released([0], exponent=ZERO_EXPONENT)),
    ],
    "shifts clamp to 31 and stay arithmetic": [
        (contrib(0, [-5, 5, 2**31 - 1], exponent=-100), ABSORBED),
        (contrib(1, [-1, 1, 0], exponent=10), ABSORBED),
        (contrib(2, [0, 0, 0], exponent=10), released([-6, 5, 2**31 - 1], exponent=-100)),
    ],
    "a sum outside int32 is sent wrapped and flagged": [
        (contrib(0, [2**31 - 1, -2**31]), ABSORBED),
        (contrib(1, [1, -1]), ABSORBED),
        (contrib(2, [0, 0]), released([-2**31, 2**31 - 1], flags=Flag.OVERFLOW)),
        (reread(0), resent([-2**31], flags=Flag.OVERFLOW | Flag.REREAD)),
    ],
    "sums are exact: one that leaves int32 and comes back is not flagged": [
        (contrib(0, [2**31 - 1, -2**31]), ABSORBED),
        (contrib(1, [2**31 - 1, -1]), ABSORBED),
        (contrib(2, [-2**31, 2**31 - 1]), released([2**31 - 2, -2], flags=0)),
    ],
    "a sum beyond int32 is shifted exactly when a finer exponent arrives": [
        (contrib(0, [2**31 - 1, -2**31], exponent=4), ABSORBED),
        (contrib(1, [2**31 - 1, -2**31], exponent=4), ABSORBED),
        (contrib(2, [0, 0], exponent=3), released([2**31 - 1, -2**31], exponent=3, flags=0)),
    ],
}


def check(v: Verdict, exp: Expect, elements: int = E) -> None:
    assert (v.action, v.reason, v.dest) == (exp.action, exp.reason, exp.dest), v
    if exp.action != "tx":
        assert v.out is None
        return
    hdr, payload = decode(v.out)
    for name, value in exp.hdr.items():
        assert getattr(hdr, name) == value, (name, hdr)
    if hdr.type == MsgType.RESULT:
        assert len(payload) == elements
    if exp.values is not None:
        assert payload[:len(exp.values)].tolist() == list(exp.values)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    m = model()
    for (data, src), exp in SCENARIOS[name]:
        check(m.process(data, src), exp)


def test_counters_of_a_round_with_duplicates_and_rereads():
    m = model()
    steps = [contrib(0, [1, 2]), contrib(0, [1, 2], flags=Flag.RETRANSMIT), contrib(1, [1, 2]),
             reread(1), contrib(2, [1, 2]), contrib(2, [1, 2], flags=Flag.RETRANSMIT), reread(0)]
    for data, src in steps:
        m.process(data, src)
    c = m.counters(1)
    assert c[Counter.RX_PACKETS] == 7
    assert c[Counter.RX_BYTES] == 7 * (HEADER_SIZE + 4 * E)
    assert c[Counter.CONTRIBUTIONS] == 3 and c[Counter.ELEMENTS] == 6
    assert c[Counter.RELEASED] == 1 and c[Counter.REREADS] == 2 and c[Counter.RETRANSMITS] == 2
    assert c[Counter.OVERFLOWS] == 0 and c[Counter.TO_USERSPACE] == 0
    d = m.drops(1)
    assert d[DropReason.DUPLICATE] == 1 and d[DropReason.NOT_READY] == 1 and d.sum() == 2
    assert m.drops(NO_JOB).sum() == 0
    assert m.stats()["jobs"][1]["counters"]["released"] == 1


def test_result_bytes_exactly():
    m = model(elements=256)
    for r in range(3):
        v = m.process(pkt([r + 1] * 200, elements=256, job=1, rank=r, round=3, chunk=5, exponent=-2),
                      addr(r))
    expected = Header(type=MsgType.RESULT, job=1, rank=0xFFFF, round=3, chunk=5, count=200,
                      exponent=-2, contributors=7, n_contrib=3).pack()
    expected += np.array([6] * 200 + [0] * 56, "<i4").tobytes()
    assert v.out == expected and v.addrs == (GROUP,)


# ---------------------------------------------------------------------------------------------
# Malformed and refused packets: one counter each, in the documented order.

def _raw(length: int) -> bytes:
    return pkt([1])[:length]


def _with(**hdr) -> bytes:
    fields = dict(type=MsgType.CONTRIB, job=1, rank=0) | hdr
    return pkt([1], **fields)


MALFORMED = [
    # name, packet, sender, reason, bucket, NACK code
    ("empty", b"", addr(0), DropReason.TOO_SHORT, NO_JOB, None),
    ("less than a header", _raw(HEADER_SIZE - 1), addr(0), DropReason.TOO_SHORT, NO_JOB, None),
    ("bad magic", _with(magic=0xA66E), addr(0), DropReason.BAD_MAGIC, NO_JOB, None),
    ("bad magic before version", _with(magic=0, version=9), addr(0), DropReason.BAD_MAGIC, NO_JOB, None),
    ("bad version", _with(version=VERSION + 1), addr(0), DropReason.BAD_VERSION, NO_JOB, None),
    ("type nack", _with(type=MsgType.NACK), addr(0), DropReason.BAD_TYPE, NO_JOB, None),
    ("type 0", _with(type=0), addr(0), DropReason.BAD_TYPE, NO_JOB, None),
    ("count 0", _with(count=0), addr(0), DropReason.BAD_COUNT, NO_JOB, None),
    ("count beyond elements", _with(count=E + 1), addr(0), DropReason.BAD_COUNT, NO_JOB, None),
    ("count beyond packet", pkt([1], type=1, job=1, rank=0, count=4, payload_elems=3),
     addr(0), DropReason.BAD_COUNT, NO_JOB, None),
    ("header only", _with()[:HEADER_SIZE], addr(0), DropReason.BAD_COUNT, NO_JOB, None),
    ("bad count before unknown job", _with(job=9, count=0), addr(0), DropReason.BAD_COUNT, NO_JOB, None),
    ("unknown job", _with(job=9), addr(0), DropReason.UNKNOWN_JOB, NO_JOB, NackCode.UNKNOWN_JOB),
    ("rank out of range", _with(rank=3), addr(0), DropReason.BAD_RANK, 1, NackCode.NOT_MEMBER),
    ("rank 0xFFFF", _with(rank=0xFFFF), addr(0), DropReason.BAD_RANK, 1, NackCode.NOT_MEMBER),
    ("wrong source port", _with(rank=0), (addr(0)[0], 1), DropReason.NOT_MEMBER, 1, NackCode.NOT_MEMBER),
    ("wrong source host", _with(rank=0), ("10.9.9.9", addr(0)[1]), DropReason.NOT_MEMBER, 1,
     NackCode.NOT_MEMBER),
    ("another rank's address", _with(rank=0), addr(1), DropReason.NOT_MEMBER, 1, NackCode.NOT_MEMBER),
    ("chunk == max_chunks", _with(chunk=8), addr(0), DropReason.BAD_CHUNK, 1, None),
    ("chunk huge", _with(chunk=2**32 - 1), addr(0), DropReason.BAD_CHUNK, 1, None),
    ("bad chunk re-read", _with(type=MsgType.REREAD, chunk=8), addr(0), DropReason.BAD_CHUNK, 1, None),
]


def test_results_and_join_answers_go_to_the_daemon_in_the_kernel_and_are_refused_in_user_space():
    """An aggregator takes results only from a rack job's upper aggregator (docs/protocol.md, "Two
    levels"), which the daemon serves; in user space a result from anywhere else is bad_type."""
    for t in (MsgType.RESULT, MsgType.JOIN_ACK, MsgType.JOIN, MsgType.SHARDS):
        assert model().process(_with(type=t), addr(0)).action == "pass"
    us = model(userspace=True)
    v = us.process(_with(type=MsgType.RESULT), addr(0))
    assert v.action == "drop" and v.reason == DropReason.BAD_TYPE and v.job == NO_JOB


@pytest.mark.parametrize("name,data,src,reason,bucket,code", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_dropped_with_its_counter(name, data, src, reason, bucket, code):
    m = model()
    v = m.process(data, src)
    assert v.reason == reason and v.job == bucket
    expected = np.zeros(len(DropReason), np.uint64)
    expected[reason] = 1
    assert m.drops(bucket).tolist() == expected.tolist()
    other = 1 if bucket == NO_JOB else NO_JOB
    assert m.drops(other).sum() == 0
    c = m.counters(1)
    assert c[Counter.CONTRIBUTIONS] == 0
    assert c[Counter.RX_PACKETS] == (1 if bucket == 1 else 0)   # counted once the job is known
    if code is None:
        assert v.action == "drop" and v.out is None
        return
    hdr = Header.unpack(data)
    assert (v.action, v.dest, v.addrs) == ("tx", "sender", (src,))
    assert v.out == Header(type=MsgType.NACK, job=hdr.job, rank=hdr.rank, round=hdr.round,
                           chunk=hdr.chunk, code=code).pack()
    assert len(v.out) == HEADER_SIZE


def test_payload_not_exactly_the_packet_size_goes_to_userspace():
    m = model()
    for n in (1, E - 1, E + 1):
        v = m.process(pkt([1], type=1, job=1, rank=0, payload_elems=n), addr(0))
        assert (v.action, v.reason, v.out, v.job) == ("pass", None, None, 1)
    odd = pkt([1], type=1, job=1, rank=0) + b"\0"           # not a whole number of int32s
    assert m.process(odd, addr(0)).action == "pass"
    assert m.counters(1)[Counter.TO_USERSPACE] == 4
    assert m.counters(1)[Counter.CONTRIBUTIONS] == 0
    # ... but only once the header checks passed: the kernel refuses what it can judge itself.
    assert m.process(pkt([1], type=1, job=1, rank=0, chunk=99, payload_elems=2), addr(0)).reason \
        == DropReason.BAD_CHUNK


def test_userspace_mode_serves_short_payloads_with_its_flag():
    m = model(userspace=True)
    for r in range(3):
        v = m.process(pkt([r + 1, 1], type=1, job=1, rank=r, payload_elems=2), addr(r))
    check(v, released([6, 3, 0, 0, 0, 0, 0, 0], flags=Flag.USERSPACE))
    nack = m.process(pkt([1], type=1, job=5, rank=0, payload_elems=1), addr(0))
    assert nack.header.flags == Flag.USERSPACE and nack.header.code == NackCode.UNKNOWN_JOB
    assert m.counters(1)[Counter.TO_USERSPACE] == 0


def test_fan_out_without_group_goes_to_every_member():
    m = model(cfg(group=None))
    for r in range(3):
        v = m.process(*contrib(r, [1]))
    assert v.dest == "group" and v.addrs == (addr(0), addr(1), addr(2))
    again = m.process(*reread(1))
    assert again.addrs == (addr(1),)


def test_two_jobs_are_independent():
    m = model(cfg(job=1, world=2), cfg(job=2, world=3))
    assert m.process(*contrib(0, [1], job=1)).action == "drop"
    assert m.process(*contrib(0, [100], job=2)).action == "drop"
    v1 = m.process(*contrib(1, [2], job=1))
    assert v1.action == "tx" and v1.header.job == 1 and decode(v1.out)[1][0] == 3
    # job 1's member address is not job 2's
    bad = m.process(contrib(1, [1], job=2)[0], addr(1, job=1))
    assert bad.reason == DropReason.NOT_MEMBER and m.drops(2)[DropReason.NOT_MEMBER] == 1
    assert m.drops(1).sum() == 0
    m.process(*contrib(1, [200], job=2))
    v2 = m.process(*contrib(2, [300], job=2))
    assert decode(v2.out)[1][0] == 600 and v2.header.n_contrib == 3
    assert m.counters(1)[Counter.RELEASED] == m.counters(2)[Counter.RELEASED] == 1
    m.remove_job(1)
    assert m.process(*contrib(0, [1], job=1)).reason == DropReason.UNKNOWN_JOB
    assert m.process(*contrib(0, [1], job=2, round=1)).action == "drop"   # job 2 unaffected


def test_registry_validation():
    m = model()
    with pytest.raises(ValueError):
        m.add_job(cfg())                                   # already registered
    with pytest.raises(ValueError):
        JobConfig(job=256, world=1, slots=1, max_chunks=1, members={})
    with pytest.raises(ValueError):
        JobConfig(job=1, world=65, slots=1, max_chunks=1, members={})
    with pytest.raises(ValueError):
        JobConfig(job=1, world=2, slots=1, max_chunks=1, members={2: addr(2)})
    with pytest.raises(ValueError):
        AggregatorModel(E).add_job(JobConfig(job=1, world=1, slots=1, max_chunks=1, members={},
                                             elements=E * 2))
    with pytest.raises(ValueError):                        # a quorum needs a timeout
        AggregatorModel(E).add_job(JobConfig(job=1, world=1, slots=1, max_chunks=1, members={},
                                             strategy=Strategy(StrategyKind.QUORUM, k=1)))
    with pytest.raises(ValueError):                        # k beyond the world
        AggregatorModel(E).add_job(JobConfig(job=1, world=1, slots=1, max_chunks=1, members={},
                                             strategy=Strategy(StrategyKind.QUORUM, k=2, timeout_us=5)))


def test_member_registered_late():
    c = cfg()
    c.members.pop(2)
    m = model(c)
    assert m.process(*contrib(2, [1])).reason == DropReason.NOT_MEMBER
    m.set_member(1, 2, addr(2))
    assert m.process(*contrib(2, [1])).action == "drop" and m.counters(1)[Counter.CONTRIBUTIONS] == 1
    assert 2 not in c.members                              # the caller's config is not mutated


def test_member_tags_keep_forged_packets_out():
    """A packet from a member's address without its tag is dropped ``bad_tag``, silently (a NACK
    would reach the real member), counts nothing, and does not displace the member."""
    tags = {0: 0x1111, 1: 0x2222, 2: 0x3333}
    m = model(JobConfig(job=1, world=3, slots=2, max_chunks=8, members={r: addr(r) for r in range(3)},
                        tags=tags, group=GROUP))
    for forged in (0, 0x2222, 0x1110, 2**64 - 1):          # none, another member's, near, any
        v = m.process(*contrib(0, [10**6], contributors=forged))
        assert (v.action, v.reason, v.out) == ("drop", DropReason.BAD_TAG, None)
    assert m.process(*reread(1, contributors=0)).reason == DropReason.BAD_TAG
    assert m.drops(1)[DropReason.BAD_TAG] == 5 and m.counters(1)[Counter.CONTRIBUTIONS] == 0
    for r in range(3):                                     # the members are unharmed
        v = m.process(*contrib(r, [r + 1], contributors=tags[r]))
    assert decode(v.out)[1][0] == 6 and m.drops(1)[DropReason.DUPLICATE] == 0
    # a member that joins again gets a new tag: the old one no longer works
    m.set_member(1, 0, addr(0), 0x4444)
    assert m.process(*contrib(0, [1], round=1, contributors=0x1111)).reason == DropReason.BAD_TAG
    assert m.process(*contrib(0, [1], round=1, contributors=0x4444)).action == "drop"
    assert m.drops(1)[DropReason.BAD_TAG] == 6 and m.counters(1)[Counter.CONTRIBUTIONS] == 4
    with pytest.raises(ValueError):
        m.set_member(1, 0, addr(0), 1 << 64)


def test_strategy_table_versions():
    t = StrategyTable(Strategy())
    t.install(1, 10, Strategy(StrategyKind.SSP, staleness=2))
    assert t.governing(9) == (0, Strategy())
    assert t.governing(10)[0] == 1
    with pytest.raises(ValueError):
        t.install(1, 20, Strategy())


# ---------------------------------------------------------------------------------------------
# Properties: any interleaving of contributions, duplicates and retransmissions.

def sequential_sum(contribs: list[tuple[list[int], int]]) -> tuple[list[int], int, bool]:
    """The slot's arithmetic in plain Python ints, in arrival order (floors compose differently
    from a one-shot alignment when exponents differ, so the order matters): exact sums, shifted by
    at most 63 (the sum) and 31 (an int32 contribution), wrapped and flagged only when sent."""
    acc, exp = list(contribs[0][0]), contribs[0][1]
    for values, e in contribs[1:]:
        new = min(exp, e)
        a_sh, s_sh = min(exp - new, 63), min(e - new, 31)
        acc = [(a >> a_sh) + (v >> s_sh) for a, v in zip(acc, values)]
        exp = new
    overflow = any(not -2**31 <= x < 2**31 for x in acc)
    return [(x + 2**31) % 2**32 - 2**31 for x in acc], exp, overflow


int32s = st.integers(-2**31, 2**31 - 1)
exponents = st.one_of(st.integers(-40, 40), st.just(ZERO_EXPONENT))


@st.composite
def rounds(draw, small: bool = False):
    world = draw(st.integers(1, 6))
    n = draw(st.integers(1, E))
    elem = st.integers(-2**24, 2**24) if small else int32s
    vals = [draw(st.lists(elem, min_size=n, max_size=n)) for _ in range(world)]
    exps = [draw(exponents if not small else st.integers(-5, 30)) for _ in range(world)]
    # Each rank appears at least once; extra appearances are retransmissions or re-reads.
    order = list(range(world)) + draw(st.lists(st.integers(0, world - 1), max_size=8))
    order = draw(st.permutations(order))
    kinds = [draw(st.sampled_from(["contrib", "reread"])) for _ in order]
    return world, vals, exps, order, kinds


def run_round(world, vals, exps, order, kinds):
    m = model(cfg(world=world))
    seen: list[int] = []
    results = []
    for rank, kind in zip(order, kinds):
        if kind == "reread" and rank not in seen and len(seen) < world:
            kind = "contrib"      # a worker re-reads only after contributing
        if kind == "contrib":
            data = pkt(vals[rank], type=MsgType.CONTRIB, job=1, rank=rank, exponent=exps[rank],
                       flags=Flag.RETRANSMIT if rank in seen else 0)
        else:
            data = pkt([0], type=MsgType.REREAD, job=1, rank=rank)
        v = m.process(data, addr(rank))
        was_open = len(seen) < world
        if kind == "contrib" and rank not in seen:
            seen.append(rank)
        if v.action == "tx":
            results.append((was_open, v))
    return m, seen, results


@settings(max_examples=200, deadline=None)
@given(rounds())
def test_property_release_is_the_sequential_aligned_sum_and_counts_each_member_once(r):
    world, vals, exps, order, kinds = r
    m, seen, results = run_round(world, vals, exps, order, kinds)
    assert sorted(seen) == list(range(world))
    first, *rest = results
    assert first[0] and first[1].dest == "group" and all(not opened for opened, _ in rest)
    expected, exp, overflow = sequential_sum([(vals[r], exps[r]) for r in seen])
    for i, (_, v) in enumerate(results):
        hdr, payload = decode(v.out)
        assert payload[:len(expected)].tolist() == expected and not payload[len(expected):].any()
        assert hdr.exponent == exp and hdr.contributors == 2**world - 1 and hdr.n_contrib == world
        assert bool(hdr.flags & Flag.OVERFLOW) == overflow
        assert bool(hdr.flags & Flag.REREAD) == (i > 0)
    c = m.counters(1)
    assert c[Counter.CONTRIBUTIONS] == world and c[Counter.RELEASED] == 1
    assert c[Counter.REREADS] == len(results) - 1
    assert c[Counter.RX_PACKETS] == len(order)
    d = m.drops(1)
    assert c[Counter.RX_PACKETS] == world + len(results) - 1 + d[DropReason.DUPLICATE] + d[DropReason.NOT_READY]


@settings(max_examples=200, deadline=None)
@given(rounds(small=True))
def test_property_sum_within_the_alignment_bound_and_exact_for_equal_exponents(r):
    world, vals, exps, order, kinds = r
    _, seen, results = run_round(world, vals, exps, order, kinds)
    hdr, payload = decode(results[0][1].out)
    assert not hdr.flags & Flag.OVERFLOW
    ulp = Fraction(1, 2) ** hdr.exponent
    for i in range(len(vals[0])):
        exact = sum(Fraction(vals[r][i]) * Fraction(1, 2) ** exps[r] for r in range(world))
        got = payload[i] * ulp
        # Every alignment floors once, at a scale no finer than the result's.
        assert 0 <= exact - got < max(world - 1, 0) * ulp or exact == got
    if len(set(exps)) == 1:
        assert payload[:len(vals[0])].tolist() == [sum(v[i] for v in vals) for i in range(len(vals[0]))]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 3)), max_size=60))
def test_property_slots_never_mix_keys(events):
    """Random (rank, round, chunk) traffic: whatever is released is one key's data from every member.
    Every packet is marked a retransmission, so a key the slot no longer holds is stale rather than
    carried into a later round (what rule 4 does with a late first transmission)."""
    m = model(cfg(slots=2, max_chunks=4))
    for rank, rnd, chunk in events:
        v = m.process(*contrib(rank, [1000 * rnd + chunk], round=rnd, chunk=chunk, flags=Flag.RETRANSMIT))
        if v.action == "tx":
            hdr, payload = decode(v.out)
            assert (hdr.round, hdr.chunk) == (rnd, chunk)
            assert payload[0] == 3 * (1000 * rnd + chunk) and hdr.n_contrib == 3
        else:
            assert v.action == "drop"
