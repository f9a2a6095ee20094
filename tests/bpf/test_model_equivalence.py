"""The reference model and the real XDP program, packet by packet (BPF_PROG_TEST_RUN).

Every packet goes through ``aggd.core.model.AggregatorModel`` and through the production XDP program; they
must agree on the verdict (XDP_DROP / XDP_TX / XDP_PASS), on the bytes of the aggd message sent and
on where it goes (the job's group or the sender), and, at the end of each sequence, on every per-job
counter and drop counter (the job's and the "no job" bucket). Time is frozen: the model gets
``now_ns`` and the program reads the same value from its one-entry ``clock`` map
(``XdpDataPlane.set_clock``); strategy tables go to both with ``set_strategy``.

Runs: the strategy fixture tables of tests/fixtures/scenarios.py (with their expectations),
and at least MIN_SEQUENCES randomised sequences per strategy (hypothesis; each example is a batch of
BATCH sequences; each sequence starts from a freshly installed job) built by that module's
``Traffic``: members in random order, several chunks and rounds, windows, duplicates and
retransmissions, re-reads, late and early contributions, extra wbsp steps (some beyond 7), unequal
exponents, overflow-prone values, malformed packets, non-members, quorum deadlines, and random
strategy swaps at round boundaries. Contributions and refused packets carry junk in the header fields
the aggregator must overwrite (results) or zero (NACKs).
"""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.harness.equivalence import (KINDS, NO_SHRINK, SEQUENCE_SETTINGS, SWAP_TEXTS, play_scenario, departures,
                                       run_sequence, sequences, swaps, table_for)
from aggd_client.protocol import Precision
from tests.harness.xdp_model import Harness
from tests.fixtures.scenarios import SCENARIOS, entry

pytestmark = pytest.mark.root

MIN_SEQUENCES = 1000     #: per strategy
BATCH = 5                #: sequences per hypothesis example
SWAP_SEQUENCES = 1000    #: sequences with random strategy swaps
DEPARTURE_SEQUENCES = 500  #: sequences in which members are declared gone (and come back)
ODD_ELEMENTS = 7         #: a packet size the pairwise payload loops do not divide
ODD_SEQUENCES = 200      #: per strategy, at ODD_ELEMENTS
FRAGS_SEQUENCES = 100    #: per strategy, at native XDP's largest packet (a multi-buffer frame)


# ---------------------------------------------------------------------------------------------
# The fixture tables.

@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(harness, name):
    play_scenario(harness, name)


# ---------------------------------------------------------------------------------------------
# Randomised sequences.

RUN: collections.Counter = collections.Counter()   # sequences compared, by strategy

#: AGGD_SHRINK=1 shrinks a failing batch to a minimal one (minutes per test).
PHASES = tuple(Phase) if os.environ.get("AGGD_SHRINK") else NO_SHRINK
SETTINGS = settings(SEQUENCE_SETTINGS, max_examples=MIN_SEQUENCES // BATCH, phases=PHASES)


@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences(harness, kind):
    before = RUN[kind]

    @SETTINGS
    @given(batch=st.lists(sequences, min_size=BATCH, max_size=BATCH))
    def sequences_agree(batch):
        for shape, ops in batch:
            run_sequence(harness, RUN, kind, table_for(kind, shape), shape, ops)

    sequences_agree()
    assert RUN[kind] - before >= MIN_SEQUENCES


@pytest.fixture(scope="module")
def odd_harness():
    """The program built for an odd packet size: the payload loops that take lanes in pairs end with a
    lone lane (xdp/aggd_lanes.h)."""
    from aggd.dataplane.xdp.loader import XdpDataPlane
    dp = XdpDataPlane(None, elements=ODD_ELEMENTS, total_slots=64)
    yield Harness(dp, ODD_ELEMENTS)
    dp.close()


def sequences_at_packet_size(h, kind: str, label: str, count: int, **run_kw) -> None:
    """``count`` random sequences of strategy ``kind`` (with a swap in some) on harness ``h``,
    built for its own packet size (``run_kw``: more of ``run_sequence``'s, e.g. ``precision``)."""
    before = RUN[label]

    @settings(SETTINGS, max_examples=count // BATCH)
    @given(batch=st.lists(st.tuples(sequences, st.lists(swaps, max_size=1)), min_size=BATCH, max_size=BATCH))
    def sequences_agree(batch):
        for (shape, ops), changes in batch:
            run_sequence(h, RUN, label, table_for(kind, shape), shape, ops, changes[0] if changes else (),
                         elements=h.elements, **run_kw)

    sequences_agree()
    assert RUN[label] - before >= count


@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences_odd_elements(odd_harness, kind):
    sequences_at_packet_size(odd_harness, kind, f"odd {kind}", ODD_SEQUENCES)


@pytest.fixture(scope="module")
def frags_harness():
    """The program built for multi-buffer frames (XDP frags), at the largest packet native XDP takes
    (an MTU of 9000): BPF_PROG_TEST_RUN hands it the frame in several buffers, as a NIC or a veth
    would, so the payload goes through bpf_xdp_load_bytes / bpf_xdp_store_bytes."""
    from aggd.dataplane.xdp.loader import XdpDataPlane
    from aggd_client.protocol import NATIVE_MAX_ELEMENTS, PAGE_MAX_ELEMENTS
    assert NATIVE_MAX_ELEMENTS * 4 > 4096 > PAGE_MAX_ELEMENTS * 4
    dp = XdpDataPlane(None, elements=NATIVE_MAX_ELEMENTS, total_slots=64)
    assert dp.frags
    yield Harness(dp, NATIVE_MAX_ELEMENTS)
    dp.close()


@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences_multi_buffer_frames(frags_harness, kind):
    sequences_at_packet_size(frags_harness, kind, f"frags {kind}", FRAGS_SEQUENCES)


def test_random_sequences_with_hot_swaps(harness):
    before = RUN["swap"]

    @settings(SETTINGS, max_examples=SWAP_SEQUENCES // BATCH)
    @given(batch=st.lists(st.tuples(sequences, st.sampled_from(SWAP_TEXTS), swaps), min_size=BATCH,
                          max_size=BATCH))
    def swapped_sequences_agree(batch):
        for (shape, ops), first, changes in batch:
            run_sequence(harness, RUN, "swap", [entry(first)], shape, ops, changes)

    swapped_sequences_agree()
    assert RUN["swap"] - before >= SWAP_SEQUENCES


def test_random_sequences_with_departures(harness):
    """Members declared gone mid-sequence (and back): a round waiting only for them is released
    at the next packet to its slot (rule 0), under every strategy and across swaps."""
    before = RUN["departures"]

    @settings(SETTINGS, max_examples=DEPARTURE_SEQUENCES // BATCH)
    @given(batch=st.lists(st.tuples(sequences, st.sampled_from(SWAP_TEXTS), st.lists(swaps, max_size=1), departures),
                          min_size=BATCH, max_size=BATCH))
    def departed_sequences_agree(batch):
        for (shape, ops), first, changes, leaving in batch:
            run_sequence(harness, RUN, "departures", [entry(first)], shape, ops,
                         changes[0] if changes else (), departures=leaving)

    departed_sequences_agree()
    assert RUN["departures"] - before >= DEPARTURE_SEQUENCES


# ---------------------------------------------------------------------------------------------
# Simulated training (tests/harness/member_sim.py): members following the client's rules (rounds,
# admission, wbsp steps, acknowledgements, retransmissions, quorum catch-up) over a network with
# delays and losses, with a hot swap every 8 rounds, as the data plane sees real training.

#: (seed, the client's admission or the one that did not count carried steps): the latter's rounds
#: hold more terms than they were quantised for, so overflow-flagged results are compared too.
SIMULATIONS = ((5, "unbounded"), (41, "unbounded"), (0, "unbounded"), (5, "client"), (7, "client"), (11, "client"))


@pytest.mark.parametrize("seed,admission", SIMULATIONS)
def test_simulated_training_with_hot_swaps(harness, seed, admission):
    from tests.harness.member_sim import Sim, client_admission, unbounded_admission
    rule = unbounded_admission if admission == "unbounded" else client_admission
    sim = Sim(seed, plane=harness, admission=rule, loss_down=0, rounds=60, slow=4.0, delay_ms=2.0,
              swap_every=8).run(until_ms=5000)
    harness.check_counters(f"simulation seed {seed} ({admission}), swaps {sim.swaps}")
    assert sim.releases and all(m._next_round == sim.rounds for m in sim.members)
    assert bool(sim.over_terms()) == (admission == "unbounded"), sim.over_terms()[:2]


@pytest.mark.parametrize("seed", (2, 7))
def test_simulated_training_losing_results(harness, seed):
    """5% of results lost under ssp/async/sync/wbsp swaps: the program keeps a released round for
    its members' re-reads (Bank.held) and lets a refused key go first (Slot.pending) as the model
    does, and every member gets every result (tests/unit/test_lost_results.py)."""
    from tests.harness.member_sim import Sim
    sim = Sim(seed, plane=harness, loss=0.03, loss_down=0.05, rounds=60,
              strategies=("sync", "ssp:2", "ssp:1", "wbsp", "async")).run(until_ms=30_000)
    harness.check_counters(f"simulation seed {seed}, swaps {sim.swaps}")
    assert all(m._next_round == sim.rounds and not m.rounds for m in sim.members)


def test_simulated_training_several_chunks_a_slot(harness):
    """6 chunks a round on 2 slots under loss and swaps: a released round kept from every new round
    until held, released banks strictly oldest first, and a later round's key proving a result held
    where the slot serves several chunk indices, as the model does
    (tests/unit/test_lost_results.py)."""
    from tests.harness.member_sim import Sim
    sim = Sim(3, plane=harness, loss=0.03, loss_down=0.05, rounds=60, chunks=6, slots=2,
              strategies=("sync", "ssp:2", "ssp:1", "wbsp", "async")).run(until_ms=30_000)
    harness.check_counters(f"simulation seed 3, swaps {sim.swaps}")
    assert all(m._next_round == sim.rounds and not m.rounds for m in sim.members)



@pytest.mark.parametrize("chunks,sizes,slots,start,strategies", [
    (20, (), 4, "quorum:3:20ms", ("quorum:3:20ms",)),
    (0, (1, 3, 4, 1, 9, 2), 2, "quorum:3:20ms", ("quorum:3:20ms",)),
    (6, (), 2, "sync", ("sync", "quorum:3:20ms", "ssp:2", "async", "wbsp"))], ids=["quorum", "sizes", "swaps"])
def test_simulated_training_quorum_in_shared_slots(harness, chunks, sizes, slots, start, strategies):
    """Quorum where slots serve several chunk indices, under loss (and swaps; or tensors of several
    sizes, where later rounds with Flag.ORDERED prove results held): a released quorum bank of
    such a round kept until every awaited member holds it, and a straggler late for it answered
    with it though no bank is free to carry its values (``uncarried``), as the model does
    (tests/unit/test_quorum_stragglers.py)."""
    from tests.harness.member_sim import Sim
    sim = Sim(1, plane=harness, loss=0.05, loss_down=0.05, rounds=40, chunks=chunks, sizes=sizes, slots=slots,
              start=start, strategies=strategies, swap_every=6 if len(strategies) > 1 else 10**9).run(until_ms=30_000)
    harness.check_counters(f"simulation seed 1, swaps {sim.swaps}")
    assert all(m._next_round == sim.rounds and not m.rounds for m in sim.members)


#: Random sequences a strategy and narrow precision: int8 and int16 contributions, spread into the
#: packed lanes and sent as int16 / int32 results (docs/protocol.md, "Precision"), half of them with
#: room for the result. The values include each type's largest magnitudes. ``page``: in a frame the
#: program grows; ``frags``: at native XDP's largest packet, where a multi-buffer frame cannot grow
#: and the program takes a narrow contribution only with room (aggd_xdp.c, AGGD_NARROW_GROWS): the
#: others go up.
NARROW_SEQUENCES = {"page": 120, "frags": 30}   #: per strategy and precision


@pytest.mark.parametrize("build", ["page", "frags"])
@pytest.mark.parametrize("precision", (Precision.INT8, Precision.INT16))
@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences_narrow(request, build, kind, precision):
    h = request.getfixturevalue("harness" if build == "page" else "frags_harness")
    sequences_at_packet_size(h, kind, f"{build} {precision.name.lower()} {kind}", NARROW_SEQUENCES[build],
                             precision=precision)


#: A sequence CI's random draw found (2026-11-29): an int8 async job swapped to ssp:1 and sync on
#: one slot. The pending key (2, 0), refused under async, was refused again once sync governed its
#: round; the model then forgot it (the program, as docs/protocol.md says, keeps it until a bank
#: holds it), so at op 62 it opened round (2, 1), which the program refused ``busy``.
FOUND_NARROW_ASYNC = (103, [8745, 138243716, 4214507, 80067, 26427, 396997, 173, 143, 248612, 360606, 51503, 1, 1201,
                            9927, 3264, 8746964, 668, 186, 12666, 9359391, 1058283, 1101445, 28, 82949, 959, 969860,
                            660346, 255, 131073, 9521, 21501161, 190490, 145590, 65133527, 66237, 636374, 37611, 4175,
                            267753, 31616, 54, 827, 1316, 334519881, 231, 261, 16112, 39625, 11038, 5997, 26286, 82,
                            1904, 17632, 4469, 1645, 32327055, 1874, 839, 4151996, 73937682, 0, 880198857, 195345, 14,
                            874, 27309, 923196091, 4294967294, 14415, 926026531, 2031584, 43, 65514, 253215],
                      [(50, "ssp:1", 2), (36, "sync", 1), (24, "ssp:1", 1), (23, "ssp:1", 2)])


def test_a_narrow_async_sequence_found_in_ci(harness):
    shape, ops, swapped = FOUND_NARROW_ASYNC
    run_sequence(harness, RUN, "found narrow async", table_for("async", shape), shape, ops, swapped,
                 elements=harness.elements, precision=Precision.INT8)


@pytest.mark.parametrize("precision", (Precision.INT8, Precision.INT16))
def test_narrow_packets_without_room_go_up_in_multi_buffer_frames_and_are_rerun(frags_harness, precision):
    """A narrow packet without room for its result goes up from the multi-buffer build, counted; the
    daemon's re-run (``XdpDataPlane.rerun``) adds the room and the program decides it as the model
    decides the same packet with room."""
    from aggd.core.model import AggregatorModel, JobConfig
    from aggd.dataplane.xdp.bpf_syscall import XDP_PASS, prog_test_run
    from aggd_client.protocol import LANES, Header, MsgType, values_per_packet
    from tests.bpf.conftest import job_config
    from tests.fixtures.scenarios import GROUP
    from tests.harness.equivalence import frame, member
    dp, E = frags_harness.dp, frags_harness.elements
    lanes, values = LANES[precision], values_per_packet(frags_harness.elements, precision)
    members = {0: member(0), 1: member(1)}
    assert dp.frags and dp.narrow
    model = AggregatorModel(E, frames_grow=False)
    model.add_job(JobConfig(job=7, world=2, slots=4, max_chunks=64, members=members, group=GROUP,
                            precision=precision))
    dp.install_job(job_config(job=7, world=2, slots=4, max_chunks=64, members=members, group=GROUP,
                              precision=int(precision)))
    try:
        rng = np.random.default_rng(3)
        for r in (0, 1):
            q = rng.integers(-lanes.contrib_max, lanes.contrib_max + 1, values).astype(lanes.contrib)
            data = Header(type=MsgType.CONTRIB, job=7, rank=r, count=values, code=int(precision)).pack() + q.tobytes()
            assert prog_test_run(dp.prog_fd, frame(data, member(r))).verdict == XDP_PASS
            assert model.process(data, member(r), 0).action == "pass"
            want = model.process(data + bytes(values * (lanes.result_bytes - lanes.contrib_bytes)), member(r), 0)
            got = dp.rerun(data, member(r))
            assert (got.action, got.out, got.dest) == (want.action, want.out, want.dest)
        assert want.action == "tx" and len(want.out) == 40 + 4 * E
        assert dp.job_stats(7).counters["to_userspace"] == 2
    finally:
        dp.remove_job(7)


#: Random sequences a strategy with a per-member bound (docs/protocol.md, "Bounds"): the traffic's
#: values (up to 1000, or near 2**31; scaled by exponents -2..5) now within it, now beyond.
BOUNDED_SEQUENCES = 100


def bounded_sequences(harness, label: str, kind: str, precision: Precision, count: int, limits: tuple,
                      key: str) -> int:
    """``count`` sequences of a job whose ``key`` (``bound`` or ``norm_bound``) is one of
    ``limits`` (each a ``Bound.of`` argument), counted under ``label``; returns how many
    contributions were dropped out_of_bounds meanwhile."""
    from aggd.core.model import Bound
    before, refused = RUN[label], harness.seen[("drop", "out_of_bounds", None)]

    @settings(SETTINGS, max_examples=count // BATCH)
    @given(batch=st.lists(st.tuples(sequences, st.sampled_from(limits)), min_size=BATCH, max_size=BATCH))
    def sequences_agree(batch):
        for (shape, ops), limit in batch:
            run_sequence(harness, RUN, label, table_for(kind, shape), shape, ops, precision=precision,
                         **{key: Bound.of(limit)})

    sequences_agree()
    assert RUN[label] - before >= count
    return harness.seen[("drop", "out_of_bounds", None)] - refused


@pytest.mark.parametrize("precision", (Precision.INT32, Precision.INT16, Precision.INT8))
@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences_bounded(harness, kind, precision):
    bounded_sequences(harness, f"bounded {precision.name.lower()} {kind}", kind, precision, BOUNDED_SEQUENCES,
                      (0.5, 300.0, 900.0, 2.0**30), "bound")
    assert harness.seen[("drop", "out_of_bounds", None)] > 0


NORM_SEQUENCES = 50      #: per strategy and precision, with a bound on the L2 norm


@pytest.mark.parametrize("precision", (Precision.INT32, Precision.INT16, Precision.INT8))
@pytest.mark.parametrize("kind", ("sync", "quorum"))
def test_random_sequences_norm_bounded(harness, kind, precision):
    """A bound on the L2 norm: sums of squares from a few values to 2**64 and beyond (saturated in
    the kernel), bounds now above, now below them."""
    refused = bounded_sequences(harness, f"norm-bounded {precision.name.lower()} {kind}", kind, precision,
                                NORM_SEQUENCES, (0.5, 3000.0, 20000.0, 2.0**35), "norm_bound")
    assert refused > 0     # some contributions were beyond it


@pytest.mark.parametrize("kind", ["sync", "quorum"])
def test_int8_results_of_an_odd_packet_size(odd_harness, kind):
    """An int8 job's int16 results at an odd packet size: the last value is half a 32-bit word of
    the UDP checksum's sum (the harness checks every result's checksum)."""
    sequences_at_packet_size(odd_harness, kind, f"odd int8 {kind}", 30, precision=Precision.INT8)
