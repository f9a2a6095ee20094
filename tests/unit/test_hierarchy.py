"""Two levels of aggregators in the reference model (docs/protocol.md, "Two levels"): racks forward
complete rounds to an upper aggregator as one contribution each and relay its results; under loss
every worker of every rack gets the same, exact sum of every worker's contribution."""
from __future__ import annotations

import numpy as np
import pytest

from aggd.core.model import AggregatorModel, BankState, Upstream
from aggd.core.strategy import parse, to_entry
from aggd_client.protocol import Counter, DropReason, Flag, Header, MsgType, PAYLOAD_DTYPE

from tests.harness.tree_sim import (RACK_JOB, UPPER, UPPER_JOB, Tree, contribution, exact, link, model_tree,
                                    rack_addr, rack_config, worker_addr)

E = 8


def check_every_sum(workers, members, racks, calls):
    for w in workers:
        for round_, n in enumerate(calls):
            for chunk in range(n):
                values, h = w.got[(round_, chunk)]
                assert values.tolist() == exact(workers, members, racks, round_, chunk, E).tolist(), (w.r, w.m)
                assert h.exponent == 0 and not h.flags & Flag.OVERFLOW
                assert h.n_contrib == members * racks          # every worker, for a mean
                assert h.contributors == (1 << members) - 1    # the rack's own members
                assert h.job == RACK_JOB


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("loss", [0.0, 0.1, 0.3])
def test_every_worker_gets_the_exact_sum_of_every_rack(seed, loss):
    racks, members = 3, 2
    calls = [5, 1, 9, 2, 2, 12, 1]            # sizes that shrink and grow, more chunks than slots
    rack_planes, upper = model_tree(racks, members, elements=E, slots=4)
    tree = Tree(rack_planes, upper, members, E, slots=4, loss=loss, seed=seed)
    workers = tree.run(calls)
    check_every_sum(workers, members, racks, calls)
    for m in rack_planes:
        c = m.counters(RACK_JOB)
        assert c[Counter.RELEASED] == sum(calls)            # each round of each chunk released once
        assert c[Counter.FORWARDED] >= sum(calls)           # re-sent when the upper or its answer was lost
        assert c[Counter.RELAYED] >= sum(calls)
        if loss == 0:
            assert c[Counter.FORWARDED] == sum(calls)
    assert upper.counters(UPPER_JOB)[Counter.RELEASED] == sum(calls)


def forward_round(m: AggregatorModel, members: int, r: int = 0, round_: int = 0, chunk: int = 0, flags=0):
    """Every member of rack ``r`` contributes; the last verdict."""
    v = None
    for k in range(members):
        data = Header(type=MsgType.CONTRIB, job=RACK_JOB, rank=k, round=round_, chunk=chunk, count=E,
                      flags=flags).pack() + contribution(r, k, members, round_, chunk, E).tobytes()
        v = m.process(data, worker_addr(r, k))
    return v


def test_a_complete_round_goes_up_as_one_contribution_that_holds_the_rack():
    m = AggregatorModel(E, userspace=True)
    m.add_job(rack_config(0, 3, slots=4))
    m.set_upstream(RACK_JOB, link(0))
    v = forward_round(m, 3)
    assert v.action == "tx" and v.dest == "upstream" and v.addrs == (UPPER,)
    h = v.header
    assert (h.type, h.job, h.rank, h.contributors, h.n_contrib) == (MsgType.CONTRIB, UPPER_JOB, 0, link(0).tag, 3)
    assert np.frombuffer(v.out, PAYLOAD_DTYPE, offset=40).tolist() == \
        sum(contribution(0, k, 3, 0, 0, E).astype(np.int64) for k in range(3)).tolist()
    # a member's retransmission sends it again, flagged; a re-read waits
    again = m.process(Header(type=MsgType.CONTRIB, job=RACK_JOB, rank=1, round=0, chunk=0, count=E,
                             flags=Flag.RETRANSMIT).pack() + bytes(4 * E), worker_addr(0, 1))
    assert again.dest == "upstream" and again.header.flags & Flag.RETRANSMIT and again.out[40:] == v.out[40:]
    reread = m.process(Header(type=MsgType.REREAD, job=RACK_JOB, rank=1, round=0, chunk=0, count=E).pack()
                       + bytes(4 * E), worker_addr(0, 1))
    assert reread.reason == DropReason.NOT_READY


def test_a_round_complete_before_the_link_is_sent_by_the_next_retransmission():
    m = AggregatorModel(E, userspace=True)
    m.add_job(rack_config(0, 2, slots=4))
    v = forward_round(m, 2)
    assert v.action == "drop" and v.reason is None          # kept, nothing to send it to yet
    m.set_upstream(RACK_JOB, link(0))
    again = forward_round(m, 2, flags=Flag.RETRANSMIT)
    assert again.dest == "upstream" and again.header.n_contrib == 2


def test_the_upper_result_is_kept_and_relayed_and_strangers_results_refused():
    m = AggregatorModel(E, userspace=True)
    m.add_job(rack_config(0, 2, slots=4))
    m.set_upstream(RACK_JOB, link(0))
    forward_round(m, 2)
    values = np.arange(E, dtype=PAYLOAD_DTYPE) * 7
    result = Header(type=MsgType.RESULT, job=UPPER_JOB, rank=0xFFFF, round=0, chunk=0, count=E, exponent=3,
                    n_contrib=6, contributors=0b111).pack() + values.tobytes()
    assert m.process(result, ("10.6.6.6", 47000)).reason == DropReason.BAD_TYPE   # not the upper one
    stale = Header.unpack(result)
    assert m.process(Header(**{**vars(stale), "round": 5}).pack() + values.tobytes(), UPPER).reason == \
        DropReason.STALE                                                          # not forwarded
    v = m.process(result, UPPER)
    assert v.dest == "group"
    h = v.header
    assert (h.job, h.round, h.exponent, h.n_contrib, h.contributors) == (RACK_JOB, 0, 3, 6, 0b11)
    assert v.out[40:] == values.tobytes()
    bank = m.jobs[RACK_JOB].slots[0].bank_of((0, 0))
    assert bank.state == BankState.RELEASED
    # a member that lost it: its retransmission is answered from the bank, with the upper's sum
    again = forward_round(m, 2, flags=Flag.RETRANSMIT)
    assert again.dest == "sender" and again.out[40:] == values.tobytes() and again.header.flags & Flag.REREAD


def test_a_later_upper_result_of_a_relayed_round_goes_on_labelled_as_it_came():
    """Under an async upper job the rack relays the running sum first (its own rack's, n_contrib 2
    at exponent 3), then the round's release (both racks', n_contrib 4 at exponent 2): the second
    goes to the members with its own values, exponent and n_contrib. It went with the first's
    exponent and n_contrib, so a member that had not taken the first read the whole sum at the
    wrong scale, as a partial one (a flaky test of racks under an async upper job)."""
    m = AggregatorModel(E, userspace=True)
    m.add_job(rack_config(0, 2, slots=4))
    m.set_upstream(RACK_JOB, link(0))
    forward_round(m, 2)

    def upper(values, exponent, n_contrib, flags=0):
        return Header(type=MsgType.RESULT, job=UPPER_JOB, rank=0xFFFF, round=0, chunk=0, count=E, exponent=exponent,
                      n_contrib=n_contrib, flags=flags).pack() + values.tobytes()

    partial, whole = np.arange(E, dtype=PAYLOAD_DTYPE), np.arange(E, dtype=PAYLOAD_DTYPE) * 3
    first = m.process(upper(partial, 3, 2), UPPER)
    assert (first.header.exponent, first.header.n_contrib) == (3, 2) and first.out[40:] == partial.tobytes()
    second = m.process(upper(whole, 2, 4, Flag.CARRIED), UPPER)
    assert second.dest == "group" and second.out[40:] == whole.tobytes()
    assert (second.header.exponent, second.header.n_contrib) == (2, 4) and second.header.flags & Flag.CARRIED
    # the bank keeps the first: a member's re-read gets what the others took
    again = forward_round(m, 2, flags=Flag.RETRANSMIT)
    assert again.out[40:] == partial.tobytes() and (again.header.exponent, again.header.n_contrib) == (3, 2)


def test_a_partial_sum_that_overflows_is_flagged_to_the_members():
    m = AggregatorModel(E, userspace=True)
    m.add_job(rack_config(0, 2, slots=4))
    m.set_upstream(RACK_JOB, link(0))
    big = np.full(E, 2**31 - 1, PAYLOAD_DTYPE)
    for k in range(2):
        v = m.process(Header(type=MsgType.CONTRIB, job=RACK_JOB, rank=k, round=0, chunk=0, count=E).pack()
                      + big.tobytes(), worker_addr(0, k))
    up = Header.unpack(v.out)
    result = Header(type=MsgType.RESULT, job=UPPER_JOB, rank=0xFFFF, round=0, chunk=0, count=E,
                    n_contrib=up.n_contrib).pack() + v.out[40:]
    relayed = m.process(result, UPPER)
    assert relayed.header.flags & Flag.OVERFLOW
    assert m.counters(RACK_JOB)[Counter.OVERFLOWS] == 1


def test_a_rack_job_is_sync_only():
    m = AggregatorModel(E, userspace=True)
    bad = rack_config(0, 2, slots=4)
    bad.strategy = parse("quorum:1")
    with pytest.raises(ValueError, match="sync"):
        m.add_job(bad)
    m.add_job(rack_config(0, 2, slots=4))
    with pytest.raises(ValueError, match="sync"):
        m.set_strategy(RACK_JOB, [to_entry(parse("ssp:1"), 1, 5)])


def test_a_flat_job_counts_a_partial_sum_as_the_contributions_it_holds():
    """The upper job is an ordinary one: a contribution's n_contrib (a rack's) adds that many."""
    rack_planes, upper = model_tree(2, 3, elements=E)
    for r in range(2):
        v = forward_round(rack_planes[r], 3, r=r)
        out = upper.process(v.out, rack_addr(r))
    assert out.dest == "group" and out.header.n_contrib == 6
