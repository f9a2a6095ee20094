"""P4DataPlane against a fake P4Runtime server on 127.0.0.1 and an in-memory register file: what it
writes, in which order, and how the captured entries read back (no root, no switch)."""
from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.dataplane.p4 import P4Error, layout as L
from aggd.dataplane.p4.backend import P4DataPlane
from aggd.dataplane.p4.encoding import encode
from aggd.dataplane.p4.p4info import P4Info
from aggd.dataplane.p4.proto import p4runtime_pb2 as p
from aggd.dataplane.p4.swap_plan import strategy_plan, strategy_segments
from aggd.core.model import TableEntry, governing
from aggd.core.strategy import StrategyTable, parse, to_entry
from aggd.testing.frames import AGG_IP, worker_addr
from aggd_client import protocol as proto

from .conftest import HOSTS
from tests.harness.p4_switch import FakeP4Runtime, MemoryRegisters, SimSwitch, ThriftRegisterServer, switch_config

U32 = (1 << 32) - 1


def cfg(job=1, world=3, slots=8, max_chunks=1 << 20, group=("239.77.0.1", 47001), members=None, **kw):
    if members is None:
        members = {r: worker_addr(r)[1:] for r in range(world)}
    return types.SimpleNamespace(job=job, world=world, slots=slots, max_chunks=max_chunks, group=group,
                                 members=members, **kw)


def kinds(request) -> list[str]:
    return [f"{p.Update.Type.Name(u.type)} {u.entity.WhichOneof('entity')}" for u in request.updates]


def test_switch_entries_at_start(p4dp, sim):
    first = sim.fake.requests[0]
    assert kinds(first).count("INSERT table_entry") == 1 + len(HOSTS)
    assert sim.fake.groups[L.FLOOD_GROUP] == tuple(sorted(port for _, port in HOSTS.values()))
    service = sim.fake.entries(L.SERVICE)
    assert [(e.m["hdr.ipv4.dst_addr"], e.m["hdr.udp.dst_port"]) for e in service] == \
        [(int.from_bytes(bytes(map(int, AGG_IP.split("."))), "big"), proto.DEFAULT_PORT)]


def test_install_job_reads_back_as_the_same_job(p4dp, sim):
    before = len(sim.fake.requests)
    p4dp.install_job(cfg(strategy=parse("quorum:2:20ms"), kernel_slots=6))
    reqs = sim.fake.requests[before:]
    # members, strategy and the multicast group first; the jobs entry alone and last
    assert kinds(reqs[-1]) == ["INSERT table_entry"]
    assert sim.fake.info.by_id(reqs[-1].updates[0].entity.table_entry.table_id).preamble.name == L.JOBS
    assert "INSERT packet_replication_engine_entry" in kinds(reqs[-2])
    view = switch_config(sim.fake, HOSTS)[1]
    assert (view.cfg.world, view.cfg.slots, view.cfg.max_chunks, view.cfg.group) == (3, 8, 1 << 20,
                                                                                     ("239.77.0.1", 47001))
    assert view.cfg.members == {r: worker_addr(r)[1:] for r in range(3)}
    assert view.rows == [to_entry(parse("quorum:2:20ms"), 0, 0)]
    assert view.ports == (1, 2, 3)
    assert (view.params["switch_slots"], view.params["slot_base"]) == (6, 0)
    assert p4dp.strategy_entries(1) == [to_entry(parse("quorum:2:20ms"), 0, 0)]
    # a second job's slots follow the first's
    p4dp.install_job(cfg(job=2, world=2))
    assert switch_config(sim.fake, HOSTS)[2].params["slot_base"] == 6


def test_remove_and_reinstall(p4dp, sim):
    base_tables, base_groups = dict(sim.fake.tables), dict(sim.fake.groups)
    p4dp.install_job(cfg())
    p4dp.install_job(cfg(world=4))                       # replaced: removed, then installed again
    assert switch_config(sim.fake, HOSTS)[1].cfg.world == 4
    assert sim.fake.generation[1] == 2
    p4dp.remove_job(1)
    assert sim.fake.tables == base_tables and sim.fake.groups == base_groups
    assert p4dp.active_jobs() == [] and p4dp.allocator.free_slots() == p4dp.total_slots
    p4dp.remove_job(1)                                   # nothing left: no write


def test_members_join_move_and_leave(p4dp, sim):
    p4dp.install_job(cfg(members={}))
    assert switch_config(sim.fake, HOSTS)[1].ports == ()
    p4dp.set_member(1, 0, worker_addr(0)[1:])
    p4dp.set_member(1, 2, worker_addr(2)[1:])
    view = switch_config(sim.fake, HOSTS)[1]
    assert view.cfg.members == {0: worker_addr(0)[1:], 2: worker_addr(2)[1:]} and view.ports == (1, 3)
    p4dp.set_member(1, 2, worker_addr(5)[1:])           # a restarted worker on another host
    assert switch_config(sim.fake, HOSTS)[1].ports == (1, 6)
    n = len(sim.fake.requests)
    p4dp.set_member(1, 2, worker_addr(5)[1:])           # unchanged: nothing written
    assert len(sim.fake.requests) == n
    p4dp.set_member(1, 0, None)
    assert switch_config(sim.fake, HOSTS)[1].cfg.members == {2: worker_addr(5)[1:]}
    p4dp.set_member(1, 1, ("192.0.2.9", 4000))          # a host the switch does not know: flood
    assert switch_config(sim.fake, HOSTS)[1].ports == tuple(sorted(port for _, port in HOSTS.values()))
    with pytest.raises(P4Error, match="rank 3 outside"):
        p4dp.set_member(1, 3, worker_addr(3)[1:])


rows_st = st.lists(st.tuples(st.integers(0, 0xFFFF), st.integers(0, 40), st.sampled_from(list(proto.StrategyKind)),
                             st.integers(0, 3)), min_size=1, max_size=proto.STRATEGY_VERSIONS)


@settings(max_examples=300, deadline=None)
@given(rows=rows_st)
def test_segments_govern_every_round_like_the_model(rows):
    entries = [TableEntry(v, r, int(k), prm, 1000 if k == proto.StrategyKind.QUORUM else 0)
               for v, r, k, prm in rows]
    segs = strategy_segments(entries)
    assert segs[0][0] == 0 and segs[-1][1] == U32
    assert all(a[1] + 1 == b[0] for a, b in zip(segs, segs[1:]))
    for rnd in list(range(0, 45)) + [U32]:
        (row,) = [s[2] for s in segs if s[0] <= rnd <= s[1]]
        assert row == governing(entries, rnd), rnd


def _lookups(fake: FakeP4Runtime, job: int, rounds) -> dict:
    out = {}
    for r in rounds:
        e = fake.lookup_strategy(job, r)
        out[r] = None if e is None else e.a["version"]
    return out


@pytest.mark.parametrize("tables", [
    # the daemon's hot swaps: each a new version from a later round, the ring keeping four
    [("sync", 0, 0), ("quorum:3:10ms", 1, 5), ("ssp:1", 2, 9), ("async", 3, 12), ("wbsp", 4, 20),
     ("sync", 5, 21), ("quorum:2:1ms", 6, 30)],
    # equal first rounds (the larger version governs), a version from round 0
    [("sync", 0, 0), ("ssp:2", 1, 0), ("async", 2, 3), ("sync", 3, 3)],
])
def test_hot_swap_never_shows_a_third_mapping(p4dp, sim, tables):
    """After every WriteRequest of a change, each round maps to its row before or after it, and a
    round whose row does not change keeps it in every intermediate state."""
    p4dp.install_job(cfg(world=4))
    table = StrategyTable(parse(tables[0][0]))
    rounds = list(range(0, 40)) + [U32]
    before = _lookups(sim.fake, 1, rounds)
    states = []
    sim.fake.on_write = lambda fake: states.append(_lookups(fake, 1, rounds))
    for text, version, first in tables[1:]:
        if version <= table.entries[-1][0] or first < table.entries[-1][1]:
            continue
        table.install(version, first, parse(text))
        entries = table.table_entries()
        states.clear()
        p4dp.set_strategy(1, entries)
        after = {r: governing(entries, r).version for r in rounds}
        for state in states:
            for r in rounds:
                assert state[r] in (before[r], after[r]), (r, state[r], before[r], after[r])
        assert _lookups(sim.fake, 1, rounds) == after
        assert [e.version for e in switch_config(sim.fake, HOSTS)[1].rows] == \
            sorted({governing(entries, r).version for r in rounds}, key=lambda v: [e.version for e in entries].index(v))
        before = after
    sim.fake.on_write = None


def test_strategy_plan_is_empty_without_change():
    segs = strategy_segments([to_entry(parse("sync"), 0, 0), to_entry(parse("ssp:1"), 1, 10)])
    assert strategy_plan(segs, segs) == []


def test_out_of_order_rows_any_order(p4dp, sim):
    p4dp.install_job(cfg(world=4))
    rows = [TableEntry(3, 20, 0, 0, 0), TableEntry(1, 10, 2, 1, 0), TableEntry(2, 10, 3, 0, 0)]
    p4dp.set_strategy(1, rows)
    for r in (0, 5, 10, 15, 20, 25):
        assert sim.fake.lookup_strategy(1, r).a["version"] == governing(rows, r).version


def test_refusals(p4dp, sim):
    with pytest.raises(P4Error, match="job id"):
        p4dp.install_job(cfg(job=300))
    with pytest.raises(P4Error, match="world"):
        p4dp.install_job(cfg(world=65, members={}))
    with pytest.raises(P4Error, match="group"):
        p4dp.install_job(cfg(group=None))
    with pytest.raises(P4Error, match="not installed"):
        p4dp.set_strategy(7, [to_entry(parse("sync"), 0, 0)])
    p4dp.install_job(cfg())
    with pytest.raises(P4Error, match="1..4 entries"):
        p4dp.set_strategy(1, [])
    with pytest.raises(P4Error, match="do not fit|does not fit"):
        p4dp.set_strategy(1, [TableEntry(0, 0, 1, 300, 1)])
    with pytest.raises(P4Error, match="does not fit"):
        encode(1 << 16, 16)
    assert encode(0, 8) == b"\x00" and encode(0x1234, 32) == b"\x12\x34"


def test_tofino_target(tmp_path):
    """The TNA program's control plane: same tables plus the rank bits, sync and quorum only,
    power-of-two slot counts, its own counters."""
    from aggd.dataplane.p4.p4info import TNA_P4INFO
    info = P4Info(TNA_P4INFO)
    s = SimSwitch(info, HOSTS)
    dp = P4DataPlane(s.address, address=AGG_IP, hosts=HOSTS, registers=s.registers, target="tofino",
                     p4info=info, elements=32)
    try:
        bits = {e.m["hdr.aggd.rank"]: (e.a["lo"], e.a["hi"]) for e in s.fake.entries(L.TNA_RANK_BITS)}
        assert len(bits) == 64 and bits[0] == (1, 0) and bits[31] == (1 << 31, 0) and bits[32] == (0, 1)
        dp.install_job(cfg(strategy=parse("quorum:2:5ms")))
        assert switch_config(s.fake, HOSTS)[1].rows == [to_entry(parse("quorum:2:5ms"), 0, 0)]
        with pytest.raises(P4Error, match="sync and quorum only, not ssp"):
            dp.set_strategy(1, [to_entry(parse("sync"), 0, 0), to_entry(parse("ssp:1"), 1, 3)])
        with pytest.raises(P4Error, match="not async"):
            dp.install_job(cfg(job=2, strategy=parse("async")))
        with pytest.raises(P4Error, match="power of two"):
            dp.install_job(cfg(job=2, slots=6))
        with pytest.raises(P4Error, match="cannot be frozen"):
            dp.set_clock(1000)
        s.registers.write_counter(L.TNA_CTR_EVENTS, L.counter_index(1, proto.Counter.RELEASED), 4)
        s.registers.write(L.TNA_REG_BANK_ROUND, 0, 9)
        stats = dp.job_stats(1)
        assert stats.counters["released"] == 4
        assert "rx_bytes" not in stats.counters and "rx_bytes" in stats.untracked   # not kept: absent, not 0
        assert dp.open_slots(1) is None and dp.member_stats(1, 3) is None
        assert dp.max_round(1) is None
        dp.install_job(cfg(strategy=parse("sync")))          # reinstalled: counters and banks cleared
        assert dp.job_stats(1).counters["released"] == 0 and s.registers.read(L.TNA_REG_BANK_ROUND, 0) == 0
    finally:
        dp.close()
        s.close()


def test_bfrt_registers_name_mapping():
    """BF Runtime access against a stand-in of the SDE's bfrt_grpc.client (the SDE is not here):
    table names get the pipeline prefix, registers read the largest per-pipe value."""
    from aggd.dataplane.p4.bfrt import BfrtRegisters
    calls = []

    class Data(dict):
        def to_dict(self):
            return self

    class Table:
        def __init__(self, name):
            self.name = name

        def make_key(self, keys):
            return keys

        def make_data(self, data):
            return data

        def entry_get(self, target, keys, flags):
            calls.append(("get", self.name, keys[0][0]))
            return iter([(Data({f"{self.name[5:]}.f1": [0, 7, 0, 0], "$COUNTER_SPEC_PKTS": 3}), None)])

        def entry_mod(self, target, keys, data):
            calls.append(("mod", self.name, keys[0][0], data[0][0]))

    class Info:
        def table_get(self, name):
            return Table(name)

    client = types.SimpleNamespace(
        ClientInterface=lambda address, client_id, device_id: types.SimpleNamespace(
            bind_pipeline_config=lambda program: None, bfrt_info_get=lambda program: Info()),
        Target=lambda device_id, pipe_id: ("target", device_id, pipe_id),
        KeyTuple=lambda name, value: (name, value), DataTuple=lambda name, value: (name, value))
    regs = BfrtRegisters(client=client)
    assert regs.read(L.TNA_REG_BANK_ROUND, 5) == 7
    regs.write(L.TNA_REG_BANK_ROUND, 5, 0)
    assert regs.read_counter(L.CTR_DROPS, 9) == 3
    regs.write_counter(L.TNA_CTR_EVENTS, 2, 0)
    assert calls == [("get", f"pipe.{L.TNA_REG_BANK_ROUND}", ("$REGISTER_INDEX", 5)),
                     ("mod", f"pipe.{L.TNA_REG_BANK_ROUND}", ("$REGISTER_INDEX", 5), (f"{L.TNA_REG_BANK_ROUND}.f1", 0)),
                     ("get", f"pipe.{L.CTR_DROPS}", ("$COUNTER_INDEX", 9)),
                     ("mod", f"pipe.{L.TNA_CTR_EVENTS}", ("$COUNTER_INDEX", 2), ("$COUNTER_SPEC_PKTS", 0))]
    with pytest.raises(P4Error, match="bfrt_grpc"):
        BfrtRegisters()


def test_program_checked_at_start(sim):
    from google.protobuf import text_format
    info = P4Info()
    msg = type(info.msg)()
    msg.CopyFrom(info.msg)
    del msg.registers[[r.preamble.name for r in msg.registers].index(L.REG_JOB_COUNTERS)]
    for t in msg.tables:
        if t.preamble.name == L.MEMBERS:
            t.match_fields[1].bitwidth = 8
    with pytest.raises(P4Error, match=r"match field .*members.hdr.aggd.rank bit<16>.*register .*job_counters"):
        P4DataPlane(sim.address, address=AGG_IP, p4info=P4Info(msg), registers=sim.registers)
    with pytest.raises(P4Error, match="adds 256 values a packet"):
        P4DataPlane(sim.address, address=AGG_IP, registers=sim.registers, elements=128)
    assert text_format  # the P4Info above was parsed from text by P4Info()


def test_pipeline_pushed_when_given(sim, tmp_path):
    blob = tmp_path / "aggd.json"
    blob.write_bytes(b'{"program": "aggd"}')
    dp = P4DataPlane(sim.address, address=AGG_IP, registers=sim.registers, device_config=blob, election_id=3)
    try:
        assert sim.fake.pipeline.p4_device_config == b'{"program": "aggd"}'
        assert sim.fake.pipeline.p4info == dp.info.msg
    finally:
        dp.close()


def test_no_server_and_no_primaryship(sim):
    with pytest.raises(P4Error, match="no P4Runtime server"):
        P4DataPlane("127.0.0.1:1", address=AGG_IP, registers=sim.registers, timeout=0.5)
    first = P4DataPlane(sim.address, address=AGG_IP, registers=sim.registers, election_id=10)
    try:
        with pytest.raises(P4Error, match="another controller is primary"):
            P4DataPlane(sim.address, address=AGG_IP, registers=sim.registers, election_id=5)
    finally:
        first.close()


def test_counters_and_registers_layout(p4dp, sim):
    regs: MemoryRegisters = sim.registers
    p4dp.install_job(cfg(job=3))
    regs.write(L.REG_JOB_COUNTERS, 3 * L.COUNTER_STRIDE + proto.Counter.RELEASED, 7)
    regs.write_counter(L.CTR_DROPS, 3 * L.DROP_STRIDE + proto.DropReason.BUSY, 2)
    regs.write_counter(L.CTR_DROPS, L.NO_JOB * L.DROP_STRIDE + proto.DropReason.BAD_MAGIC, 5)
    s = p4dp.job_stats(3)
    assert s.counters["released"] == 7 and s.drops["busy"] == 2 and sum(s.drops.values()) == 2
    assert set(s.counters) == {c.name.lower() for c in proto.Counter}
    assert p4dp.job_stats(None).drops["bad_magic"] == 5
    p4dp.reset_stats(3)
    assert not any(p4dp.job_stats(3).counters.values()) and not any(p4dp.job_stats(3).drops.values())
    assert p4dp.max_round(3) is None
    regs.write(L.REG_MAX_ROUND, 3, 12)
    assert p4dp.max_round(3) == 11
    p4dp.set_clock(1_500_000)
    assert regs.read(L.REG_CLOCK, 0) == 1500
    p4dp.set_clock(0)
    assert regs.read(L.REG_CLOCK, 0) == 0
    # installing a job empties its banks and unlocks its slots
    regs.write(L.REG_BANK_STATE, L.bank_index(0, 2), 1)
    regs.write(L.REG_SLOT_LOCK, 0, 1)
    regs.write(L.REG_LATE_ROUND, 7 * 64 + 5, 4)
    p4dp.install_job(cfg(job=3))
    base = switch_config(sim.fake, HOSTS)[3].params["slot_base"]
    assert regs.read(L.REG_BANK_STATE, L.bank_index(base, 2)) == 0 and regs.read(L.REG_SLOT_LOCK, base) == 0
    assert regs.read(L.REG_LATE_ROUND, (base + 7) * 64 + 5) == 0


def test_job_rounds_from_the_bank_registers(p4dp, sim):
    p4dp.install_job(cfg(job=2, slots=4))
    base, count = p4dp.allocation(2)
    assert count == 4 and p4dp.job_rounds(2) == (None, {})
    regs = sim.registers
    for bank, (state, rnd, bitmap) in enumerate([(1, 7, 0b011), (2, 6, 0b111), (0, 99, 0b1000)]):
        i = L.bank_index(base + 1, bank)
        regs.write(L.REG_BANK_STATE, i, state)
        regs.write(L.REG_BANK_ROUND, i, rnd)
        regs.write(L.REG_BANK_BITMAP, i, bitmap)
    assert p4dp.job_rounds(2) == (7, {0: 7, 1: 7, 2: 6})
    assert p4dp.allocation(9) == (0, 0)


def test_read_back_over_p4runtime(p4dp, sim):
    p4dp.install_job(cfg())
    jobs_id = p4dp.info.table(L.JOBS).preamble.id
    got = p4dp.client.read([p.Entity(table_entry=p.TableEntry(table_id=jobs_id))])
    assert len(got) == 1
    table, match, action, params, _ = p4dp.info.read_entry(got[0].table_entry)
    assert (table, match, action, params["world"]) == (L.JOBS, {"hdr.aggd.job": 1}, f"{L.PIPE}.set_job", 3)


# ---------------------------------------------------------------------------------------------
# BMv2's Thrift register API, against a Thrift server of the same IDL on 127.0.0.1.

@pytest.fixture
def thrift_server(info):
    registers = MemoryRegisters(info)
    server = ThriftRegisterServer(registers)
    yield registers, server.address
    server.close()


def test_bmv2_thrift_registers(thrift_server):
    from aggd.dataplane.p4.thrift import Bmv2Registers
    registers, address = thrift_server
    regs = Bmv2Registers(address)
    try:
        regs.write(L.REG_BANK_BITMAP, 5, (1 << 64) - 1)   # travels as i64 -1 (thrift refuses an i64 above)
        assert registers.read(L.REG_BANK_BITMAP, 5) == (1 << 64) - 1
        assert regs.read(L.REG_BANK_BITMAP, 5) == (1 << 64) - 1
        regs.write_range(L.REG_BANK_STATE, 4, 8, 2)
        assert [registers.regs[L.REG_BANK_STATE].get(i) for i in range(3, 9)] == [None, 2, 2, 2, 2, None]
        regs.write_counter(L.CTR_DROPS, 9, 4)
        assert regs.read_counter(L.CTR_DROPS, 9) == 4
    finally:
        regs.close()
    with pytest.raises(P4Error, match="no BMv2 Thrift server"):
        Bmv2Registers("127.0.0.1:1")


def test_sim_switch_is_what_the_tests_say(info):
    """The simulated switch starts empty: nothing is configured but what a backend writes."""
    s = SimSwitch(info, HOSTS)
    try:
        assert s.fake.tables == {} and s.model.jobs == {}
    finally:
        s.close()


def test_restarted_controller_clears_what_it_left(p4dp, sim):
    """A daemon restarted against a running switch finds its old entries and groups: a new
    P4DataPlane removes them (jobs entries first) and writes the switch entries afresh, so its
    INSERTs do not meet ALREADY_EXISTS; an empty switch is left alone (no write at all)."""
    p4dp.install_job(cfg(strategy=parse("quorum:2:20ms")))
    p4dp.install_job(cfg(job=2, world=2, members={}))
    p4dp.set_strategy(1, [to_entry(parse("quorum:2:20ms"), 0, 0), to_entry(parse("sync"), 1, 4)])
    start_tables = {k: v for k, v in sim.fake.tables.items() if v.table in (L.SERVICE, L.FORWARD)}
    n = len(sim.fake.requests)
    again = P4DataPlane(sim.address, address=AGG_IP, hosts=HOSTS, registers=sim.registers, elements=256)
    try:
        first_delete = sim.fake.requests[n].updates[0].entity.table_entry
        assert sim.fake.info.by_id(first_delete.table_id).preamble.name == L.JOBS
        assert sim.fake.tables == start_tables
        assert set(sim.fake.groups) == {L.FLOOD_GROUP}
        again.install_job(cfg(strategy=parse("quorum:2:20ms")))
        assert switch_config(sim.fake, HOSTS)[1].rows == [to_entry(parse("quorum:2:20ms"), 0, 0)]
    finally:
        again.close()
    assert not again.attached and p4dp.attached


def test_open_slots_read_the_bank_states(p4dp, sim):
    p4dp.install_job(cfg(slots=4))
    base, count = p4dp.allocation(1)
    assert p4dp.open_slots(1) == 0
    sim.registers.write(L.REG_BANK_STATE, L.bank_index(base + 1, 2), L.BANK_OPEN)
    sim.registers.write(L.REG_BANK_STATE, L.bank_index(base + 2, 0), L.BANK_RELEASED)
    assert p4dp.open_slots(1) == 1
    assert p4dp.describe()["slots"] == p4dp.total_slots and p4dp.member_stats(1, 3) is None


def test_unreadable_p4info_and_device_config(tmp_path, sim):
    bad = tmp_path / "x.txtpb"
    bad.write_text("tables { nonsense: 1 }")
    with pytest.raises(P4Error, match="is not a P4Info in text format"):
        P4Info(bad)
    with pytest.raises(P4Error, match="cannot read the P4Info"):
        P4Info(tmp_path / "missing.txtpb")
    with pytest.raises(P4Error, match="cannot read the device config"):
        P4DataPlane(sim.address, address=AGG_IP, hosts=HOSTS, registers=sim.registers, elements=256,
                    device_config=tmp_path / "missing.json")
