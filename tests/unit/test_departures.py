"""aggd.core.departures: who is declared gone (a round has waited for it too long, and it sent
nothing as long), who is not (a paused job, a quorum, a member that only just spoke), and when a
gone member is awaited again."""
from __future__ import annotations

from aggd.core.departures import DepartureRules, Restart, keeps_pace, restart_of, silent_members, skipped_round_open

S = 1_000_000_000
RULES = DepartureRules(silent_after_s=5.0, silent_steps=20.0, readmit_rounds=2)


def row(rank, last_round, last_s):
    return {"rank": rank, "contributions": 1, "lag_ns_sum": 0, "late": 0, "last_round": last_round,
            "last_ns": int(last_s * S)}


def test_a_dead_member_that_a_round_waits_for_is_declared_gone():
    rows = [row(0, 7, 100), row(1, 7, 100), row(2, 6, 94)]      # rank 2 died after round 6
    open_rounds = [(7, 0b011, 100 * S)]                          # round 7 waits for it
    assert silent_members(rows, open_rounds, 104 * S, 0b111, RULES) == []     # 4 s: not yet
    (s,) = silent_members(rows, open_rounds, 106 * S, 0b111, RULES)
    assert (s.rank, s.last_round, s.waiting_round) == (2, 6, 7) and s.silent_s == 12.0
    assert "round 7 waits for it" in s.reason() and "last contribution in round 6" in s.reason()


def test_the_threshold_follows_the_usual_step():
    rows = [row(0, 7, 100), row(1, 6, 90)]
    open_rounds = [(7, 0b01, 100 * S)]
    assert silent_members(rows, open_rounds, 106 * S, 0b11, RULES, step_s=0.5) == []   # 20 steps = 10 s
    assert [s.rank for s in silent_members(rows, open_rounds, 111 * S, 0b11, RULES, step_s=0.5)] == [1]


def test_a_paused_job_a_member_just_heard_and_a_gone_member_are_left_alone():
    rows = [row(0, 7, 100), row(1, 7, 100), row(2, 6, 94)]
    assert silent_members(rows, [], 200 * S, 0b111, RULES) == []                      # nothing open
    assert silent_members(rows, [(7, 0b011, 199 * S)], 200 * S, 0b111, RULES) == []    # opened 1 s ago
    fresh = [row(0, 7, 100), row(1, 7, 100), row(2, 6, 199)]
    assert silent_members(fresh, [(7, 0b011, 100 * S)], 200 * S, 0b111, RULES) == []
    assert silent_members(rows, [(7, 0b011, 100 * S)], 200 * S, 0b011, RULES) == []   # gone already
    assert silent_members(rows, [(7, 0b100, 100 * S)], 200 * S, 0b011, RULES) == []   # only a gone one in it
    off = DepartureRules(silent_after_s=0)
    assert silent_members(rows, [(7, 0b011, 100 * S)], 200 * S, 0b111, off) == []


def test_a_member_that_never_sent_is_starting():
    rows = [row(0, 0, 100), row(1, None, 0)]
    assert silent_members(rows, [(0, 0b01, 100 * S)], 200 * S, 0b11, RULES) == []


def test_members_a_restart_waits_for_are_starting():
    """A script run again on a job that ran: rank 0 rejoined and opened round 8; ranks 1 and 2,
    silent since the last run, have not rejoined yet and are left alone however long it takes."""
    rows = [row(0, 8, 200), row(1, 7, 100), row(2, 7, 100)]
    assert [s.rank for s in silent_members(rows, [(8, 0b001, 200 * S)], 300 * S, 0b111, RULES)] == [1, 2]
    assert silent_members(rows, [(8, 0b001, 200 * S)], 300 * S, 0b111, RULES, starting=0b110) == []
    assert [s.rank for s in silent_members(rows, [(8, 0b001, 200 * S)], 300 * S, 0b111, RULES,
                                           starting=0b100)] == [1]


def test_members_restarting_one_by_one_start_at_one_round():
    """Each member rejoining gets the round the first of them got, even once that one has sent it,
    and the restart waits for the others; a survivor that goes on (or a rank rejoining twice) ends it."""
    first = restart_of(None, 0, {0: 7, 1: 7, 2: 7}, top=7)
    assert first == Restart(8, 7, frozenset({0})) and first.waiting_for(3) == 0b110
    # rank 0 has sent round 8 already (the job's newest is 8 now): rank 1 still starts at 8
    second = restart_of(first, 1, {0: 8, 1: 7, 2: 7}, top=8)
    assert second == Restart(8, 7, frozenset({0, 1})) and second.under_way({0: 9, 1: 8, 2: 7})
    assert second.waiting_for(3) == 0b100
    # one worker restarted alone while the others ran on: the next restart starts after their rounds
    assert not first.under_way({0: 8, 1: 8, 2: 7})
    assert restart_of(first, 2, {0: 8, 1: 8, 2: 7}, top=8) == Restart(9, 8, frozenset({2}))
    assert restart_of(second, 1, {0: 8, 1: 8, 2: 7}, top=8) == Restart(9, 8, frozenset({1}))
    assert restart_of(None, 0, {}, top=None) == Restart(0, None, frozenset({0}))


def test_awaited_again_once_it_keeps_pace():
    # rank 2 rejoined at round 10; the others must be at 12 and rank 2 at the newest round
    assert not keeps_pace([row(0, 11, 0), row(1, 11, 0), row(2, 11, 0)], 2, 10, 0b011, RULES)
    assert not keeps_pace([row(0, 13, 0), row(1, 12, 0), row(2, 12, 0)], 2, 10, 0b011, RULES)
    assert keeps_pace([row(0, 12, 0), row(1, 12, 0), row(2, 12, 0)], 2, 10, 0b011, RULES)
    assert not keeps_pace([row(0, 12, 0), row(1, 12, 0), row(2, None, 0)], 2, 10, 0b011, RULES)


def test_not_awaited_again_while_a_round_it_skipped_is_open():
    """Rounds in parallel (ssp): round 9, which rank 2 (rejoined at 10) never sends, is still open
    when it keeps pace otherwise; awaiting it again would make round 9 wait for it."""
    rows = [row(0, 12, 0), row(1, 12, 0), row(2, 12, 0)]
    skipped = [(9, 0b011, 0), (12, 0b111, 0)]
    assert skipped_round_open(skipped, 2, 10) == 9
    assert keeps_pace(rows, 2, 10, 0b011, RULES) and not keeps_pace(rows, 2, 10, 0b011, RULES, skipped)
    # round 9 has its contribution (it left after sending it), round 12 is one of its own: awaited
    assert keeps_pace(rows, 2, 10, 0b011, RULES, [(9, 0b111, 0), (12, 0b011, 0)])
    assert skipped_round_open([], 2, 10) is None


def test_silence_counts_from_the_daemons_start():
    """A restarted daemon does not hold its own downtime against the members."""
    rows = [row(0, 7, 100), row(1, 7, 100), row(2, 6, 94)]
    open_rounds = [(7, 0b011, 100 * S)]
    assert silent_members(rows, open_rounds, 106 * S, 0b111, RULES, since_ns=103 * S) == []
    assert [s.rank for s in silent_members(rows, open_rounds, 109 * S, 0b111, RULES, since_ns=103 * S)] == [2]
