"""The rule behind issue 15's finding 4 (every worker died with AggregationOverflowError about two
rounds after a hot swap from ``ssp:2`` into ``wbsp``): a member learns of a swap only from the first
result of the new strategy. Under ``ssp:2`` it runs ahead, so it has sent step 0 of rounds that
``wbsp`` governs while it still believed ``ssp`` (room for ``world`` terms); once it learns of
``wbsp`` it pushes further steps into those rounds (room for ``4 * world``). A round then holds
more than its senders left room for, and large gradients overflow it. With the job's one headroom
for every round (the JOIN_ACK's) that cannot happen. Through the reference model, which every data
plane is tested equal to."""
from __future__ import annotations

import numpy as np
import pytest

from aggd.core.model import AggregatorModel
from aggd.core.registry import Limits, Registry, RegistryError
from aggd_client import AggClient, quant
from aggd_client.protocol import Flag, Header, MsgType, StrategyKind

from tests.fixtures.scenarios import E, JOB, addr, entry, job_config, tag

WORLD = 4
STEPS = quant.HEADROOM[StrategyKind.WBSP]


def wbsp_round(terms_step0: int, terms_later: int) -> Header:
    """A round governed by ``wbsp`` in which every member sent step 0 quantised for ``terms_step0``
    and steps 1..3 for ``terms_later``: step 0's gradient half as large again as the later ones',
    which are just below a power of two (so they use nearly all the room they were given); the
    result's header."""
    m = AggregatorModel(E)
    m.add_job(job_config(WORLD, 1, 8))
    m.set_strategy(JOB, [entry("wbsp")])
    v = None
    for step in (1, 2, 3, 0):                              # a round releases once every step 0 is in
        for rank in range(WORLD):
            x = np.full(E, 1.5 if step == 0 else 0.99)
            q, e = quant.quantise_flat(x, WORLD, E, terms=terms_step0 if step == 0 else terms_later)
            data = Header(type=MsgType.CONTRIB, job=JOB, rank=rank, count=E, step=step, exponent=int(e[0]),
                          contributors=tag(rank)).pack() + q.astype("<i4").tobytes()
            v = m.process(data, addr(rank), 1000)
    assert v.action == "tx" and v.header.n_contrib == WORLD * STEPS, v
    return v.header


def test_headroom_per_strategy_overflows_after_a_swap_into_wbsp():
    hdr = wbsp_round(quant.terms_for(WORLD, StrategyKind.SSP), quant.terms_for(WORLD, StrategyKind.WBSP))
    assert hdr.flags & Flag.OVERFLOW


def test_one_headroom_for_every_round_does_not():
    terms = WORLD * quant.MAX_HEADROOM
    assert not wbsp_round(terms, terms).flags & Flag.OVERFLOW


def test_clients_quantise_every_round_for_the_jobs_headroom():
    from aggd_client.rounds import _Round, _Send
    x = np.ones(1, np.float32)
    with AggClient(("127.0.0.1", 9), JOB, 0, WORLD, headroom=4) as joined, \
            AggClient(("127.0.0.1", 9), JOB, 0, WORLD) as plain:
        for kind in StrategyKind:
            rnd = _Round(0, (1,), np.float32, 1, E, False)
            assert _Send(joined, rnd, x, 0, kind).terms == WORLD * 4
            assert _Send(plain, rnd, x, 0, kind).terms == quant.terms_for(WORLD, kind)


def test_a_job_refuses_strategies_that_need_more_headroom_than_it_has():
    r = Registry(Limits(kernel_budget=0, elements=E, port=1, userspace_port=2, result_port=3))
    fine = r.create("fine", WORLD, headroom=1)
    assert fine.join_info()["headroom"] == 1 and r.create("any", WORLD).join_info()["headroom"] == quant.MAX_HEADROOM
    r.set_strategy("fine", "ssp:2", 0)
    for text, needs in (("quorum:3:5ms", 2), ("wbsp", 4)):
        with pytest.raises(RegistryError) as info:
            r.set_strategy("fine", text, 0)
        assert info.value.kind == "bad_strategy" and f"up to {needs} contributions" in str(info.value)
    with pytest.raises(RegistryError):
        r.create("wide", WORLD, strategy="wbsp", headroom=2)
    with pytest.raises(RegistryError):
        r.create("bad", WORLD, headroom=5)
    restored = Registry(r.limits)
    restored.load_json(r.to_json())
    assert restored.get("fine").headroom == 1
