"""Narrow precisions in the reference model and the user-space arithmetic (docs/protocol.md,
"Precision"): int8 contributions summed exactly into int16 results, int16 into int32; the precision
checked against the job's; the kernel's rule (pass anything but int32 up); the registry's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.core.model import NUMPY_ARITHMETIC, AggregatorModel, JobConfig, Strategy
from aggd.core.registry import Limits, Registry, RegistryError
from aggd.dataplane.userspace import kernels
from aggd_client import quant
from aggd_client.protocol import (HEADER_SIZE, LANES, DropReason, Flag, Header, MsgType, Precision,
                                  StrategyKind, decode, payload_dtype, values_per_packet)

E = 16      # the aggregator's int32 lanes a packet


def V(precision: Precision) -> int:
    """Values a packet of ``precision`` carries: ``E``, two a lane at 8 bits."""
    return values_per_packet(E, precision)
GROUP = ("239.1.1.1", 47001)
NARROW = (Precision.INT8, Precision.INT16)


def addr(rank: int) -> tuple[str, int]:
    return (f"10.0.0.{rank + 1}", 40000 + rank)


def job(world: int, precision: Precision, strategy: Strategy | None = None) -> JobConfig:
    kw = {} if strategy is None else {"strategy": strategy}
    return JobConfig(job=1, world=world, slots=2, max_chunks=8, group=GROUP, precision=precision,
                     members={r: addr(r) for r in range(world)}, **kw)


def model(cfg: JobConfig, *, userspace: bool = True, arithmetic=NUMPY_ARITHMETIC) -> AggregatorModel:
    m = AggregatorModel(E, userspace=userspace, arithmetic=arithmetic)
    m.add_job(cfg)
    return m


def contribution(rank: int, q: np.ndarray, exponent: int, precision: Precision, *, round_: int = 0,
                 chunk: int = 0, step: int = 0, code: int | None = None, count: int | None = None) -> bytes:
    count = len(q) if count is None else count
    h = Header(type=MsgType.CONTRIB, job=1, rank=rank, round=round_, chunk=chunk, count=count,
               exponent=exponent, step=step, code=int(precision) if code is None else code)
    return h.pack() + np.asarray(q).astype(payload_dtype(precision)).tobytes()


@pytest.mark.parametrize("precision", NARROW)
def test_a_result_is_the_exact_sum_in_the_wider_type(precision):
    lanes = LANES[precision]
    world = 4
    m = model(job(world, precision))
    rng = np.random.default_rng(1)
    q = rng.integers(-lanes.contrib_max, lanes.contrib_max + 1, (world, V(precision)))
    q[:, 0] = lanes.contrib_max            # the largest values from every member: no overflow
    q[:, 1] = -lanes.contrib_max
    exps = np.array([3, 5, 3, 4])          # aligned to the smallest, by floor shifts
    for r in range(world):
        v = m.process(contribution(r, q[r], int(exps[r]), precision), addr(r))
    assert v.action == "tx" and v.dest == "group"
    hdr, payload = decode(v.out)
    assert hdr.type == MsgType.RESULT and hdr.code == precision
    assert len(v.out) == HEADER_SIZE + V(precision) * lanes.result_bytes == HEADER_SIZE + 4 * E
    assert payload.dtype == np.dtype(lanes.result)
    want, e = quant.align_and_sum(q.astype(lanes.contrib)[:, None, :], exps[:, None])
    assert hdr.exponent == int(e[0]) and not hdr.flags & Flag.OVERFLOW
    assert payload.tolist() == want[0].tolist()


def test_int8_sums_of_256_terms_fit_int16():
    """64 members pushing four wbsp steps each of the largest int8 magnitude: 256 terms, exact."""
    world = 64
    m = model(job(world, Precision.INT8, Strategy(StrategyKind.WBSP)))
    q = np.full(V(Precision.INT8), 127)
    q[1::2] = -127
    out = None
    for step in range(1, 4):
        for r in range(world):
            assert m.process(contribution(r, q, 0, Precision.INT8, step=step), addr(r)).action == "drop"
    for r in range(world):
        out = m.process(contribution(r, q, 0, Precision.INT8), addr(r))
    hdr, payload = decode(out.out)
    assert hdr.n_contrib == 256 and not hdr.flags & Flag.OVERFLOW
    assert payload.tolist() == (256 * q).tolist()
    assert quant.q_max(64, 256, Precision.INT8) == 127


def test_a_sum_that_does_not_fit_the_result_is_flagged():
    """Only more terms than the headroom leaves room for (a forged or buggy sender) can overflow:
    the low bits go out, flagged."""
    big = model(job(2, Precision.INT16))
    big_q = np.full(E, 32767)
    for r in range(2):
        v = big.process(contribution(r, big_q, 0, Precision.INT16), addr(r))
    assert not decode(v.out)[0].flags & Flag.OVERFLOW        # int16 into int32: room to spare
    # int8 into int16 overflows only past 258 terms of the largest magnitude: 64 members, 8 wbsp steps
    many = model(job(64, Precision.INT8, Strategy(StrategyKind.WBSP)))
    for step in range(1, 8):
        for r in range(64):
            many.process(contribution(r, np.full(V(Precision.INT8), 127), 0, Precision.INT8, step=step), addr(r))
    for r in range(64):
        v = many.process(contribution(r, np.full(V(Precision.INT8), 127), 0, Precision.INT8), addr(r))
    hdr, payload = decode(v.out)
    assert hdr.n_contrib == 512 and hdr.flags & Flag.OVERFLOW
    assert payload[0] == np.int16(((512 * 127 + 32768) & 0xFFFF) - 32768)
    assert many.counter(1, "overflows") == 1


@pytest.mark.parametrize("precision", NARROW)
def test_a_packet_of_another_precision_is_refused_in_user_space(precision):
    m = model(job(2, precision))
    other = Precision.INT32 if precision != Precision.INT32 else Precision.INT8
    data = contribution(0, np.ones(V(other)), 0, other)
    v = m.process(data, addr(0))
    assert v.action == "drop" and v.reason == DropReason.BAD_PRECISION
    assert m.drops(1)[DropReason.BAD_PRECISION] == 1
    # an int32 job refuses narrow packets alike
    m32 = model(job(2, Precision.INT32))
    assert m32.process(contribution(0, np.ones(V(precision)), 0, precision), addr(0)).reason == DropReason.BAD_PRECISION


@pytest.mark.parametrize("precision", NARROW)
def test_the_kernel_takes_its_packet_size_of_the_jobs_values(precision):
    """The XDP program adds a narrow job's packets of exactly its packet size of values (``elements``,
    twice that at 8 bits; its result frame grown); other sizes go up (at 8 bits ``elements`` values
    too), and a wrong precision is refused there too."""
    m = model(job(2, precision), userspace=False)
    v = m.process(contribution(0, np.ones(V(precision)), 0, precision), addr(0))
    assert v.action == "drop" and v.reason is None and m.counter(1, "contributions") == 1
    short = contribution(1, np.ones(3), 0, precision, count=3)[:HEADER_SIZE + 3 * LANES[precision].contrib_bytes]
    assert m.process(short, addr(1)).action == "pass" and m.counter(1, "to_userspace") == 1
    if precision == Precision.INT8:
        assert m.process(contribution(1, np.ones(E), 0, precision), addr(1)).action == "pass"
    assert m.process(contribution(1, np.ones(E), 0, Precision.INT32), addr(1)).reason == DropReason.BAD_PRECISION
    # an int32 job: a narrow code is refused, whatever the payload's length
    m32 = model(job(2, Precision.INT32), userspace=False)
    h = Header(type=MsgType.CONTRIB, job=1, rank=0, count=E, code=int(precision))
    assert m32.process(h.pack() + bytes(4 * E), addr(0)).reason == DropReason.BAD_PRECISION


@pytest.mark.parametrize("precision", NARROW)
def test_count_is_checked_in_the_precisions_values(precision):
    m = model(job(2, precision))
    width = LANES[precision].contrib_bytes
    short = contribution(0, np.ones(V(precision)), 0, precision)[:HEADER_SIZE + width * (V(precision) - 1)]
    assert m.process(short, addr(0)).reason == DropReason.BAD_COUNT
    ok = contribution(0, np.ones(3), 0, precision, count=3)          # a payload that holds `count`
    assert m.process(ok, addr(0)).action == "drop" and m.counter(1, "contributions") == 1


@settings(max_examples=60, deadline=None, database=None)
@given(precision=st.sampled_from(NARROW), world=st.integers(1, 8), seed=st.integers(0, 2**32 - 1),
       exps=st.lists(st.integers(-40, 40), min_size=8, max_size=8))
def test_numba_arithmetic_equals_numpy(precision, world, seed, exps):
    """The user-space path's kernels give the model's bytes, extreme values included."""
    lanes = LANES[precision]
    rng = np.random.default_rng(seed)
    q = rng.integers(-lanes.contrib_max, lanes.contrib_max + 1, (world, V(precision)))
    q[:, :2] = [lanes.contrib_max, -lanes.contrib_max]
    ref, fast = model(job(world, precision)), model(job(world, precision), arithmetic=kernels.KERNEL_ARITHMETIC)
    for r in range(world):
        data = contribution(r, q[r], exps[r], precision)
        a, b = ref.process(data, addr(r)), fast.process(data, addr(r))
        assert (a.action, a.out) == (b.action, b.out)


def test_quantised_int8_sums_are_within_the_bound():
    """The client's quantisation and the model's sum: within ``error_bound`` of the exact sum."""
    world, rng = 4, np.random.default_rng(7)
    x = rng.standard_normal((world, E)) * np.array([1e-30, 1.0, 1e30, 3.0])[:, None]
    for precision in NARROW:
        m = model(job(world, precision))
        terms = world * quant.MAX_HEADROOM
        for r in range(world):
            q, e = quant.quantise(x[r][None, :], world, terms=terms, precision=precision, rng=rng)
            v = m.process(contribution(r, q[0], int(e[0]), precision), addr(r))
        hdr, payload = decode(v.out)
        got = quant.dequantise(payload[None, :E], np.array([hdr.exponent]))[0]    # (an 8-bit packet: padded)
        bound = quant.error_bound(world, np.array([hdr.exponent]), precision=precision)[0]
        assert np.all(np.abs(got - x.sum(axis=0)) <= bound)


def test_registry_precision():
    reg = Registry(Limits(kernel_budget=1 << 30, elements=E, port=47000, userspace_port=47002,
                          result_port=47001))
    narrow = reg.create("n8", 4, precision=8)
    assert narrow.precision == Precision.INT8 and narrow.kernel_slots > 0     # the XDP program adds them
    user = Registry(Limits(kernel_budget=1 << 30, elements=E, port=47000, userspace_port=47002, result_port=47001,
                           narrow_in_kernel=False))                       # a P4 switch does not
    assert user.create("n8", 4, precision=8).kernel_slots == 0
    assert narrow.join_info()["precision"] == 8 and narrow.describe()["precision"] == 8
    assert reg.create("w", 4).join_info()["precision"] == 32
    again = Registry(reg.limits)
    again.load_json(reg.to_json())                      # a restarted daemon keeps the precision
    assert again.get("n8").precision_bits == 8 and again.get("w").precision_bits == 32
    for bad in (4, 12, "8", 64):
        with pytest.raises(RegistryError, match="precision"):
            reg.create(f"bad{bad}", 4, precision=bad)
    with pytest.raises(RegistryError, match="rack job"):
        reg.create("rack", 4, precision=16, upstream={"server": "10.0.0.9:47000", "job": "top",
                                                       "token": "t" * 32, "rank": 0, "span": 8})


def test_an_8_bit_packet_holds_two_values_a_lane():
    """Every result payload is ``4 E`` bytes: an 8-bit job's packet (and the JOIN_ACK's
    ``elements``) holds ``2 E`` values, the others ``E``; the kernel takes 8-bit packets of ``2 E``."""
    reg = Registry(Limits(kernel_budget=1 << 30, elements=E, port=47000, userspace_port=47002,
                          result_port=47001))
    for bits, per_packet in ((8, 2 * E), (16, E), (32, E)):
        j = reg.create(f"p{bits}", 4, precision=bits)
        assert j.join_info()["elements"] == per_packet and j.describe()["elements"] == E
        assert V(j.precision) * LANES[j.precision].result_bytes == 4 * E
    m = model(job(2, Precision.INT8), userspace=False)
    assert m.process(contribution(0, np.ones(2 * E), 0, Precision.INT8), addr(0)).action == "drop"
    assert m.counter(1, "contributions") == 1 and m.counter(1, "to_userspace") == 0


@pytest.mark.parametrize("arithmetic", [NUMPY_ARITHMETIC, kernels.KERNEL_ARITHMETIC], ids=["numpy", "numba"])
def test_an_int16_result_is_flagged_outside_the_symmetric_range_or_past_256_contributions(arithmetic):
    """64 members, four wbsp steps each: 256 contributions. -32767 fits an 8-bit job's result and
    -32768 does not (the range is symmetric); 320 contributions are flagged whatever their values,
    the low 16 bits of each sum going out all the same."""
    def run(values_of, steps):
        m = model(job(64, Precision.INT8, Strategy(StrategyKind.WBSP)), arithmetic=arithmetic)
        out = None
        for step in list(range(1, steps)) + [0]:
            for r in range(64):
                out = m.process(contribution(r, values_of(r, step), 0, Precision.INT8, step=step), addr(r))
        return decode(out.out)

    full = np.full(V(Precision.INT8), -128)
    hdr, payload = run(lambda r, step: full if (r, step) != (0, 0) else np.full_like(full, -127), 4)
    assert hdr.n_contrib == 256 and not hdr.flags & Flag.OVERFLOW and payload.tolist() == [-32767] * (2 * E)
    hdr, payload = run(lambda r, step: full, 4)
    assert hdr.n_contrib == 256 and hdr.flags & Flag.OVERFLOW and payload.tolist() == [-32768] * (2 * E)
    hdr, payload = run(lambda r, step: np.zeros_like(full), 5)
    assert hdr.n_contrib == 320 and hdr.flags & Flag.OVERFLOW and payload.tolist() == [0] * (2 * E)
