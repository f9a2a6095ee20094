"""Robust jobs (docs/protocol.md, "Robust jobs"): the combine rule against exact arithmetic, the numba
kernel against it, the model's rows (one a member, no carries, no steps, their strategies), the
user-space path equal to the model and keeping rows across a restart, the Zeno score and who the
policy quarantines, the registry's checks."""
from __future__ import annotations

import random
import socket
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.core.departures import ScoreWatch, zeno_score
from aggd.core.model import NUMPY_ARITHMETIC, AggregatorModel, JobConfig, member_rows
from aggd.core.registry import Limits, Registry, RegistryError
from aggd.core.robust import Combine, CombineKind, combine_rows, parse_combine, zeno_keeps
from aggd.core.strategy import parse, to_entry
from aggd.dataplane.userspace import kernels
from aggd.dataplane.userspace.server import UserspaceAggregator
from aggd_client.protocol import HEADER_SIZE, MAX_MEMBERS, ZERO_EXPONENT, DropReason, Header, MsgType

from tests.fixtures.scenarios import JOB
from tests.harness.arithmetic import play_both

E = 8
MEDIAN, TRIM1, ZENO = Combine(CombineKind.MEDIAN), Combine(CombineKind.TRIMMED, 1), Combine(CombineKind.ZENO)


def exact(rows: np.ndarray, exps: np.ndarray, combine: Combine) -> tuple[list[int], int]:
    """The rule written with fractions: aligned rows, the middle n - 2t (or zeno's rows, which
    ``zeno_keeps`` says), their mean rounded half up, times n."""
    n = len(rows)
    e = int(exps.min())
    t = min(combine.trim, (n - 1) // 2) if combine.kind == CombineKind.TRIMMED else (n - 1) // 2
    aligned = [[int(v) >> min(int(x) - e, 31) for v in row] for row, x in zip(rows, exps)]
    keep = None
    if combine.kind == CombineKind.ZENO:
        a = np.array(aligned, np.int64)
        keep = zeno_keeps(a, np.sort(a, axis=0), combine.rho)
        keep = keep if keep.any() else None
    out = []
    for c in range(rows.shape[1]):
        if keep is not None:
            mid = [aligned[r][c] for r in range(n) if keep[r]]
        else:
            mid = sorted(aligned[r][c] for r in range(n))[t:n - t]
        mean_n = Fraction(sum(mid) * n, len(mid))
        out.append(int((mean_n + Fraction(1, 2)) // 1))
    return out, e


@settings(max_examples=300, deadline=None, database=None)
@given(n=st.integers(1, MAX_MEMBERS), e=st.integers(1, 12), seed=st.integers(0, 2**32 - 1),
       how=st.sampled_from(["median", "trimmed:1", "trimmed:2", "trimmed:40", "zeno"]),
       rho=st.sampled_from([0.0, 0.05, 1.0]))
def test_combine_is_the_exact_rule_and_the_kernel_is_it(n, e, seed, how, rho):
    """Up to 64 members, the largest and smallest int32, mixed exponents (an all-zero row's too)."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(np.array([-(2**31), 2**31 - 1, 0, -1, 1], np.int64), (n, e)) if seed % 3 == 0 else \
        rng.integers(-(2**31), 2**31, (n, e))
    rows = rows.astype(np.int32)
    exps = rng.choice(np.array([0, 3, 17, 40, ZERO_EXPONENT]), n).astype(np.int64) if seed % 2 else \
        np.full(n, 5, np.int64)
    if seed % 5 == 0:           # rows alike but for one far off: zeno keeps some, not all
        rows = np.tile(rows[:1], (n, 1)) // 2 + rng.integers(-1000, 1000, (n, e)).astype(np.int32)
        rows[0] = -rows[0]
    c = parse_combine(how, rho)
    values, exp = combine_rows(rows, exps, c)
    assert (values.tolist(), exp) == exact(rows, exps, c)
    got, got_exp = kernels._combine(rows, exps, c)
    assert got_exp == exp and got.tolist() == values.tolist()


def test_median_of_four_with_one_outlier():
    rows = np.array([[1, 2], [3, 4], [-100, 500], [5, 6]], np.int32)
    values, exp = combine_rows(rows, np.zeros(4, np.int64), MEDIAN)
    assert values.tolist() == [4 * 2, 4 * 5] and exp == 0          # (1+3)/2, (4+6)/2, times 4


def test_parse_combine():
    assert str(parse_combine("median")) == "median" and str(parse_combine(" Trimmed:2 ")) == "trimmed:2"
    assert parse_combine("zeno", 0.5) == Combine(CombineKind.ZENO, 0, 0.5)
    assert not parse_combine("sum").robust
    for bad in ("mean", "trimmed", "trimmed:0", "trimmed:-1", "median:1", ""):
        with pytest.raises(ValueError, match="combine"):
            parse_combine(bad)


# -- the model ---------------------------------------------------------------------------------------

def addr(rank: int) -> tuple[str, int]:
    return (f"10.0.0.{rank + 1}", 40000 + rank)


def robust_model(strategy="sync", world=4, combine=MEDIAN, arith=NUMPY_ARITHMETIC) -> AggregatorModel:
    m = AggregatorModel(E, userspace=True, arithmetic=arith)
    m.add_job(JobConfig(job=1, world=world, slots=2, max_chunks=8, members={r: addr(r) for r in range(world)},
                        combine=combine, strategy=parse(strategy)))
    return m


def send(m, rank, values, round_=0, chunk=0, exponent=0, step=0, flags=0, now=0):
    h = Header(type=MsgType.CONTRIB, job=1, rank=rank, round=round_, chunk=chunk, count=E, exponent=exponent,
               step=step, flags=flags)
    return m.process(h.pack() + np.asarray(values, "<i4").tobytes(), addr(rank), now)


def result_values(v) -> list[int]:
    return np.frombuffer(v.out, "<i4", offset=HEADER_SIZE).tolist()


def test_a_robust_round_releases_the_median_times_its_rows():
    m = robust_model()
    for rank, x in enumerate([1, 2, 3]):
        assert send(m, rank, [x] * E).action == "drop"
    v = send(m, 3, [-1000] * E)                                    # one member far off
    h = v.header
    assert v.action == "tx" and h.n_contrib == 4 and h.contributors == 0b1111
    assert result_values(v) == [6] * E          # sorted -1000, 1, 2, 3: (1 + 2) / 2, times 4 rows


def test_rows_at_different_exponents_align_as_a_sum_does():
    m = robust_model(world=3)
    send(m, 0, [8] * E, exponent=3)        # 1.0
    send(m, 1, [2] * E, exponent=1)        # 1.0
    v = send(m, 2, [4] * E, exponent=0)    # 4.0
    assert v.header.exponent == 0 and result_values(v) == [3 * 1] * E


def test_a_wbsp_step_is_refused_and_async_and_wbsp_are_not_run():
    m = robust_model()
    assert send(m, 0, [1] * E, step=1).reason == DropReason.BAD_STEP
    assert m.drops(1)[DropReason.BAD_STEP] == 1
    for text in ("async", "wbsp"):
        with pytest.raises(ValueError, match="median job runs quorum, ssp, sync"):
            m.set_strategy(1, [to_entry(parse(text), 1, 0)])
        with pytest.raises(ValueError, match="median"):
            robust_model(text)
    with pytest.raises(ValueError, match="rack job"):
        from aggd.core.model import Upstream
        JobConfig(job=1, world=2, slots=1, max_chunks=1, members={}, combine=MEDIAN,
                  upstream=Upstream(("10.0.0.9", 1)))


def test_a_late_contribution_is_answered_not_carried():
    m = robust_model("quorum:2:10ms")
    send(m, 0, [1] * E)
    v = send(m, 1, [3] * E)
    assert v.action == "tx" and result_values(v) == [2 * 2] * E
    late = send(m, 2, [100] * E)                                    # round 0 is released
    assert late.action == "tx" and late.dest == "sender" and result_values(late) == [4] * E
    assert m.counter(1, "carried") == 0
    send(m, 0, [5] * E, round_=1)
    v = send(m, 1, [7] * E, round_=1)
    assert v.header.n_contrib == 2 and result_values(v) == [12] * E  # nothing of rank 2's in round 1


def test_zeno_averages_the_rows_that_score_and_leaves_out_the_one_against():
    m = robust_model(combine=ZENO)
    rows = [[10, 12, 8, 10, 10, 11, 9, 10], [12, 10, 10, 8, 11, 10, 10, 9], [8, 10, 12, 10, 9, 9, 11, 11]]
    for rank, x in enumerate(rows):
        send(m, rank, x)
    v = send(m, 3, [-100] * E)
    honest = np.array(rows).sum(axis=0)                          # their mean, times 4 rows
    assert result_values(v) == [(2 * int(s) * 4 + 3) // 6 for s in honest] and v.header.n_contrib == 4
    m = robust_model(combine=ZENO)                               # none scores (a zero median): the median
    for rank, x in enumerate([[1] * E, [-1] * E, [1] * E, [-1] * E]):
        v = send(m, rank, x)
    assert result_values(v) == [0] * E


def test_trimmed_mean_of_five():
    m = robust_model(world=5, combine=TRIM1)
    for rank, x in enumerate([10, -50, 20, 30, 900]):
        v = send(m, rank, [x] * E)
    assert result_values(v) == [5 * 20] * E                         # mean of 10, 20, 30


@pytest.mark.parametrize("text", ["sync", "quorum:3:10ms", "ssp:2"])
@pytest.mark.parametrize("how", [MEDIAN, TRIM1, ZENO])
def test_the_kernels_give_the_models_verdicts(text, how):
    """Random traffic (retransmissions, late and early packets, re-reads, shrinking and growing
    tensors) through the numpy model and the user-space model (numba combine): same bytes, counters
    and score terms."""
    rng = random.Random(f"{text}{how}")
    released = 0
    for _ in range(20):
        a, b = play_both(text, rng, (2, 1, 3), userspace=True, combine=how)
        assert np.allclose(a.jobs[JOB].scores, b.jobs[JOB].scores)
        released += a.counter(JOB, "released")
    assert released > 20


def test_user_space_keeps_rows_across_a_restart(tmp_path):
    """Half a robust round through one server (UDP); the other half through the next one, which
    maps the kept rows: the result is the median of all four."""
    socks = []
    for _ in range(4):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.settimeout(2.0)
        socks.append(s)
    cfg = JobConfig(job=1, world=4, slots=2, max_chunks=8, members={r: s.getsockname() for r, s in enumerate(socks)},
                    combine=MEDIAN)

    def contribute(srv, rank, x):
        socks[rank].sendto(Header(type=MsgType.CONTRIB, job=1, rank=rank, count=E).pack()
                           + np.full(E, x, "<i4").tobytes(), srv.address)
        handled = 0
        while handled < 1:
            handled += srv.serve_once(1.0)

    try:
        srv = UserspaceAggregator(("127.0.0.1", 0), E, keep_dir=tmp_path)
        try:
            assert srv.add_job(cfg, identity="robust@1") is False
            contribute(srv, 0, 1)
            contribute(srv, 1, 2)
        finally:
            srv.close()
        srv = UserspaceAggregator(("127.0.0.1", 0), E, keep_dir=tmp_path)    # the next daemon
        try:
            assert srv.add_job(cfg, identity="robust@1") is True
            contribute(srv, 2, 3)
            contribute(srv, 3, -1000)
            for s in socks:
                data = s.recvfrom(65536)[0]
                assert Header.unpack(data).n_contrib == 4
                assert np.frombuffer(data, "<i4", offset=HEADER_SIZE).tolist() == [6] * E   # (1 + 2) / 2 * 4
            assert all(r["score_terms"] is not None for r in srv.member_stats(1, 4))
        finally:
            srv.close()
    finally:
        for s in socks:
            s.close()


# -- scores and the policy's quarantine ----------------------------------------------------------------

def test_scores_tell_the_member_that_points_away():
    rng = np.random.default_rng(3)
    m = robust_model()
    g = rng.normal(size=E)
    for round_ in range(20):
        for rank in range(4):
            x = g + rng.normal(scale=0.5, size=E)
            if rank == 2:
                x = -10 * g
            q = np.round(x * 2**20).astype("<i4")
            send(m, rank, q, round_=round_, exponent=20)
    rows = member_rows(m.jobs[1].members, 4, m.jobs[1].scores)
    scores = [zeno_score(r["score_terms"], None, 0.05) for r in rows]
    assert scores[2] < -10 and all(0.5 < s < 1.5 for i, s in enumerate(scores) if i != 2), scores


def test_score_watch_quarantines_after_windows_in_a_row():
    w = ScoreWatch(0.05, 3, "median")
    terms = {0: [0.0, 0.0, 0.0], 1: [0.0, 0.0, 0.0]}

    def window(bad: bool, gone=()):
        terms[0] = [terms[0][0] + 1.0, terms[0][1] + 1.5, terms[0][2] + 1.0]
        terms[1] = [terms[1][0] + (-10.0 if bad else 1.0), terms[1][1] + (100.0 if bad else 1.5), terms[1][2] + 1.0]
        return w.observe([{"rank": r, "score_terms": tuple(t)} for r, t in terms.items()],
                         {g: {} for g in gone})

    assert window(True) == [] and window(True) == []
    assert window(False) == []                                      # the run is broken
    assert window(True) == [] and window(True) == []
    out = window(True)
    assert [s.rank for s in out] == [1] and out[0].windows == 3 and "below -0.5 in 3 policy windows" in out[0].reason()
    assert window(True, gone=(1,)) == []                            # gone: counts again once let in
    assert w.observe([{"rank": 0, "score_terms": tuple(terms[0])}], {}) == []   # no release: no window
    assert 0.9 < w.last[0] < 1.0 and w.last[1] < -10


# -- the registry ---------------------------------------------------------------------------------------

def registry() -> Registry:
    return Registry(Limits(kernel_budget=1 << 30, elements=E, port=47000, userspace_port=47002, result_port=47001,
                           default_slots=8))


def test_registry_robust_jobs_are_user_space_and_refuse_what_they_cannot_run():
    reg = registry()
    job = reg.create("r", 4, combine="median", score_after=3)
    assert job.kernel_slots == 0 and job.combine == "median" and job.join_info()["combine"] == "median"
    assert reg.create("s", 4).kernel_slots > 0 and reg.get("s").combine == "sum"
    again = type(job).from_json(job.to_json())
    assert (again.combine, again.score_after, again.score_rho) == ("median", 3, 0.05)
    with pytest.raises(RegistryError, match="median job runs quorum, ssp, sync, not wbsp"):
        reg.set_strategy("r", "wbsp", 0)
    reg.set_strategy("r", "quorum:3", 0)
    cases = [({"combine": "mean"}, "combine 'mean'"),
             ({"combine": "median", "strategy": "async"}, "not async"),
             ({"combine": "median", "kernel_slots": 4}, "kernel_slots 4: a median job is served in user space"),
             ({"score_after": 2}, "score_after needs a robust combine"),
             ({"combine": "median", "score_rho": -1}, "score_rho must be"),
             ({"combine": "trimmed:1", "score_after": -1}, "score_after must be")]
    for i, (kw, msg) in enumerate(cases):
        with pytest.raises(RegistryError, match=msg):
            reg.create(f"bad{i}", 4, **kw)


def test_registry_counts_a_robust_jobs_rows_in_its_memory():
    reg = Registry(Limits(kernel_budget=1 << 30, elements=E, port=47000, userspace_port=47002, result_port=47001,
                          default_slots=8, max_job_memory=64 << 10))
    reg.create("plain", 16, slots=256)                                  # 256 x 8 x 32 bytes: 64 KiB
    with pytest.raises(RegistryError, match=r"with a row a member: combine median.*max_job_memory"):
        reg.create("rows", 16, slots=256, combine="median")
