"""The XDP program's narrow lanes outside the equivalence sequences (those are in
test_model_equivalence.py): a round re-run through ``XdpDataPlane.rerun`` (the daemon's way for a
frame the attached program could not grow) is decided as the model decides it, the result's frame is
the result's size, and a contribution with room for its result is answered in its own frame (the
multi-buffer build's narrow packets: test_model_equivalence.py). An 8-bit job's packets carry two
values a lane, which the program adds four to a bank lane, and a 16-bit job's one, added two to a
bank lane (xdp/aggd_lanes.h, "Packed lanes"): their sums, exponent alignment, overflow flag and
bounds, value by value, against the model and against sums worked out here."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from aggd.core.model import AggregatorModel, Bound, JobConfig
from aggd_client.protocol import (INT8_MAX_CONTRIBUTIONS, LANES, MAX_MEMBERS, DropReason, Flag, Header, MsgType,
                                  Precision, decode, payload_dtype, values_per_packet)

from tests.bpf.conftest import ELEMENTS, job_config
from tests.fixtures.scenarios import JOB, T0_NS, entry, tag
from tests.harness.equivalence import member

pytestmark = pytest.mark.root
GROUP = ("239.77.0.9", 47001)


def narrow_job(xdp_program, job: int, world: int, precision: Precision):
    """A job of ``precision`` on the program and on the model: (members, model)."""
    members = {r: member(r) for r in range(world)}
    model = AggregatorModel(ELEMENTS)
    model.add_job(JobConfig(job=job, world=world, slots=4, max_chunks=64, members=members, group=GROUP,
                            precision=precision))
    xdp_program.install_job(job_config(job=job, world=world, slots=4, max_chunks=64, group=GROUP,
                                       members=members, precision=int(precision)))
    return members, model


@pytest.mark.parametrize("precision", (Precision.INT8, Precision.INT16))
def test_a_round_rerun_through_the_program_equals_the_model(xdp_program, precision):
    world, job = 3, 5
    members, model = narrow_job(xdp_program, job, world, precision)
    try:
        lanes, values = LANES[precision], values_per_packet(ELEMENTS, precision)
        rng = np.random.default_rng(int(precision))
        for round_ in range(3):
            for r in range(world):
                q = rng.integers(-lanes.contrib_max, lanes.contrib_max + 1, values)
                q[:3] = (lanes.contrib_max, -lanes.contrib_max, -lanes.contrib_max - 1)
                data = Header(type=MsgType.CONTRIB, job=job, rank=r, round=round_, count=values,
                              exponent=r - round_, code=int(precision)).pack() + q.astype(payload_dtype(precision)).tobytes()
                want = model.process(data, members[r], 0)
                got = xdp_program.rerun(data, members[r])
                assert (got.action, got.out, got.dest) == (want.action, want.out, want.dest)
            assert got.addrs == (GROUP,)
            hdr, payload = decode(got.out)
            assert hdr.code == precision and payload.dtype == np.dtype(lanes.result) and len(payload) == values
        stats = xdp_program.job_stats(job)
        assert stats.counters["released"] == 3 and stats.counters["contributions"] == 3 * world
    finally:
        xdp_program.remove_job(job)



@pytest.mark.parametrize("precision", (Precision.INT8, Precision.INT16))
@pytest.mark.parametrize("exponents", [(0, 1, 3), (5, 0, 2), (0, 20, 40), (40, 20, 0), (40, -30, 5), (-30, 30, 0)],
                         ids=lambda e: "/".join(map(str, e)))
def test_exponents_far_apart_align_as_the_model_does(xdp_program, precision, exponents):
    """Three members' contributions at differing exponents, the largest magnitudes included: each
    is aligned to the coarser scale in the packed lanes (xdp/aggd_lanes.h, packed_add_aligned), by
    shifts up to and past a field's width (a sum or value then floors to 0 or -1), as the model
    aligns them."""
    world, job = len(exponents), 5
    members, model = narrow_job(xdp_program, job, world, precision)
    try:
        lanes, values = LANES[precision], values_per_packet(ELEMENTS, precision)
        rng = np.random.default_rng(sum(exponents) + int(precision))
        for r, e in enumerate(exponents):
            q = rng.integers(-lanes.contrib_max - 1, lanes.contrib_max + 1, values)
            q[:4] = (lanes.contrib_max, -lanes.contrib_max - 1, -1, 1)
            data = Header(type=MsgType.CONTRIB, job=job, rank=r, count=values, exponent=e,
                          code=int(precision)).pack() + q.astype(payload_dtype(precision)).tobytes()
            want = model.process(data, members[r], 0)
            got = xdp_program.rerun(data, members[r])
            assert (got.action, got.out) == (want.action, want.out), (r, e)
        hdr, payload = decode(got.out)
        assert hdr.type == MsgType.RESULT and hdr.exponent == min(exponents)
    finally:
        xdp_program.remove_job(job)


@pytest.mark.parametrize("precision", (Precision.INT8, Precision.INT16))
def test_contributions_with_room_are_answered_in_their_own_frame(xdp_program, precision):
    """A narrow contribution that carries room for its result (the JOIN_ACK's ``room``: native XDP on
    veth cannot grow a frame) is answered in the kernel in the frame it came in, the room's junk
    never read: the same result as the model's and as that of the contributions without room, with
    IP and UDP lengths of the result."""
    from aggd.dataplane.xdp.bpf_syscall import XDP_TX, prog_test_run
    from tests.harness.equivalence import frame

    world, job = 2, 6
    members, model = narrow_job(xdp_program, job, world, precision)
    lanes, values = LANES[precision], values_per_packet(ELEMENTS, precision)
    room = b"\xa5" * (values * (lanes.result_bytes - lanes.contrib_bytes))
    try:
        rng = np.random.default_rng(7)
        for round_ in range(4):
            with_room = round_ % 2 == 0
            for r in range(world):
                q = rng.integers(-lanes.contrib_max, lanes.contrib_max + 1, values).astype(lanes.contrib)
                data = Header(type=MsgType.CONTRIB, job=job, rank=r, round=round_, count=values,
                              code=int(precision)).pack() + q.tobytes() + (room if with_room else b"")
                want = model.process(data, members[r], 0)
                sent = frame(data, members[r])
                got = prog_test_run(xdp_program.prog_fd, sent)
            assert want.action == "tx" and got.verdict == XDP_TX
            out = got.packet
            if with_room:
                assert len(out) == len(sent)      # answered in place: the frame did not grow
            assert int.from_bytes(out[16:18], "big") == len(out) - 14          # IP total length
            assert int.from_bytes(out[38:40], "big") == len(out) - 34          # UDP length
            hdr, payload = decode(out[42:])
            assert hdr.type == MsgType.RESULT and len(payload) == values and len(out) == 42 + 40 + 4 * ELEMENTS
            assert out[42:] == want.out
        assert xdp_program.job_stats(job).counters["to_userspace"] == 0
    finally:
        xdp_program.remove_job(job)


# ---------------------------------------------------------------------------------------------
# 8-bit jobs: two values a lane.

INT8_VALUES = values_per_packet(ELEMENTS, Precision.INT8)     #: an 8-bit packet's values: 2 * ELEMENTS
ROOM = b"\xa5"


def int8_message(rank: int, q, *, round_: int = 0, step: int = 0, exponent: int = 0, room: bool = False,
                 count: int = INT8_VALUES) -> bytes:
    """An 8-bit contribution to the harness's job: ``q`` (2E int8 values), with room for the result
    if ``room``."""
    q = np.asarray(q, np.int64)
    assert len(q) == INT8_VALUES and -128 <= q.min() and q.max() <= 127
    hdr = Header(type=MsgType.CONTRIB, job=JOB, rank=rank, round=round_, count=count, step=step, exponent=exponent,
                 contributors=tag(rank), code=int(Precision.INT8))
    return hdr.pack() + q.astype("<i1").tobytes() + (ROOM * INT8_VALUES if room else b"")


def int16_result(v) -> tuple[Header, np.ndarray]:
    """The result the model and the program agreed on (the harness compared them byte for byte)."""
    assert v.action == "tx", v
    hdr, payload = decode(v.out)
    assert hdr.type == MsgType.RESULT and hdr.code == Precision.INT8
    assert payload.dtype == np.dtype("<i2") and len(payload) == INT8_VALUES
    return hdr, payload.astype(np.int64)


def wbsp_round(harness, q: np.ndarray, round_: int, t_us: int, rng) -> tuple[Header, np.ndarray]:
    """Contributions ``q`` (one row each) of MAX_MEMBERS members, each member's later wbsp steps first
    and every step 0 last (a round is released once every step 0 is in), about half of them with
    room: the result."""
    world = MAX_MEMBERS
    steps = -(-len(q) // world)
    order = [(r, s) for s in range(steps - 1, -1, -1) for r in range(world) if s * world + r < len(q)]
    for i, (r, s) in enumerate(order):
        v = harness.send(int8_message(r, q[s * world + r], round_=round_, step=s, room=bool(rng.integers(2))),
                         member(r), T0_NS + (t_us + i) * 1000, f"round {round_}, rank {r}, step {s}")
        assert v.action == ("tx" if i == len(order) - 1 else "drop"), v
    return int16_result(v)


def test_int8_packets_of_two_values_a_lane_sum_exactly_at_the_largest_member_counts(harness):
    """64 members (MAX_MEMBERS) of 4 wbsp steps each, INT8_MAX_CONTRIBUTIONS contributions of 2E
    int8 values a round, among them columns of -128 and 127 throughout: every value sums exactly
    into its int16 (from -32767 to 32512), unflagged, as the model sums it."""
    world, n = MAX_MEMBERS, INT8_MAX_CONTRIBUTIONS
    assert n % world == 0 and 1 < n // world <= 8     # wbsp steps 0..7
    harness.start(world, 4, 8, [entry("wbsp")], precision=Precision.INT8)
    rng = np.random.default_rng(8)
    for round_ in range(2):
        q = rng.integers(-128, 128, (n, INT8_VALUES))
        q[:, 0], q[0, 0] = -128, -127          # a lane's low value: -32767, the symmetric range's end
        q[:, 1] = 127                          # its high one: 32512
        q[:, 2], q[:, 3], q[-1, 3] = 127, -128, -127     # the other way round in the next lane
        q[::2, 4], q[1::2, 4] = -128, 127
        q[:, 5] = 0
        q[:, -2:] = (-128, 127) if round_ else (127, -128)     # the last lane
        q[-1, -2:] = (-127, 127) if round_ else (127, -127)
        hdr, got = wbsp_round(harness, q, round_, 1000 * round_, rng)
        want = q.sum(axis=0)
        assert list(want[:6]) == [-32767, 127 * n, 127 * n, -32767, -n // 2, 0]
        assert (got == want).all()
        assert hdr.n_contrib == n and not hdr.flags & Flag.OVERFLOW and hdr.round == round_
    harness.check_counters("int8 at 64 members x 4 steps")


def aligned_sum(q: np.ndarray, exponents) -> tuple[np.ndarray, int]:
    """Contributions summed value by value in the order given, each alignment a floor division of
    the finer operand (the sum shifted by at most 63, a contribution by at most 31): (sums, exponent)."""
    acc, exp = q[0].astype(np.int64), exponents[0]
    for row, e in zip(q[1:], exponents[1:]):
        if e < exp:
            acc, exp = acc >> min(exp - e, 63), e
            acc = acc + row
        else:
            acc = acc + (row.astype(np.int64) >> min(e - exp, 31))
    return acc, exp


@pytest.mark.parametrize("exponents", [(3, 0, 5, 40, -80), (0, 2, 1, -1, 7), (-3, -3, 4, -20, 31)])
def test_int8_members_of_different_exponents_are_aligned_value_by_value(harness, exponents):
    """Each alignment shifts a lane's two values on their own (a packed lane shifted whole would
    carry its high value's bits into the low one): the program's sums are the model's, and the
    floor of each value's own division."""
    world = len(exponents)
    harness.start(world, 4, 8, [entry("sync")], precision=Precision.INT8)
    rng = np.random.default_rng(sum(exponents) & 0xFFFF)
    for round_ in range(2):
        q = rng.integers(-128, 128, (world, INT8_VALUES))
        q[:, :4] = ((-128, 127, -1, 1), (127, -128, 1, -1), (-128, -128, -1, -1), (127, 127, 1, 1),
                    (-1, -128, 0, 127))[:world]
        for r, e in enumerate(exponents):
            v = harness.send(int8_message(r, q[r], round_=round_, exponent=e, room=bool((r + round_) % 2)),
                             member(r), T0_NS + (100 * round_ + r) * 1000, f"round {round_}, rank {r}, exponent {e}")
        hdr, got = int16_result(v)
        want, exp = aligned_sum(q, exponents)
        assert hdr.exponent == exp == min(exponents)
        assert (got == want).all()
        assert not hdr.flags & Flag.OVERFLOW
    harness.check_counters(f"int8, exponents {exponents}")


def test_int8_overflow_flag_at_the_ends_of_the_symmetric_range(harness):
    """INT8_MAX_CONTRIBUTIONS contributions reach -32768 in a low value (flagged, the value sent as
    it is) or in a high one (flagged), the rest exact; -32767 is not flagged; one contribution more
    is flagged whatever its values (a low sum may then not split exactly). The program as the model."""
    world, n = MAX_MEMBERS, INT8_MAX_CONTRIBUTIONS
    harness.start(world, 4, 8, [entry("wbsp")], precision=Precision.INT8)
    rng = np.random.default_rng(32768)
    for round_, (column, flagged) in enumerate(((0, True), (1, True), (INT8_VALUES - 1, True), (None, False))):
        q = rng.integers(-128, 128, (n, INT8_VALUES))
        q[:, :2] = -128
        q[0, :2] = -127                          # -32767 and -32767 unless the column below
        q[:, -1], q[0, -1] = -128, -127
        if column is not None:
            q[:, column] = -128                  # -32768
        hdr, got = wbsp_round(harness, q, round_, 1000 * round_, rng)
        assert (got == q.sum(axis=0)).all()
        assert bool(hdr.flags & Flag.OVERFLOW) == flagged, (column, hdr)
        if column is not None:
            assert got[column] == -32768
    # one contribution more than the pairs split exactly: flagged with small values
    q = rng.integers(-2, 3, (n + 1, INT8_VALUES))
    hdr, got = wbsp_round(harness, q, 4, 5000, rng)
    assert hdr.n_contrib == n + 1 and hdr.flags & Flag.OVERFLOW and (got == q.sum(axis=0)).all()
    harness.check_counters("int8 overflow at the range's ends")


def bank_of(dp, job: int, key: int):
    """(slot index, bank index, slot) of the bank holding ``key`` (round << 32 | chunk)."""
    base, _ = dp.allocation(job)
    idx = ctypes.c_uint32(base + (key & 0xFFFFFFFF) % 4)
    slot = dp.slots[idx]
    banks = [i for i, b in enumerate(slot.bank) if b.key == key and b.state == 2]    # BANK_RELEASED
    assert len(banks) == 1
    return idx, banks[0], slot


@pytest.mark.parametrize("pair,flagged", [((32767, -32767), False), ((-32767, 32767), False), ((0, 0), False),
                                          ((-32768, 5), True), ((5, -32768), True), ((-32768, -32768), True),
                                          ((32767, 32767), False)])
def test_int8_quad_lane_at_the_ends_of_the_symmetric_range(xdp_program, pair, flagged):
    """Sums beyond what INT8_MAX_CONTRIBUTIONS contributions reach (32767 needs 258 of 127), written
    as values 2 and 3 into a released bank's first quad lane (16-bit fields, each under the bank's
    bias: xdp/aggd_lanes.h), and read again: each field comes out as its value, and only -32768
    (either field) is flagged."""
    from aggd.dataplane.xdp.bpf_syscall import XDP_TX, prog_test_run
    from tests.harness.equivalence import frame

    job, world = 6, 2
    members, _ = narrow_job(xdp_program, job, world, Precision.INT8)
    try:
        q = np.zeros(INT8_VALUES, np.int8)
        for r in range(world):
            data = Header(type=MsgType.CONTRIB, job=job, rank=r, count=INT8_VALUES,
                          code=int(Precision.INT8)).pack() + q.tobytes()
            verdict = prog_test_run(xdp_program.prog_fd, frame(data, members[r])).verdict
        assert verdict == XDP_TX                                         # released
        idx, i, slot = bank_of(xdp_program, job, 0)
        a, b = pair
        c = int(slot.bank[i].bias) & 0xFFFF                              # every field's bias
        slot.bank[i].values[0] = sum(((v + c) & 0xFFFF) << (16 * k) for k, v in enumerate((0, 0, a, b)))
        xdp_program.slots[idx] = slot
        reread = Header(type=MsgType.REREAD, job=job, rank=0, count=INT8_VALUES,
                        code=int(Precision.INT8)).pack() + bytes(INT8_VALUES)
        got = prog_test_run(xdp_program.prog_fd, frame(reread, members[0]))
        assert got.verdict == XDP_TX
        hdr, payload = decode(got.packet[42:])
        assert hdr.type == MsgType.RESULT and hdr.flags & Flag.REREAD and len(payload) == INT8_VALUES
        assert list(payload[:6]) == [0, 0, a, b, 0, 0] and not payload[4:].any()
        assert bool(hdr.flags & Flag.OVERFLOW) == flagged
    finally:
        xdp_program.remove_job(job)


@pytest.mark.parametrize("key,limit", [("bound", 100.0), ("norm_bound", 230.0)])
def test_bounds_of_an_int8_job_judge_each_value(harness, key, limit):
    """A bound on an 8-bit job's values, or on their L2 norm, judges the 2E values one by one, not
    the words that hold them in pairs (whose int32s are far beyond either bound): a value beyond it
    in either half of a word is refused (out_of_bounds, the member's offences counted), and values
    within it are summed. The program as the model."""
    world = 2
    harness.start(world, 4, 8, [entry("sync")], precision=Precision.INT8, **{key: Bound.of(limit)})
    # the bound (its limit at exponent 0): |q| <= 100; the norm's: sum(q**2) <= 230**2 = 52900
    base = np.full(INT8_VALUES, 100 if key == "bound" else 10)
    base[1::2] *= -1 if key == "bound" else 1
    assert (np.abs(base).max() if key == "bound" else int((base ** 2).sum())) <= (100 if key == "bound" else 52900)
    # one value beyond, in a lane's low half or its high one (the norm's: 2E values of 10 make 51200,
    # one of 52 instead adds 2604)
    beyond = []
    for i, v in ((0, -101), (1, 101), (INT8_VALUES - 1, -128), (INT8_VALUES - 2, 127)):
        q = base.copy()
        q[i] = v if key == "bound" else 52 * np.sign(v)
        beyond.append(q)
    within = base.copy()
    if key == "norm_bound":
        within[3] = 40                                        # + 1500: 52700
        assert int((within ** 2).sum()) <= 52900 < min(int((q ** 2).sum()) for q in beyond)
    else:
        within[2:4] = (-100, 100)
    t = 0
    for r in range(world):
        for q in beyond:
            t += 1
            v = harness.send(int8_message(r, q, room=bool(t % 2)), member(r), T0_NS + t * 1000, f"{key} {q[:4]}")
            assert v.action == "drop" and v.reason == DropReason.OUT_OF_BOUNDS, v
    for r in range(world):
        t += 1
        v = harness.send(int8_message(r, within if r else base), member(r), T0_NS + t * 1000, f"{key} within")
    hdr, got = int16_result(v)
    assert (got == base + within).all() and not hdr.flags & Flag.OVERFLOW
    assert [row["offences"] for row in harness.dp.member_stats(JOB, world)] == [len(beyond)] * world
    harness.check_counters(f"int8 {key}")


def test_int8_count_is_up_to_two_values_a_lane(harness):
    """``count`` of an 8-bit packet: up to 2E (the values carrying data); 2E + 1 is bad_count."""
    harness.start(2, 4, 8, [entry("sync")], precision=Precision.INT8)
    q = np.arange(INT8_VALUES) % 200 - 100
    v = harness.send(int8_message(0, q, count=INT8_VALUES + 1), member(0), T0_NS, "count 2E + 1")
    assert v.action == "drop" and v.reason == DropReason.BAD_COUNT
    harness.send(int8_message(0, q, count=INT8_VALUES - 1), member(0), T0_NS + 1000, "count 2E - 1")
    hdr, got = int16_result(harness.send(int8_message(1, q, count=ELEMENTS + 1), member(1), T0_NS + 2000, "E + 1"))
    assert hdr.count == INT8_VALUES - 1 and (got == 2 * q).all()
    harness.check_counters("int8 counts")


@pytest.mark.parametrize("precision", (Precision.INT8, Precision.INT16))
def test_pending_sum_of_a_narrow_job_reads_its_packed_lanes(xdp_program, precision):
    """``pending_sum`` (what a conservation check adds to the released sums) reads an open narrow
    round's packed lanes as the fields they hold (``loader.bank_sums``: four 8-bit values' sums a lane,
    or two 16-bit values'), not as int32s."""
    from aggd.dataplane.xdp.bpf_syscall import XDP_DROP, prog_test_run
    from tests.harness.equivalence import frame

    job = 6
    members, _ = narrow_job(xdp_program, job, 2, precision)
    try:
        lanes, values = LANES[precision], values_per_packet(ELEMENTS, precision)
        top = lanes.contrib_max
        q = np.resize(np.array([-top - 1, top, -1, 1, 0, 100, -top, 3]), values)
        data = Header(type=MsgType.CONTRIB, job=job, rank=0, count=values, exponent=3,
                      code=int(precision)).pack() + q.astype(payload_dtype(precision)).tobytes()
        assert prog_test_run(xdp_program.prog_fd, frame(data, members[0])).verdict == XDP_DROP   # absorbed
        assert xdp_program.pending_sum(job) == q.sum() / 8
    finally:
        xdp_program.remove_job(job)
