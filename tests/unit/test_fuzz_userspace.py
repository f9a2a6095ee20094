"""Random and mutated packets through the user-space path: the numba fast path with the model
behind it decides every packet exactly as the model alone does and counts every one it does not
serve; and the real server (UDP socket, batches, answers) refuses and counts every one a stranger
sends and then serves its members' allreduce exactly. Packets of
tests/fixtures/fuzz.py."""
from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggd.core.model import AggregatorModel, JobConfig
from aggd.dataplane.userspace import fastpath, kernels
from aggd.dataplane.userspace.server import UserspaceAggregator
from aggd_client import AggClient
from aggd_client.mrecv import sockaddr_in
from aggd_client.protocol import HEADER_SIZE

from tests.fixtures.fuzz import WORLD, check_accounted, message, snapshot
from tests.fixtures.scenarios import E, JOB, entry, job_config, tag
from tests.fixtures.traffic import STRATEGY_TEXTS

REC = (HEADER_SIZE + 4 * E + 16 + 7) // 8 * 8   # the longest fuzz message


def new_model(text: str) -> AggregatorModel:
    m = AggregatorModel(E, userspace=True, arithmetic=kernels.KERNEL_ARITHMETIC)
    m.add_job(job_config(WORLD, 2, 8))
    m.set_strategy(JOB, [entry(text)])
    return m


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(text=st.sampled_from([t for t in STRATEGY_TEXTS if not t.startswith("quorum:4")]),
       packets=st.lists(message(E), min_size=1, max_size=40), batch_size=st.integers(1, 16))
def test_the_fast_path_decides_hostile_packets_as_the_model(text, packets, batch_size):
    ref, m = new_model(text), new_model(text)
    fp = fastpath.FastPath()
    fp.add_job(m, JOB)
    batch = fastpath.Batch(16, REC)
    stage = memoryview(batch.stage).cast("B")
    for start in range(0, len(packets), batch_size):
        part = packets[start:start + batch_size]
        for i, (data, src) in enumerate(part):
            batch.stage[i, :] = 0
            batch.stage[i, :len(data)] = np.frombuffer(data, np.uint8)
            batch.sizes[i] = len(data)
            batch.names[i] = np.frombuffer(sockaddr_in(src), np.uint8)
            batch.nows[i] = 1_000_000 * (start + i)
        slow = fp.process(batch, len(part), lambda i, part=part: m.process(
            stage[i * REC:i * REC + int(batch.sizes[i])], part[i][1], int(batch.nows[i])))
        for i, (data, src) in enumerate(part):
            before = snapshot(ref)
            want = ref.process(data, src, int(batch.nows[i]))
            check_accounted(ref, data, want, before)
            got = slow[i] if i in slow else fp.verdict(batch, i, src)
            assert got == want, (start + i, got, want)
    fp.sync()
    for bucket in (JOB, 256):
        assert m.drops(bucket).tolist() == ref.drops(bucket).tolist()
    assert m.counters(JOB).tolist() == ref.counters(JOB).tolist()


@pytest.fixture(scope="module")
def served():
    """A user-space server on loopback with one job of WORLD members (tagged), their clients, and a
    socket for a stranger; rank r's socket address is the member's."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(WORLD + 1)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    addrs = [s.getsockname() for s in socks]
    members = {r: addrs[r] for r in range(WORLD)}
    with UserspaceAggregator(("127.0.0.1", 0), E) as agg:
        agg.add_job(JobConfig(job=JOB, world=WORLD, slots=8, max_chunks=64, members=members,
                              tags={r: tag(r) for r in range(WORLD)}, group=None))
        clients = []
        try:
            for r in range(WORLD):   # the address is the member's: its client takes it over
                socks[r].close()
                clients.append(AggClient(agg.address, JOB, r, WORLD, bind=members[r], elements=E, slots=8,
                                         tag=tag(r), give_up_after=10))
            yield agg, clients, addrs, socks[WORLD]
        finally:
            for c in clients:
                c.close()
            socks[WORLD].close()


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(packets=st.lists(message(E, lambda r: ("127.0.0.1", r)), min_size=20, max_size=150))
def test_the_server_takes_hostile_packets_and_still_serves_its_members_exactly(served, packets):
    agg, clients, addrs, stranger = served

    def dropped() -> tuple[int, int, int]:
        """Every drop; the members' ``duplicate`` ones (a retransmission whose original was only
        slow, on a loaded host: a stranger's packet is never one, its address is no member's);
        the members' retransmissions."""
        job = agg.job_stats(JOB).drops
        return (sum(job.values()) + sum(agg.job_stats(None).drops.values()), job.get("duplicate", 0),
                sum(c.stats["retransmits"] for c in clients))

    before = dropped()
    for data, _ in packets:
        stranger.sendto(data, agg.address)
    handles = [c.allreduce_async(np.full(3 * E, r + 1, np.float32)) for r, c in enumerate(clients)]
    for h in handles:
        np.testing.assert_array_equal(h.wait(), np.full(3 * E, 6, np.float32))
    # a stranger's packets are all refused, each counted once (by the time the members' round is
    # answered, the server has read what the stranger sent before it)
    total, duplicates, retransmits = (a - b for a, b in zip(dropped(), before))
    assert total - duplicates == len(packets)
    assert duplicates <= retransmits, (duplicates, retransmits)
