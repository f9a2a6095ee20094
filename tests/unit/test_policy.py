"""The dynamic-hybrid policy (aggd.core.policy) against reference sequences of detector outputs."""
from __future__ import annotations

import pytest

from aggd.daemon import config
from aggd.core.policy import JobPolicy, PolicyError, PolicyRules, fill, rules_from_config
from aggd.core.straggler import Detector, Observation, WorkerState

from tests.harness.straggler_sim import const, follow, simulate


def obs(round_: int, slow: dict[int, float] | None = None, *, world: int = 4, rounds: int = 4,
        factor: float = 1.5, counts: dict[int, int] | None = None, gone: tuple[int, ...] = ()) -> Observation:
    """``counts``: cumulative contributions (every member: ``round_``, unless given; none at all without)."""
    slow = slow or {}
    workers = tuple(WorkerState(r, slowdown=slow.get(r, 1.0), flagged=slow.get(r, 1.0) >= factor,
                                contributions=0 if counts is None else counts.get(r, round_), gone=r in gone)
                    for r in range(world))
    return Observation(t=round_ * 0.02, t0=(round_ - rounds) * 0.02, round=round_, rounds=rounds,
                       period_ms=20.0, workers=workers)


class Job:
    """Applies decisions the way the daemon does: the new strategy from the round after the next."""

    def __init__(self, rules: PolicyRules, strategy: str = "sync"):
        self.policy = JobPolicy(rules, own=strategy)
        self.strategy = strategy
        self.log: list[tuple[int, str, str]] = []

    def feed(self, o: Observation, now: float | None = None):
        d = self.policy.step(o, self.strategy, o.t if now is None else now)
        if d is not None:
            self.strategy = d.strategy
            self.policy.applied(d, o.round + 2, o.t if now is None else now)
            self.log.append((o.round, d.strategy, d.reason))
        return d


RULES = PolicyRules(slow_rounds=8, even_rounds=20, min_rounds_between=10, min_seconds_between=0.0, settle_rounds=4)


def test_a_member_slow_for_slow_rounds_switches_the_job_to_a_quorum_without_it():
    job = Job(RULES)
    for r in range(4, 40, 4):
        job.feed(obs(r))
    assert job.log == []
    for r in range(40, 52, 4):
        job.feed(obs(r, {3: 3.0}))
    # slow from round 36 (the start of the interval that showed it) to 44: 8 rounds
    assert [(r, s) for r, s, _ in job.log] == [(44, "quorum:3:50ms")]
    reason = job.log[0][2]
    assert "rank 3" in reason and "3.0x" in reason and "8 rounds" in reason


def test_a_member_that_is_slow_only_now_and_then_never_switches_the_job():
    job = Job(RULES)
    for r in range(4, 200, 4):
        job.feed(obs(r, {2: 2.0} if (r // 4) % 2 else {}))
    assert job.log == []


def test_back_to_the_jobs_own_strategy_after_even_rounds_and_not_before():
    job = Job(RULES)
    seq = [obs(r, {3: 3.0}) for r in range(4, 20, 4)]          # slow since 0: switch at 8
    seq += [obs(r, {3: 3.0}) for r in range(20, 60, 4)]        # still slow: stays
    seq += [obs(r) for r in range(60, 120, 4)]                 # even from 56: back at 76
    for o in seq:
        job.feed(o)
    assert [(r, s) for r, s, _ in job.log] == [(8, "quorum:3:50ms"), (76, "sync")]
    assert "every member within 1.35x of the median for 20 rounds, in step time and in contributions" in job.log[1][2]
    assert job.policy.switched is None and job.strategy == "sync"


def test_a_straggler_hovering_near_the_threshold_does_not_flap_the_job():
    job = Job(RULES)
    for r in range(4, 400, 4):  # 2x slower, estimated between 1.4x and 1.6x under the quorum
        job.feed(obs(r, {3: 2.0 if r < 20 else (1.4 if (r // 4) % 2 else 1.6)}))
    assert [s for _, s, _ in job.log] == ["quorum:3:50ms"]
    for r in range(400, 480, 4):  # recovered
        job.feed(obs(r, {3: 1.1}))
    assert [s for _, s, _ in job.log] == ["quorum:3:50ms", "sync"]
    assert "within 1.35x of the median" in job.log[-1][2]


def test_switches_are_rate_limited_in_rounds_and_seconds():
    rules = PolicyRules(slow_rounds=4, even_rounds=4, min_rounds_between=40, min_seconds_between=0.0,
                        settle_rounds=0)
    job = Job(rules)
    for r in range(4, 100, 4):  # slow, even, slow, even... every 12 rounds
        job.feed(obs(r, {3: 3.0} if (r // 12) % 2 == 0 else {}))
    rounds = [r for r, _, _ in job.log]
    assert len(rounds) >= 2 and all(b - a >= 40 for a, b in zip(rounds, rounds[1:])), rounds
    assert "at most one switch per 40 rounds" in job.policy.note or job.policy.note == ""

    timed = Job(PolicyRules(slow_rounds=4, even_rounds=4, min_rounds_between=0, min_seconds_between=10.0,
                            settle_rounds=0))
    for r in range(4, 100, 4):  # fast rounds: 96 rounds take 2 s, less than the 10 s between switches
        timed.feed(obs(r, {3: 3.0} if r < 40 else {}), now=r * 0.02)
    assert len(timed.log) == 1


def test_observations_while_a_switch_settles_are_not_judged():
    job = Job(PolicyRules(slow_rounds=0, even_rounds=0, min_rounds_between=0, min_seconds_between=0.0,
                          settle_rounds=10))
    job.feed(obs(10, {3: 3.0}))              # switch, from round 12
    assert len(job.log) == 1
    for r in (14, 18):                       # before 12 + 10: the old regime's numbers
        assert job.feed(obs(r)) is None
    assert job.feed(obs(22)) is not None     # judged again: everybody even, back


def test_more_slow_members_than_max_stragglers_is_a_slow_job_not_stragglers():
    job = Job(RULES)
    for r in range(4, 60, 4):
        job.feed(obs(r, {1: 2.0, 3: 3.0}))   # 2 of 4 > a quarter
    assert job.log == []
    assert "the job is slow rather than straggling" in job.policy.note
    big = Job(RULES)
    for r in range(4, 60, 4):
        big.feed(obs(r, {5: 2.0, 7: 3.0}, world=8))
    assert [s for _, s, _ in big.log] == ["quorum:6:50ms"]


def test_a_second_straggler_moves_the_job_to_a_smaller_quorum():
    job = Job(RULES)
    for r in range(4, 40, 4):
        job.feed(obs(r, {7: 3.0}, world=8))
    for r in range(40, 80, 4):
        job.feed(obs(r, {6: 2.0, 7: 3.0}, world=8))
    assert [s for _, s, _ in job.log] == ["quorum:7:50ms", "quorum:6:50ms"]
    assert "stragglers now ranks 6, 7" in job.log[1][2]


def test_a_strategy_set_by_hand_becomes_the_jobs_own():
    job = Job(RULES)
    for r in range(4, 24, 4):
        job.feed(obs(r, {3: 3.0}))
    assert job.strategy == "quorum:3:50ms"
    job.strategy = "ssp:2"                    # aggctl strategy set
    for r in range(24, 120, 4):
        job.feed(obs(r))
    assert job.policy.own == "ssp:2" and job.policy.switched is None
    assert [s for _, s, _ in job.log] == ["quorum:3:50ms"]  # never "back" to sync


def test_templates_and_rules():
    assert fill("quorum:n-s", 4, 1) == "quorum:3:50ms"
    assert fill("quorum:n-s:20ms", 8, 2) == "quorum:6:20ms"
    assert fill("quorum:n-1", 16, 3) == "quorum:15:50ms"
    assert fill("wbsp", 4, 1) == "wbsp" and fill("ssp:2", 4, 1) == "ssp:2"
    with pytest.raises(PolicyError, match="switch_to"):
        PolicyRules(switch_to="quorum:n-x")
    with pytest.raises(PolicyError, match="slow_factor"):
        PolicyRules(slow_factor=0.9)
    with pytest.raises(PolicyError, match="unknown policy keys"):
        PolicyRules.from_mapping({"slow_factr": 2})
    assert PolicyRules.from_mapping({"switch_to": "wbsp"}).switch_to == "wbsp"
    assert PolicyRules().allowed_stragglers(4) == 1 and PolicyRules().allowed_stragglers(16) == 4
    r = PolicyRules(jobs="dyn*")
    assert r.manages("dyn-1", "sync") and not r.manages("other", "sync") and not r.manages("dyn-2", "ssp:2")


def test_the_config_section_is_the_policy():
    cfg = config.parse({"policy": {"auto_switch": True, "slow_factor": 2, "switch_to": "wbsp", "jobs": "train-*"}})
    rules = rules_from_config(cfg.policy)
    assert rules.slow_factor == 2.0 and rules.switch_to == "wbsp" and rules.jobs == "train-*"
    assert rules_from_config(config.parse({}).policy) == PolicyRules()
    with pytest.raises(config.ConfigError, match="policy.switch_to"):
        config.parse({"policy": {"switch_to": "fastest"}})
    with pytest.raises(config.ConfigError, match="policy.even_factor: must be at most"):
        config.parse({"policy": {"slow_factor": 1.4, "even_factor": 1.6}})
    assert {"policy.slow_factor", "policy.auto_switch", "policy.switch_to"} <= config.RELOADABLE


def test_detector_and_policy_together_switch_and_switch_back_on_a_middle_phase_straggler():
    # 3x slower for rounds 100..200 of 400; sync until the switch, quorum:3 after it (the simulation
    # follows the strategy the policy picks: the job is re-simulated from the switch on)
    rules = PolicyRules()
    job = Job(rules)
    det = Detector(4, rules.detector())
    sync_part = simulate(4, const(0.02, 3.0, start=100, end=200), rounds=400, seed=9)
    switched_at = None
    for s in sync_part:
        o = det.update(s)
        if o is not None and job.feed(o) is not None:
            switched_at = o.round
            break
    assert switched_at is not None and 100 < switched_at <= 100 + 20, switched_at
    # from here on the data plane runs quorum:3: the straggler's contributions come late
    rest = simulate(4, const(0.02, 3.0, end=200 - switched_at), rounds=400 - switched_at, strategy="quorum", k=3,
                    seed=10)
    offset_t, offset_r = s.t, switched_at + 1
    base = s
    for q in rest:
        shifted = type(q)(q.t + offset_t, tuple(a + b for a, b in zip(q.contributions, base.contributions)),
                          tuple(a + b for a, b in zip(q.lag_ns_sum, base.lag_ns_sum)),
                          tuple(a + b for a, b in zip(q.late, base.late)),
                          tuple(None if r is None else r + offset_r for r in q.last_round))
        o = det.update(shifted)
        if o is not None:
            job.feed(o)
    assert [s for _, s, _ in job.log] == ["quorum:3:50ms", "sync"], job.log
    back_at = job.log[1][0]
    assert 200 + rules.even_rounds <= back_at <= 200 + rules.even_rounds + 40, back_at


def test_going_back_also_needs_every_members_contributions_within_even_factor_of_the_median():
    # rank 3 reads even (the detector's per-interval rate view reads a straggler left behind by the
    # quorum low) but makes a member's contributions at 1/1.6 of the others' rate: no return
    job = Job(RULES)
    for r in range(4, 20, 4):
        job.feed(obs(r, {3: 3.0}, counts={}))                      # switch at 8, from round 10
    for r in range(20, 200, 4):
        job.feed(obs(r, {3: 1.2}, counts={3: 10 + int((r - 10) / 1.6)}))
    assert [s for _, s, _ in job.log] == ["quorum:3:50ms"]
    assert "rank 3 made 1/1.5" in job.policy.note and "over the last 20 rounds under quorum:3:50ms" in job.policy.note
    # it recovers at round 200: back once the last 20 rounds' contributions are within 1.35x
    behind = 10 + int((200 - 10) / 1.6)
    for r in range(200, 260, 4):
        job.feed(obs(r, {3: 1.0}, counts={3: behind + r - 200}))
    assert [s for _, s, _ in job.log] == ["quorum:3:50ms", "sync"]
    assert 200 < job.log[1][0] <= 200 + 20, job.log


def test_a_member_declared_gone_does_not_hold_the_job_on_the_quorum():
    job = Job(RULES)
    for r in range(4, 20, 4):
        job.feed(obs(r, {3: 3.0}, counts={}))
    for r in range(20, 80, 4):                                    # rank 2 gone at 10: it contributes no more
        job.feed(obs(r, counts={2: 10}, gone=(2,)))
    assert [s for _, s, _ in job.log] == ["quorum:3:50ms", "sync"]


def play(step, *, rounds: int, comm: float, seed: int = 1):
    """Detector and policy on a job whose strategy follows the policy (tests/harness/straggler_sim.follow)."""
    rules = PolicyRules()
    job = Job(rules)
    det = Detector(4, rules.detector())
    seen = []

    def decide(snap):
        o = det.update(snap)
        if o is None:
            return None
        strategy = job.strategy
        job.feed(o)
        seen.append((strategy, o, job.policy.note))
        return job.strategy

    return follow(4, step, decide, rounds=rounds, comm=comm, seed=seed), job, seen


@pytest.mark.parametrize("compute, slow, comm", [(0.02, 2.25, 0.02), (0.02, 1.7, 0.0037)])
def test_a_steady_straggler_gets_one_switch_to_the_quorum_and_no_return(compute, slow, comm):
    # rank 3's extra compute is small beside the round's communication: 20 ms of compute, 20 ms of
    # communication, 45 ms for rank 3 (1.6x a round); or the benchmark's 20 ms + 3.7 ms, 1.7x. Under
    # sync the detector sees it 1.6x slow; under the quorum its per-interval rate view reads it
    # below even_factor (about 1.2x: one round's worth forgiven of 5 an interval), and the policy
    # used to go back to sync after even_rounds, and to the quorum again: sync -> quorum -> sync -> ...
    history, job, seen = play(const(compute, slow), rounds=500, comm=comm)
    assert [s for _, s in history] == ["sync", "quorum:3:50ms"], history
    assert history[1][0] <= 30
    under_quorum = [o.workers[3].slowdown for s, o, _ in seen if s != "sync"]
    assert sorted(under_quorum)[len(under_quorum) // 2] < 1.35     # what the readings alone said
    notes = [n for _, _, n in seen if n.startswith("staying on quorum:3:50ms: rank 3 made 1/1.")]
    assert len(notes) > 10, [n for _, _, n in seen]


@pytest.mark.parametrize("compute, slow, comm", [(0.02, 2.25, 0.02), (0.02, 1.7, 0.0037), (0.02, 3.0, 0.0)])
def test_a_straggler_that_recovers_under_the_quorum_gets_the_job_back_to_sync(compute, slow, comm):
    history, job, _ = play(const(compute, slow, end=200), rounds=500, comm=comm)
    assert [s for _, s in history] == ["sync", "quorum:3:50ms", "sync"], history
    # the readings come down from the slow phase (EWMA), then even_rounds (as the middle-phase test)
    assert 200 < history[2][0] <= 200 + PolicyRules().even_rounds + 40, history
    assert "in step time and in contributions" in job.log[-1][2]
