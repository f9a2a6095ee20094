"""Shared chunk scales (aggd_client.scales): the rules every member applies alike, a call sent at
them, and error feedback over a sharded client whose members' scales differ."""
from __future__ import annotations

import time

import numpy as np
import pytest

from aggd_client import scales
from aggd_client.feedback import ErrorFeedback
from aggd_client.protocol.definition import ZERO_EXPONENT
from aggd_client.scales import ROOM_FLAGS, ChunkScales, PartScales

from tests.harness.ranks import run_and_close, sharded_members, userspace_aggregators

Z = ZERO_EXPONENT
E = 256


def cs(shared, own=None):
    shared = np.array(shared, np.int32)
    return ChunkScales(E, shared, shared if own is None else np.array(own, np.int32))


def test_after_a_call_the_result_is_shared_with_a_bit_of_room_where_it_moved():
    first = scales.after_call(None, cs([5, 7, Z]))
    assert first.shared.tolist() == [4, 6, Z]           # a key's first call: room everywhere
    later = scales.after_call(first, cs([4, 5, 9]))
    assert later.shared.tolist() == [4, 4, 8]           # kept where shared; a step coarser where not
    assert scales.after_call(cs([1, 2]), cs([4, 5, 9])).shared.tolist() == [3, 4, 8]   # another layout


def test_room_flags_and_finer_agree_on_the_least_room():
    # per chunk: shared 10; members' own 10 (no room), 12, 20 and 30; and a chunk without a shared one
    members = [cs([10, 10, 10, Z], own) for own in ([10, 12, 20, 3], [13, 14, 25, 3], [12, 30, 30, 3])]
    flags = [scales.room_flags(m) for m in members]
    assert flags[0].shape == (ROOM_FLAGS, 4) and flags[0].dtype == np.float32
    counts = np.sum(flags, axis=0)
    after = [scales.finer(m, counts.reshape(-1)).shared.tolist() for m in members]
    assert after[0] == after[1] == after[2]
    # least room 0 (no move), 2 (one step: a bit kept), 10 (capped at ROOM_FLAGS - 1), none
    assert after[0] == [10, 11, 10 + ROOM_FLAGS - 1, Z]


def test_an_all_zero_chunk_claims_no_room():
    m = cs([10], [Z])
    assert not scales.room_flags(m).any()


def test_part_scales_split_as_they_join():
    p = PartScales({(512, 900): cs([3, 4]), (0, 512): cs([1, 2])})
    assert p.shared.tolist() == [1, 2, 3, 4]
    q = p.with_shared(np.array([5, 6, 7, 8], np.int32))
    assert q.part(0, 512).shared.tolist() == [5, 6] and q.part(512, 900).shared.tolist() == [7, 8]
    assert q.part(0, 100) is None


def test_a_cap_from_another_layout_is_ignored():
    assert cs([1, 2]).cap_for(E, 3) is None and cs([1, 2]).cap_for(E + 1, 2) is None
    assert cs([1, 2]).cap_for(E, 2).tolist() == [1, 2]


@pytest.mark.parametrize("shared", [True, False], ids=["shared-scales", "own-scales"])
def test_error_feedback_over_two_aggregators_with_members_of_different_scales(shared):
    """Through a ShardedClient over two real user-space aggregators, 8 bits: each part keeps its
    chunks' shared scales, and what 32 calls delivered stays as far from the gradients after the
    second reset period as after the first; each member's own scale drifts."""
    world, H, calls, size = 3, 8, 32, 5 * E + 17
    rng = np.random.default_rng(3)
    grads = [[(rng.standard_normal(size) * (8.0 if r == world - 1 else 1.0)).astype(np.float32)
              for r in range(world)] for _ in range(calls)]

    def member(r, c):
        ef = ErrorFeedback(c, reset_every=H, shared_scales=shared)
        got = []
        for g in grads:
            if r == world - 1:
                time.sleep(0.003)
            got.append(ef.allreduce(g[r], key="g").astype(np.float64))
        return got, ef.last_handle.scales

    with userspace_aggregators(2, E) as aggs:
        out = run_and_close(sharded_members(aggs, 31, world, E, precision=8), member)
    got, sc = out[0]
    assert isinstance(sc, PartScales) and len(sc.parts) == 2
    step = np.concatenate([np.repeat(np.ldexp(1.0, -p.shared.astype(np.int64)), E)[:hi - lo]
                           for (lo, hi), p in sc.parts.items()])
    drift = []
    for end in range(H, calls + 1, H):
        exact = np.sum([np.sum(g, axis=0, dtype=np.float64) for g in grads[:end]], axis=0)
        drift.append(float(np.mean(np.abs(np.sum(got[:end], axis=0) - exact) / step)))
    print("shared" if shared else "own", [f"{d:.2f}" for d in drift])
    if shared:
        assert drift[-1] <= drift[0] + 0.1 and drift[0] < 1.5
    else:
        assert drift[-1] > drift[0] + 3
