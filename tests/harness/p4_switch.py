"""A switch for the P4 backend's tests: a fake P4Runtime server on 127.0.0.1 that validates and
keeps what the backend writes, an in-memory register file, and a packet path that *interprets*
the captured table state with the reference model.

``SimSwitch.config()`` translates the captured entries back into model configuration (jobs, members,
strategy rows, multicast groups); ``SimSwitch.process(frame)`` runs the model so configured and
turns its verdict into what the P4 program does with the frame (multicast through the job's group
to its replication ports, back out of the ingress port, forwarded by the L2 table, or dropped), with
the model's counters mirrored into the program's register and counter layout, where the backend's
``job_stats`` reads them. What the P4 program itself computes is checked only against BMv2
(tests/p4/test_bmv2.py).
"""
from __future__ import annotations

import socket
import struct
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np

from aggd.dataplane.p4 import layout as L
from aggd.dataplane.p4.encoding import decode, multicast_mac
from aggd.dataplane.p4.p4info import P4Info
from aggd.dataplane.p4.proto import SERVICE, p4info_pb2, p4runtime_pb2 as p
from aggd.dataplane.p4.registers import RegisterAccess
from aggd.core.model import NO_JOB, AggregatorModel, JobConfig, TableEntry, Verdict
from aggd_client import protocol as proto

U32_MAX = (1 << 32) - 1


class WriteError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _canonical(value: bytes, bitwidth: int, what: str) -> int:
    if not value:
        raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: empty bytestring")
    if len(value) > 1 and value[0] == 0:
        raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: not canonical ({value.hex()})")
    v = decode(value)
    if v >> bitwidth:
        raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {v} does not fit {bitwidth} bits")
    return v


@dataclass(frozen=True)
class Entry:
    table: str
    match: tuple            #: ((field name, int or (low, high)), ...) in P4Info order; full ranges included
    priority: int
    action: str
    params: tuple           #: ((param name, int), ...)

    @property
    def m(self) -> dict:
        return dict(self.match)

    @property
    def a(self) -> dict:
        return dict(self.params)


class FakeP4Runtime:
    """The server side of P4Runtime, strict about what it accepts (ids, widths, canonical values,
    priorities, action scopes, existence), holding tables and multicast groups as the switch would."""

    def __init__(self, info: P4Info) -> None:
        self.info = info
        self.lock = threading.Lock()
        self.tables: dict[tuple, Entry] = {}       # (table, match, priority) -> entry
        self.groups: dict[int, tuple[int, ...]] = {}
        self.requests: list = []                   # every WriteRequest, as received
        self.generation: dict[int, int] = {}       # job -> how many times its jobs entry was inserted
        self.on_write = None                       # called after each applied WriteRequest
        self.election = None
        self.pipeline = None

    # -- decoding --------------------------------------------------------------------------------------
    def _entry(self, te, with_action: bool) -> Entry:
        try:
            t = self.info.by_id(te.table_id)
        except KeyError:
            raise WriteError(grpc.StatusCode.NOT_FOUND, f"no table id {te.table_id}") from None
        if t.preamble.id not in {x.preamble.id for x in self.info.msg.tables}:
            raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"id {te.table_id} is not a table")
        name = t.preamble.name
        fields = {m.id: m for m in t.match_fields}
        got: dict[int, object] = {}
        for fm in te.match:
            mf = fields.get(fm.field_id)
            if mf is None or fm.field_id in got:
                raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: bad match field id {fm.field_id}")
            what = f"{name}.{mf.name}"
            if mf.match_type == p4info_pb2.MatchField.EXACT:
                if not fm.HasField("exact"):
                    raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: exact match expected")
                got[mf.id] = _canonical(fm.exact.value, mf.bitwidth, what)
            elif mf.match_type == p4info_pb2.MatchField.RANGE:
                if not fm.HasField("range"):
                    raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: range match expected")
                lo = _canonical(fm.range.low, mf.bitwidth, what)
                hi = _canonical(fm.range.high, mf.bitwidth, what)
                if lo > hi or (lo, hi) == (0, (1 << mf.bitwidth) - 1):
                    raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: range {lo}..{hi} "
                                                                       f"(empty, or a don't-care that must be left out)")
                got[mf.id] = (lo, hi)
            else:
                raise WriteError(grpc.StatusCode.UNIMPLEMENTED, f"{what}: match type not used by aggd")
        match = []
        needs_priority = False
        for mf in t.match_fields:
            if mf.match_type == p4info_pb2.MatchField.EXACT:
                if mf.id not in got:
                    raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}.{mf.name}: exact field missing")
                match.append((mf.name, got[mf.id]))
            else:
                needs_priority = True
                match.append((mf.name, got.get(mf.id, (0, (1 << mf.bitwidth) - 1))))
        if needs_priority != (te.priority > 0):
            raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: priority {te.priority} "
                                                               f"({'needed' if needs_priority else 'not allowed'})")
        action, params = "", ()
        if with_action:
            if not te.HasField("action") or not te.action.HasField("action"):
                raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: no action")
            a = te.action.action
            refs = {r.id: r for r in t.action_refs}
            ref = refs.get(a.action_id)
            if ref is None or ref.scope == p4info_pb2.ActionRef.DEFAULT_ONLY:
                raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: action {a.action_id} not allowed")
            act = self.info.by_id(a.action_id)
            declared = {x.id: x for x in act.params}
            seen = {}
            for prm in a.params:
                d = declared.get(prm.param_id)
                if d is None or prm.param_id in seen:
                    raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{act.preamble.name}: bad param {prm.param_id}")
                seen[prm.param_id] = _canonical(prm.value, d.bitwidth, f"{act.preamble.name}.{d.name}")
            if set(seen) != set(declared):
                raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"{act.preamble.name}: params missing")
            action = act.preamble.name
            params = tuple((declared[i].name, seen[i]) for i in sorted(declared))
        return Entry(name, tuple(match), te.priority, action, params)

    # -- Write ------------------------------------------------------------------------------------------
    def apply(self, request) -> None:
        """Validate the whole request, then apply it (all or nothing)."""
        tables, groups, gen = dict(self.tables), dict(self.groups), dict(self.generation)
        for u in request.updates:
            kind = p.Update.Type.Name(u.type)
            which = u.entity.WhichOneof("entity")
            if which == "table_entry":
                e = self._entry(u.entity.table_entry, with_action=kind != "DELETE")
                key = (e.table, e.match, e.priority)
                if kind == "INSERT":
                    if key in tables:
                        raise WriteError(grpc.StatusCode.ALREADY_EXISTS, f"{key} exists")
                    tables[key] = e
                    if e.table == L.JOBS:
                        job = e.m["hdr.aggd.job"]
                        gen[job] = gen.get(job, 0) + 1
                elif kind == "MODIFY":
                    if key not in tables:
                        raise WriteError(grpc.StatusCode.NOT_FOUND, f"{key} not found")
                    tables[key] = e
                elif kind == "DELETE":
                    if key not in tables:
                        raise WriteError(grpc.StatusCode.NOT_FOUND, f"{key} not found")
                    del tables[key]
                else:
                    raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, "update type unspecified")
            elif which == "packet_replication_engine_entry":
                pre = u.entity.packet_replication_engine_entry
                if pre.WhichOneof("type") != "multicast_group_entry":
                    raise WriteError(grpc.StatusCode.UNIMPLEMENTED, "only multicast groups")
                g = pre.multicast_group_entry
                if g.multicast_group_id == 0:
                    raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, "multicast group 0")
                reps = [(r.egress_port, r.instance) for r in g.replicas]
                if len(set(reps)) != len(reps) or any(port > L.MAX_PORT for port, _ in reps):
                    raise WriteError(grpc.StatusCode.INVALID_ARGUMENT, f"replicas {reps}")
                exists = g.multicast_group_id in groups
                if (kind == "INSERT") == exists:
                    raise WriteError(grpc.StatusCode.ALREADY_EXISTS if exists else grpc.StatusCode.NOT_FOUND,
                                     f"multicast group {g.multicast_group_id}")
                if kind == "DELETE":
                    del groups[g.multicast_group_id]
                else:
                    groups[g.multicast_group_id] = tuple(sorted(port for port, _ in reps))
            else:
                raise WriteError(grpc.StatusCode.UNIMPLEMENTED, f"entity {which}")
        self.tables, self.groups, self.generation = tables, groups, gen
        self.requests.append(request)

    # -- gRPC handlers ---------------------------------------------------------------------------------
    def Write(self, request, context):
        with self.lock:
            if self.election is None or (request.election_id.high, request.election_id.low) != self.election:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "not the primary controller")
            try:
                self.apply(request)
            except WriteError as exc:
                context.abort(exc.code, str(exc))
            hook = self.on_write
        if hook is not None:
            hook(self)
        return p.WriteResponse()

    def Read(self, request, context):
        with self.lock:
            entities = []
            for ent in request.entities:
                if ent.WhichOneof("entity") == "table_entry":
                    want = ent.table_entry.table_id
                    for e in self.tables.values():
                        tid = self.info.tables[e.table].preamble.id
                        if want in (0, tid):
                            entities.append(p.Entity(table_entry=self.info.table_entry(
                                e.table, e.m, e.action or None, e.a, e.priority)))
        yield p.ReadResponse(entities=entities)

    def SetForwardingPipelineConfig(self, request, context):
        self.pipeline = request.config
        return p.SetForwardingPipelineConfigResponse()

    def GetForwardingPipelineConfig(self, request, context):
        return p.GetForwardingPipelineConfigResponse(config=self.pipeline)

    def Capabilities(self, request, context):
        return p.CapabilitiesResponse(p4runtime_api_version="1.4.0")

    def StreamChannel(self, requests, context):
        for msg in requests:
            if msg.HasField("arbitration"):
                eid = (msg.arbitration.election_id.high, msg.arbitration.election_id.low)
                with self.lock:
                    ok = self.election is None or eid >= self.election
                    if ok:
                        self.election = eid
                yield p.StreamMessageResponse(arbitration=p.MasterArbitrationUpdate(
                    device_id=msg.arbitration.device_id, election_id=msg.arbitration.election_id,
                    status={"code": 0 if ok else 6}))

    def serve(self, address: str = "127.0.0.1:0") -> tuple[grpc.Server, str]:
        """Start a gRPC server for this fake on ``address`` (default 127.0.0.1, a free port; or
        "unix:/path"); returns (server, address)."""
        rpc = grpc.unary_unary_rpc_method_handler
        handlers = {
            "Write": rpc(self.Write, p.WriteRequest.FromString, p.WriteResponse.SerializeToString),
            "Read": grpc.unary_stream_rpc_method_handler(self.Read, p.ReadRequest.FromString,
                                                         p.ReadResponse.SerializeToString),
            "SetForwardingPipelineConfig": rpc(self.SetForwardingPipelineConfig,
                                               p.SetForwardingPipelineConfigRequest.FromString,
                                               p.SetForwardingPipelineConfigResponse.SerializeToString),
            "GetForwardingPipelineConfig": rpc(self.GetForwardingPipelineConfig,
                                               p.GetForwardingPipelineConfigRequest.FromString,
                                               p.GetForwardingPipelineConfigResponse.SerializeToString),
            "Capabilities": rpc(self.Capabilities, p.CapabilitiesRequest.FromString,
                                p.CapabilitiesResponse.SerializeToString),
            "StreamChannel": grpc.stream_stream_rpc_method_handler(
                self.StreamChannel, p.StreamMessageRequest.FromString, p.StreamMessageResponse.SerializeToString),
        }
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port(address)
        server.start()
        return server, address if address.startswith("unix:") else f"{address.rpartition(':')[0]}:{port}"

    # -- the switch's lookups ----------------------------------------------------------------------------
    def entries(self, table: str) -> list[Entry]:
        return [e for e in self.tables.values() if e.table == table]

    def lookup_strategy(self, job: int, round_: int) -> Entry | None:
        """What the switch's strategy table answers for (job, round): the highest-priority match;
        two matches at that priority with different actions would make the answer undefined."""
        hits = [e for e in self.entries(L.STRATEGY) if e.m["hdr.aggd.job"] == job
                and e.m["meta.s_round"][0] <= round_ <= e.m["meta.s_round"][1]]
        if not hits:
            return None
        top = max(e.priority for e in hits)
        best = {e.params for e in hits if e.priority == top}
        assert len(best) == 1, f"round {round_} of job {job}: ambiguous strategy entries {hits}"
        return next(e for e in hits if e.priority == top)


class MemoryRegisters(RegisterAccess):
    """The program's registers and counters in memory, sized and masked as the P4Info says."""

    def __init__(self, info: P4Info) -> None:
        self.info = info
        self.regs: dict[str, dict[int, int]] = {n: {} for n in info.registers}
        self.ctrs: dict[str, dict[int, int]] = {n: {} for n in info.counters}
        self.writes = 0

    def _cell(self, table: dict, kind: str, name: str, index: int):
        if name not in table:
            raise KeyError(f"no {kind} {name}")
        size = int((self.info.registers if kind == "register" else self.info.counters)[name].size)
        if not 0 <= index < size:
            raise IndexError(f"{kind} {name}[{index}] outside 0..{size - 1}")
        return table[name]

    def read(self, register: str, index: int) -> int:
        return self._cell(self.regs, "register", register, index).get(index, 0)

    def write(self, register: str, index: int, value: int) -> None:
        bits = self.info.registers[register].type_spec.bitstring.bit.bitwidth
        self._cell(self.regs, "register", register, index)[index] = int(value) & ((1 << bits) - 1)
        self.writes += 1

    def read_counter(self, counter: str, index: int) -> int:
        return self._cell(self.ctrs, "counter", counter, index).get(index, 0)

    def write_counter(self, counter: str, index: int, packets: int) -> None:
        self._cell(self.ctrs, "counter", counter, index)[index] = int(packets)


# ---------------------------------------------------------------------------------------------
# The captured state, read back as model configuration.

@dataclass
class JobView:
    cfg: JobConfig
    rows: list[TableEntry]
    params: dict
    ports: tuple[int, ...]
    generation: int


def settled_rows(fake: FakeP4Runtime, job: int) -> list[TableEntry]:
    """The strategy entries of ``job`` in a settled state, read back as table rows: each entry
    ``[low, high] -> (version, kind, param, timeout)`` is the row (version, low, ...); the model's
    ``governing`` then answers every round as the switch's range lookup does."""
    ents = sorted((e for e in fake.entries(L.STRATEGY) if e.m["hdr.aggd.job"] == job),
                  key=lambda e: e.m["meta.s_round"])
    assert ents, f"job {job} has no strategy entry"
    assert all(e.priority == 1 for e in ents), f"job {job}: strategy change left unsettled: {ents}"
    spans = [e.m["meta.s_round"] for e in ents]
    assert spans[0][0] == 0 and spans[-1][1] == U32_MAX, spans
    assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:])), f"gaps or overlaps {spans}"
    assert len(ents) <= proto.STRATEGY_VERSIONS
    return [TableEntry(e.a["version"], e.m["meta.s_round"][0], e.a["kind"], e.a["param"], e.a["timeout_us"])
            for e in ents]


def ip_str(v: int) -> str:
    return socket.inet_ntoa(v.to_bytes(4, "big"))


def switch_config(fake: FakeP4Runtime, hosts: dict[str, tuple[str, int]]) -> dict[int, JobView]:
    """Jobs as the switch holds them, checked for consistency: the job's group in the replication
    engine with every member's port, its group MAC derived from its group address, a bitmap of its
    world, members only below the world size."""
    members: dict[int, dict[int, tuple[str, int]]] = {}
    tags: dict[int, dict[int, int]] = {}
    for e in fake.entries(L.MEMBERS):
        m, a = e.m, e.a
        members.setdefault(m["hdr.aggd.job"], {})[m["hdr.aggd.rank"]] = (ip_str(a["ip"]), a["port"])
        tags.setdefault(m["hdr.aggd.job"], {})[m["hdr.aggd.rank"]] = a["tag"]
    jobs = {}
    for e in fake.entries(L.JOBS):
        job, a = e.m["hdr.aggd.job"], e.a
        world = a["world"]
        assert 0 < a["all_members"] < 1 << world, a
        assert a["mcast_grp"] == L.job_group(job), a
        assert a["group_mac"] == multicast_mac(ip_str(a["group_ip"])), a
        ports = fake.groups.get(a["mcast_grp"])
        assert ports is not None, f"job {job}: multicast group {a['mcast_grp']} not in the replication engine"
        mem = members.get(job, {})
        assert all(r < world for r in mem), mem
        for ip, _ in mem.values():
            if ip in hosts:
                assert hosts[ip][1] in ports, f"job {job}: member {ip} port {hosts[ip][1]} not in {ports}"
        cfg = JobConfig(job=job, world=world, slots=a["n_slots"], max_chunks=a["max_chunks"], members=mem,
                        tags=tags.get(job, {}), group=(ip_str(a["group_ip"]), a["result_port"]))
        jobs[job] = JobView(cfg, settled_rows(fake, job), a, ports, fake.generation.get(job, 0))
    return jobs


# ---------------------------------------------------------------------------------------------
# Packets.

@dataclass
class Output:
    """What the switch does with a frame: ``action`` "drop", "tx" (``frame`` out of ``ports``) or
    "forward" (``frame`` unchanged out of ``ports`` by the L2 table); ``verdict`` is the model's."""
    action: str
    frame: bytes | None = None
    ports: tuple[int, ...] = ()
    verdict: Verdict | None = None
    msg: bytes | None = None                 #: the aggd message the model was given, and from where
    src: tuple[str, int] | None = None


def _ip_checksum(header: bytes) -> int:
    s = sum(struct.unpack("!10H", header))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _with_checksum(ip: bytearray) -> bytearray:
    ip[10:12] = b"\0\0"
    ip[10:12] = struct.pack("!H", _ip_checksum(bytes(ip)))
    return ip


@dataclass
class SimSwitch:
    info: P4Info
    hosts: dict[str, tuple[str, int]]
    fake: FakeP4Runtime = field(init=False)
    registers: MemoryRegisters = field(init=False)

    def __post_init__(self) -> None:
        self.fake = FakeP4Runtime(self.info)
        self.registers = MemoryRegisters(self.info)
        self.model = AggregatorModel(self.info.elements)
        self._gen: dict[int, int] = {}
        self._seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._synced_at, self._conf = -1, {}
        self.server, self.address = self.fake.serve()

    def close(self) -> None:
        self.server.stop(None)

    # -- the model, configured from the captured entries ----------------------------------------------
    def sync_model(self) -> dict[int, JobView]:
        """Bring the model in line with the captured entries (re-read only after a write)."""
        if self._synced_at == len(self.fake.requests):
            return self._conf
        conf = switch_config(self.fake, self.hosts)
        m = self.model
        for job in list(m.jobs):
            if job not in conf or conf[job].generation != self._gen.get(job):
                m.remove_job(job)
        for job, view in conf.items():
            if job not in m.jobs:
                m.add_job(view.cfg)
                self._gen[job] = view.generation
                self._seen[job] = (np.zeros(len(proto.Counter), np.uint64), np.zeros(len(proto.DropReason), np.uint64))
            have = m.jobs[job].cfg
            if (have.world, have.slots, have.max_chunks, have.group) != (view.cfg.world, view.cfg.slots,
                                                                         view.cfg.max_chunks, view.cfg.group):
                raise AssertionError(f"job {job} changed without being reinstalled")
            for rank in set(have.members) | set(view.cfg.members):
                if (have.members.get(rank), have.tags.get(rank, 0)) != (view.cfg.members.get(rank),
                                                                         view.cfg.tags.get(rank, 0)):
                    m.set_member(job, rank, view.cfg.members.get(rank), view.cfg.tags.get(rank, 0))
            if m.strategy_table(job) != view.rows:
                m.set_strategy(job, view.rows)
            if m.jobs[job].awaited != view.params["all_members"]:
                m.set_awaited(job, view.params["all_members"])
        self._synced_at, self._conf = len(self.fake.requests), conf
        return conf

    def _mirror(self) -> None:
        """Add what the model counted since last time to the program's counter layout."""
        buckets = [(NO_JOB, None)] + [(j, j) for j in self.model.jobs]
        for bucket, job in buckets:
            ctr = self.model.counters(job) if job is not None else np.zeros(len(proto.Counter), np.uint64)
            drp = self.model.drops(bucket)
            old_c, old_d = self._seen.get(bucket, (np.zeros_like(ctr), np.zeros_like(drp)))
            for c in proto.Counter:
                if ctr[c] != old_c[c]:
                    i = L.counter_index(bucket, c)
                    self.registers.write(L.REG_JOB_COUNTERS, i, self.registers.read(L.REG_JOB_COUNTERS, i)
                                         + int(ctr[c] - old_c[c]))
            for r in proto.DropReason:
                if drp[r] != old_d[r]:
                    i = L.drop_index(bucket, r)
                    self.registers.write_counter(L.CTR_DROPS, i, self.registers.read_counter(L.CTR_DROPS, i)
                                                 + int(drp[r] - old_d[r]))
            self._seen[bucket] = (ctr.copy(), drp.copy())

    # -- one frame ------------------------------------------------------------------------------------
    def _forward(self, frame: bytes) -> Output:
        dst = int.from_bytes(frame[0:6], "big")
        for e in self.fake.entries(L.FORWARD):
            if e.m["hdr.ethernet.dst_addr"] == dst:
                if e.action == f"{L.INGRESS}.l2_forward":
                    return Output("forward", frame, (e.a["port"],))
                if e.action == f"{L.INGRESS}.drop":
                    return Output("drop")
        return Output("forward", frame, self.fake.groups.get(L.FLOOD_GROUP, ()))

    def process(self, frame: bytes, in_port: int, now_ns: int) -> Output:
        conf = self.sync_model()
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":
            return self._forward(frame)
        ip = frame[14:34]
        if ip[0] != 0x45 or struct.unpack("!H", ip[6:8])[0] & 0x3FFF or ip[9] != 17 or len(frame) < 42:
            return self._forward(frame)
        sport, dport, udp_len = struct.unpack("!HHH", frame[34:40])
        service = {(e.m["hdr.ipv4.dst_addr"], e.m["hdr.udp.dst_port"]) for e in self.fake.tables.values()
                   if e.table == L.SERVICE}
        if (int.from_bytes(ip[16:20], "big"), dport) not in service:
            return self._forward(frame)
        # the program's too_short: the frame holds less than the UDP length says
        data = frame[42:34 + udp_len] if udp_len >= 8 and len(frame) >= 34 + udp_len else b""
        src = (socket.inet_ntoa(ip[12:16]), sport)
        v = self.model.process(data, src, now_ns)
        self._mirror()
        if v.job != NO_JOB and len(data) >= proto.HEADER_SIZE and v.action != "pass" and \
                v.reason in (None, proto.DropReason.DUPLICATE, proto.DropReason.STALE, proto.DropReason.BUSY,
                             proto.DropReason.NOT_READY):
            hdr = proto.Header.unpack(data)
            i = v.job
            self.registers.write(L.REG_MAX_ROUND, i, max(self.registers.read(L.REG_MAX_ROUND, i), hdr.round + 1))
        if v.action == "pass":
            return Output("forward", frame, self._forward(frame).ports, v, data, src)
        if v.action == "drop":
            return Output("drop", verdict=v, msg=data, src=src)
        eth, ipb, udp = bytearray(frame[0:14]), bytearray(frame[14:34]), bytearray(frame[34:42])
        if v.dest == "group":
            a = conf[v.job].params
            eth[0:6], eth[6:12] = a["group_mac"].to_bytes(6, "big"), frame[0:6]
            ipb[12:16], ipb[16:20] = frame[30:34], a["group_ip"].to_bytes(4, "big")
            udp[0:2], udp[2:4] = struct.pack("!H", dport), struct.pack("!H", a["result_port"])
            ports = conf[v.job].ports
        else:
            eth[0:6], eth[6:12] = frame[6:12], frame[0:6]
            ipb[12:16], ipb[16:20] = frame[30:34], frame[26:30]
            udp[0:2], udp[2:4] = frame[36:38], frame[34:36]
            ports = (in_port,)
        if v.out is not None and v.header.type == proto.MsgType.NACK:      # truncated to the header
            ipb[2:4] = struct.pack("!H", 20 + 8 + proto.HEADER_SIZE)
            udp[4:6] = struct.pack("!H", 8 + proto.HEADER_SIZE)
        ipb[8] = 64
        ipb[4:8] = b"\0\0\x40\0"  # IP ID 0, don't fragment
        udp[6:8] = b"\0\0"       # no UDP checksum: a switch's deparser cannot sum the payload
        return Output("tx", bytes(eth + _with_checksum(ipb) + udp) + v.out, ports, v, data, src)


# ---------------------------------------------------------------------------------------------
# BMv2's Thrift register API over a register file, for a daemon in another process.

def _i64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


class ThriftRegisterServer:
    """The register and counter calls of BMv2's Thrift "standard" service (the ones
    ``aggd.dataplane.p4.thrift.Bmv2Registers`` makes), served on 127.0.0.1 (of ``netns``) from ``registers``
    (a MemoryRegisters: bounds and widths as the P4Info says). An unknown name or index fails the
    call as BMv2 does (InvalidRegisterOperation / InvalidCounterOperation)."""

    def __init__(self, registers: RegisterAccess, netns: str | None = None) -> None:
        from bm_runtime.standard import Standard
        from bm_runtime.standard.ttypes import (BmCounterValue, InvalidCounterOperation,
                                                InvalidRegisterOperation)
        from thrift.protocol import TBinaryProtocol
        from thrift.server import TServer
        from thrift.TMultiplexedProcessor import TMultiplexedProcessor
        from thrift.transport import TSocket, TTransport

        regs, lock = registers, threading.Lock()
        self.calls = 0

        def guarded(error, fn):
            @staticmethod
            def call(*args):
                with lock:
                    self.calls += 1
                    try:
                        return fn(*args)
                    except (KeyError, IndexError):
                        raise error(code=1) from None
            return call

        class Handler:
            bm_register_read = guarded(InvalidRegisterOperation, lambda cxt, name, i: _i64(regs.read(name, i)))
            bm_register_write = guarded(InvalidRegisterOperation, lambda cxt, name, i, v: regs.write(name, i, v))
            bm_register_write_range = guarded(InvalidRegisterOperation,
                                              lambda cxt, name, a, b, v: regs.write_range(name, a, b, v))
            bm_counter_read = guarded(InvalidCounterOperation, lambda cxt, name, i: BmCounterValue(
                bytes=0, packets=regs.read_counter(name, i)))
            bm_counter_write = guarded(InvalidCounterOperation,
                                       lambda cxt, name, i, v: regs.write_counter(name, i, v.packets))

        mux = TMultiplexedProcessor()
        mux.registerProcessor("standard", Standard.Processor(Handler()))
        self._sock = TSocket.TServerSocket(host="127.0.0.1", port=0)
        server = TServer.TThreadedServer(mux, self._sock, TTransport.TBufferedTransportFactory(),
                                         TBinaryProtocol.TBinaryProtocolFactory(), daemon=True)
        if netns:  # listening in that namespace (a switch's), as BMv2's Thrift server would
            from aggd.lab.namespaces import in_netns
            with in_netns(netns):
                self._sock.listen()
        else:
            self._sock.listen()
        self.address = f"127.0.0.1:{self._sock.handle.getsockname()[1]}"
        # TThreadedServer.serve() never returns: once its socket is closed it logs a failed accept
        # in a busy loop for the rest of the process. This loop polls, and ends with close().
        self._sock.handle.settimeout(0.2)
        self._server, self._closed = server, threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-bmv2-thrift", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                client = self._sock.accept()
            except (OSError, AttributeError):  # timeout; AttributeError: the socket is closed
                continue
            if client is not None:
                client.handle.settimeout(None)
                threading.Thread(target=self._server.handle, args=(client,), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self._sock.close()
