"""Per-member bounds (docs/protocol.md, "Bounds"): the bound's one-shift test against exact
arithmetic, the model's drop and offence count, who the policy quarantines, the registry's checks."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.core.departures import offenders
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
    assert [o.rank for o in offenders(rows, {}, {}, 3, 4.0)] == [1]
    assert offenders(rows, {1: {}}, {}, 3, 4.0) == []                     # gone already
    assert offenders(rows, {}, {1: 4}, 3, 4.0) == []                      # 1 since it was let back in
    assert offenders(rows, {}, {}, 0, 4.0) == []                          # never
    assert "beyond 4" in offenders(rows, {}, {}, 2, 4.0)[0].reason()


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
    with pytest.raises(RegistryError, match="needs max_abs"):
        reg.create("q", 4, quarantine_after=2)
    p4 = Registry(Limits(kernel_budget=1 << 30, elements=E, port=47000, userspace_port=47002, result_port=47001,
                         bounds_in_kernel=False))
    assert p4.create("b", 4, max_abs=1.0).kernel_slots == 0                 # a switch does not check bounds
    # a quarantined rank's JOIN is refused until readmitted
    reg.depart("b", 1, "out of bounds", quarantined=True)
    out = reg.join("b", 1, j.token, ("10.0.0.2", 40001))
    assert out.code != 0 and "quarantined" in out.message
    reg.readmit("b", 1)
    assert reg.join("b", 1, j.token, ("10.0.0.2", 40001)).code == 0
