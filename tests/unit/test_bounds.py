"""Per-member bounds (docs/protocol.md, "Bounds"): the bound's one-shift test against exact
arithmetic, the model's drop and offence count, who the policy quarantines, the registry's checks."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.core.departures import bounds_text, offenders
from aggd.core.model import AggregatorModel, Bound, JobConfig, member_rows
from aggd.core.registry import Limits, Registry, RegistryError
from aggd_client.protocol import ZERO_EXPONENT, DropReason, Header, MsgType

E = 8
GROUP = ("239.1.1.1", 47001)


def addr(rank: int) -> tuple[str, int]:
    return (f"10.0.0.{rank + 1}", 40000 + rank)


@settings(max_examples=300, deadline=None, database=None)
@given(max_abs=st.floats(1e-30, 1e30), q=st.integers(-(2**31), 2**31 - 1), e=st.integers(-200, 200))
def test_the_shift_test_is_exact(max_abs, q, e):
    """|q * 2**-e| <= bound exactly when the one-shift test says so; the bound is max_abs rounded up
    to 24 bits (so an honest value at max_abs is never refused)."""
    b = Bound.of(max_abs)
    assert max_abs <= b.value <= max_abs * (1 + 2**-23)
    exact = abs(Fraction(q) * Fraction(2) ** -e) <= Fraction(b.mant) * Fraction(2) ** b.exp
    assert b.beyond(np.array([q], np.int64), e) == (not exact)


def test_bound_edges():
    b = Bound.of(1.0)
    assert not b.beyond(np.array([2**31 - 1]), ZERO_EXPONENT)        # an all-zero chunk's exponent
    assert not b.beyond(np.array([], np.int32), 0)
    assert b.beyond(np.array([0, -2]), 0) and not b.beyond(np.array([0, -1]), 0)
    assert b.beyond(np.array([1]), -70) and not b.beyond(np.array([0]), -70)
    for bad in (0, -1.0, math.inf, math.nan, "1"):
        with pytest.raises(ValueError):
            Bound.of(bad)


def test_a_contribution_beyond_the_bound_is_dropped_and_counted_against_its_member():
    m = AggregatorModel(E, userspace=True)
    m.add_job(JobConfig(job=1, world=2, slots=2, max_chunks=8, group=GROUP, bound=Bound.of(4.0),
                        members={0: addr(0), 1: addr(1)}))

    def send(rank, values, exponent=0, type_=MsgType.CONTRIB):
        h = Header(type=type_, job=1, rank=rank, count=E, exponent=exponent)
        return m.process(h.pack() + np.asarray(values, "<i4").tobytes(), addr(rank))

    v = send(1, [0, 0, 5, 0, 0, 0, 0, 0])                           # 5 > 4
    assert v.reason == DropReason.OUT_OF_BOUNDS
    assert send(1, [0, 0, 5 * 4, 0, 0, 0, 0, 0], exponent=2).reason == DropReason.OUT_OF_BOUNDS   # 20 / 4
    assert send(1, [16, -16, 0, 0, 0, 0, 0, 0], exponent=2).reason is None                          # 4: within
    assert send(0, [4] * E).action == "tx"                                                          # released
    assert [r["offences"] for r in member_rows(m.jobs[1].members, 2)] == [0, 2]
    assert m.drops(1)[DropReason.OUT_OF_BOUNDS] == 2
    big = Header(type=MsgType.REREAD, job=1, rank=1, count=E).pack() + np.full(E, 2**30, "<i4").tobytes()
    assert m.process(big, addr(1)).reason != DropReason.OUT_OF_BOUNDS     # a re-read's payload is room only


def test_offenders_counted_since_let_back_in():
    rows = [{"rank": 0, "offences": 0}, {"rank": 1, "offences": 5}, {"rank": 2, "offences": 2}]
    limits = bounds_text(4.0, None)
    assert [o.rank for o in offenders(rows, {}, {}, 3, limits)] == [1]
    assert offenders(rows, {1: {}}, {}, 3, limits) == []                  # gone already
    assert offenders(rows, {}, {1: 4}, 3, limits) == []                   # 1 since it was let back in
    assert offenders(rows, {}, {}, 0, limits) == []                       # never
    assert "beyond the job's max_abs 4;" in offenders(rows, {}, {}, 2, limits)[0].reason()
    assert bounds_text(0.5, 3.0) == "max_abs 0.5, max_norm 3" and bounds_text(None, 2.0) == "max_norm 2"


@settings(max_examples=300, deadline=None, database=None)
@given(max_norm=st.floats(1e-20, 1e20), e=st.integers(-100, 100), seed=st.integers(0, 2**32 - 1),
       n=st.integers(1, 64))
def test_the_norm_test_is_exact(max_norm, e, seed, n):
    """sum(q**2) * 2**-2e <= bound**2 exactly when the test says so (Python integers, fractions);
    a bound whose limit would pass 2**63 lets anything through, as the kernel's does."""
    b = Bound.of(max_norm)
    rng = np.random.default_rng(seed)
    q = rng.integers(-(2**31), 2**31, n) >> int(rng.integers(0, 32))
    sq = sum(int(v) ** 2 for v in q)
    exact = Fraction(sq) * Fraction(2) ** (-2 * e) <= (Fraction(b.mant) * Fraction(2) ** b.exp) ** 2
    limit = b.norm_limit(e)
    if limit is None:
        assert not b.beyond_norm(q, e) and b.mant ** 2 * Fraction(2) ** (2 * (b.exp + e)) >= 2**63
    else:
        assert b.beyond_norm(q, e) == (not exact)


def test_a_contribution_beyond_the_norm_bound_is_dropped_and_counted():
    m = AggregatorModel(E, userspace=True)
    m.add_job(JobConfig(job=1, world=2, slots=2, max_chunks=8, group=GROUP, norm_bound=Bound.of(10.0),
                        members={0: addr(0), 1: addr(1)}))

    def send(rank, values, exponent=0):
        h = Header(type=MsgType.CONTRIB, job=1, rank=rank, count=E, exponent=exponent)
        return m.process(h.pack() + np.asarray(values, "<i4").tobytes(), addr(rank))

    assert send(1, [4] * E).reason == DropReason.OUT_OF_BOUNDS          # norm 11.3: every value small
    assert send(1, [3] * E).reason is None                               # 8.5
    assert send(0, [0, 0, 0, 0, 0, 0, 0, 20], exponent=1).action == "tx"  # 10 exactly: within
    assert [r["offences"] for r in member_rows(m.jobs[1].members, 2)] == [0, 1]


def test_registry_bounds():
    reg = Registry(Limits(kernel_budget=1 << 30, elements=E, port=47000, userspace_port=47002, result_port=47001))
    j = reg.create("b", 4, max_abs=2.5, quarantine_after=3)
    assert (j.max_abs, j.quarantine_after) == (2.5, 3) and j.kernel_slots > 0
    again = Registry(reg.limits)
    again.load_json(reg.to_json())
    assert (again.get("b").max_abs, again.get("b").quarantine_after) == (2.5, 3)
    for bad in (0, -1, float("inf"), "2", True):
        with pytest.raises(RegistryError, match="max_abs"):
            reg.create(f"x{id(bad)}", 4, max_abs=bad)
    with pytest.raises(RegistryError, match="needs max_abs or max_norm"):
        reg.create("q", 4, quarantine_after=2)
    n = reg.create("n", 4, max_norm=3.0, quarantine_after=2)
    assert n.max_norm == 3.0 and n.kernel_slots > 0 and again.get("b").max_norm is None
    with pytest.raises(RegistryError, match="max_norm must be a positive number"):
        reg.create("n2", 4, max_norm=-1.0)
    p4 = Registry(Limits(kernel_budget=1 << 30, elements=E, port=47000, userspace_port=47002, result_port=47001,
                         bounds_in_kernel=False))
    assert p4.create("b", 4, max_abs=1.0).kernel_slots == 0                 # a switch does not check bounds
    # a quarantined rank's JOIN is refused until readmitted
    reg.depart("b", 1, "out of bounds", quarantined=True)
    out = reg.join("b", 1, j.token, ("10.0.0.2", 40001))
    assert out.code != 0 and "quarantined" in out.message
    reg.readmit("b", 1)
    assert reg.join("b", 1, j.token, ("10.0.0.2", 40001)).code == 0
