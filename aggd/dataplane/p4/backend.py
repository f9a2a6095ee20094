"""The P4 data plane: the aggd P4 program on a BMv2 ``simple_switch_grpc`` or a Tofino, driven over
P4Runtime (tables, multicast groups) and a register interface (counters, slot state).

Same interface as :class:`aggd.dataplane.xdp.loader.XdpDataPlane`; docs/p4.md says how to run it. The
logic here only turns jobs, members and strategy tables into P4Runtime updates; the one I/O edge
for tables is :class:`~aggd.dataplane.p4.runtime.P4RuntimeClient` (gRPC), for registers
:class:`~aggd.dataplane.p4.registers.RegisterAccess` (BMv2 Thrift in ``thrift.py``, BF Runtime in
``bfrt.py``), so tests drive the whole backend against a fake P4Runtime server and an in-memory
register file. Values are encoded by ``encoding.py``, objects looked up in the P4Info by
``p4info.py``, and strategy rows become ``strategy`` table entries, changed without a moment in
which a round maps to neither its old nor its new row, by ``swap_plan.py``.
"""
from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from aggd_client import protocol as proto

from aggd.core.model import check_awaited, check_tag
from aggd.core.strategy import SYNC, TableEntry, to_entry
from aggd.dataplane import DataPlane, JobStats, checked_job, rounds_by_member
from aggd.dataplane.p4 import P4Error, layout as L
from aggd.dataplane.p4.encoding import ip_int, mac_int, multicast_mac
from aggd.dataplane.p4.p4info import P4INFO, P4Info
from aggd.dataplane.p4.registers import RegisterAccess
from aggd.dataplane.p4.runtime import P4RuntimeClient, multicast_group, update
from aggd.dataplane.p4.swap_plan import PRIO_SETTLED, Segment, strategy_plan, strategy_segments

log = logging.getLogger(__name__)

#: What the Tofino program runs (docs/p4.md, "Tofino").
TOFINO_KINDS = {proto.StrategyKind.SYNC, proto.StrategyKind.QUORUM}


@dataclass
class _Job:
    cfg: object
    world: int
    base: int
    switch_slots: int
    group: tuple[str, int]
    members: dict[int, tuple[str, int]]
    segments: list[Segment]
    ports: tuple[int, ...]
    rows: list | None = None     #: the strategy rows as given (segments merge equal from_rounds)
    awaited: int | None = None   #: the members a round waits for (None: the whole world)
    tags: dict[int, int] = field(default_factory=dict)   #: member tags (0: none)


class P4DataPlane(DataPlane):
    """The aggd P4 program on a switch.

    ``grpc_address``: its P4Runtime server (simple_switch_grpc: 127.0.0.1:9559). ``registers``: a
    :class:`RegisterAccess` (default: BMv2's Thrift server at ``thrift_address``). ``address``/``port``:
    where workers send (the daemon host; what the switch cannot hold goes on to it). ``hosts``: the
    hosts behind the switch, ``{ip: (mac, port)}``: L2 forwarding entries, and the replication ports
    of each job's members. ``device_config``: the compiled program (BMv2 JSON) to push; None leaves
    the program the switch was started with. ``target``: "bmv2" or "tofino" (sync and quorum only).
    ``own_registers``: close the given ``registers`` with the data plane (those it opens itself always are).
    """

    def __init__(self, grpc_address: str = "127.0.0.1:9559", *, address: str, port: int = proto.DEFAULT_PORT,
                 hosts: Mapping[str, tuple[str, int]] | None = None, elements: int = proto.DEFAULT_ELEMENTS,
                 total_slots: int | None = None, registers: RegisterAccess | None = None,
                 thrift_address: str = "127.0.0.1:9090", p4info: str | Path | P4Info = P4INFO,
                 device_config: str | Path | bytes | None = None, device_id: int = 0, election_id: int = 1,
                 target: str = "bmv2", client: P4RuntimeClient | None = None, timeout: float = 10.0,
                 own_registers: bool = False) -> None:
        from aggd.dataplane.xdp.loader import SlotAllocator  # plain Python; bcc is imported only by XdpDataPlane itself

        if target not in ("bmv2", "tofino"):
            raise P4Error(f"target must be bmv2 or tofino, not {target!r}")
        self.info = p4info if isinstance(p4info, P4Info) else P4Info(p4info)
        self.check_program(self.info, target)
        if elements != self.info.elements:
            raise P4Error(f"the P4 program adds {self.info.elements} values a packet ({self.info.lanes} lanes x "
                          f"{self.info.passes} passes), the daemon is set to {elements}: rebuild it with "
                          f"`make p4 P4FLAGS=-DAGGD_ELEMENTS={elements}` or change elements_per_packet")
        self.elements, self.port, self.target = elements, int(port), target
        self.address = str(ipaddress.IPv4Address(address))
        self.total_slots = self.info.slots if total_slots is None else int(total_slots)
        if not 1 <= self.total_slots <= self.info.slots:
            raise P4Error(f"total_slots must be 1..{self.info.slots} (the program's AGGD_SLOTS)")
        self.allocator = SlotAllocator(self.total_slots)
        self.hosts = {str(ipaddress.IPv4Address(ip)): (mac, int(p)) for ip, (mac, p) in (hosts or {}).items()}
        for ip, (_, p) in self.hosts.items():
            if not 0 <= p <= L.MAX_PORT:
                raise P4Error(f"host {ip}: port {p} outside 0..{L.MAX_PORT}")
        self.jobs: dict[int, _Job] = {}
        self.client = None
        self._owned: list = [] if registers is None or not own_registers else [registers]
        try:
            if client is None:
                client = P4RuntimeClient(grpc_address, device_id=device_id, election_id=election_id, timeout=timeout)
                self._owned.append(client)
            self.client = client
            if device_config is not None:
                try:
                    data = device_config if isinstance(device_config, bytes) else Path(device_config).read_bytes()
                except OSError as exc:
                    raise P4Error(f"cannot read the device config {device_config}: {exc.strerror or exc}") from None
                self.client.set_pipeline(self.info.msg, data)
            if registers is None:
                from aggd.dataplane.p4.thrift import Bmv2Registers
                registers = Bmv2Registers(thrift_address)
                self._owned.append(registers)
            self.registers = registers
            self._clear_switch()
            self._install_switch()
        except BaseException:
            self.close()
            raise

    # -- the program ----------------------------------------------------------------------------------
    @staticmethod
    def check_program(info: P4Info, target: str = "bmv2") -> None:
        """Every table, action, register and counter the backend uses, with its widths (start-up
        check, like XdpDataPlane's MAP_NAMES)."""
        registers, counters = (L.TNA_REGISTERS, L.TNA_COUNTERS) if target == "tofino" else (L.REGISTERS, L.COUNTERS)
        problems = []
        tables = list(L.TABLES.values()) + (list(L.TABLES_TNA.values()) if target == "tofino" else [])
        for t in tables:
            if t.name not in info.tables:
                problems.append(f"table {t.name}")
                continue
            have = {m.name: m.bitwidth for m in info.tables[t.name].match_fields}
            for m in t.match:
                if have.get(m.name) != m.bitwidth:
                    problems.append(f"match field {t.name}.{m.name} bit<{m.bitwidth}>")
            for a, params in t.actions.items():
                act = info.actions.get(a)
                if act is None:
                    problems.append(f"action {a}")
                    continue
                have_p = {p.name: p.bitwidth for p in act.params}
                if have_p != {p.name: p.bitwidth for p in params}:
                    problems.append(f"parameters of {a}")
        for name, bits in registers.items():
            r = info.registers.get(name)
            if r is None or r.type_spec.bitstring.bit.bitwidth != bits:
                problems.append(f"register {name} bit<{bits}>")
        for name in counters:
            if name not in info.counters:
                problems.append(f"counter {name}")
        if info.lanes not in (32, 64) or info.passes < 1:
            problems.append(f"lane registers ({info.lanes} lanes, {info.passes} passes)")
        if problems:
            raise P4Error(f"the P4 program lacks or differs in: {', '.join(problems)}")

    def _clear_switch(self) -> None:
        """Delete what an earlier controller (this daemon before a restart) left in the tables and
        multicast groups the backend writes, so that the INSERTs that follow find them empty: the
        daemon owns them, and reinstalls its registry's jobs afresh. (A pushed device_config has
        emptied them already.) Groups are not read back (not every P4Runtime server serves PRE
        reads): the job groups of the jobs found, and the flood group with the service entry."""
        from aggd.dataplane.p4.proto import p4runtime_pb2 as p
        names = list(L.TABLES) + (list(L.TABLES_TNA) if self.target == "tofino" else [])
        found = self.client.read([p.Entity(table_entry=p.TableEntry(table_id=self.info.table(n).preamble.id))
                                  for n in names])
        if not found:
            return
        jobs, groups = set(), set()
        for ent in found:
            table, match, *_ = self.info.read_entry(ent.table_entry)
            if "hdr.aggd.job" in match:
                jobs.add(match["hdr.aggd.job"])
            if table == L.SERVICE:
                groups.add(L.FLOOD_GROUP)
        groups |= {L.job_group(j) for j in jobs}
        # the jobs entries first: from then on those jobs' packets are unknown_job
        order = sorted(found, key=lambda e: self.info.by_id(e.table_entry.table_id).preamble.name != L.JOBS)
        self.client.write([update("DELETE", table_entry=e.table_entry) for e in order])
        for g in sorted(groups):
            try:
                self.client.write([update("DELETE", packet_replication_engine_entry=multicast_group(g, ()))])
            except P4Error:
                pass  # the group was not there (a job half installed, or removed by hand)
        log.warning("removed %d table entries of %d job(s) an earlier controller left on the switch",
                    len(found), len(jobs))

    def _install_switch(self) -> None:
        """The aggd service address, L2 forwarding of the hosts, and the flood group."""
        ups = [update("INSERT", table_entry=self.info.table_entry(
            L.SERVICE, {"hdr.ipv4.dst_addr": ip_int(self.address), "hdr.udp.dst_port": self.port},
            f"{L.PIPE}.aggd_serve", {}))]
        for ip, (mac, p) in sorted(self.hosts.items()):
            ups.append(update("INSERT", table_entry=self.info.table_entry(
                L.FORWARD, {"hdr.ethernet.dst_addr": mac_int(mac)}, f"{L.INGRESS}.l2_forward", {"port": p})))
        if self.target == "tofino":
            for rank in range(proto.MAX_MEMBERS):
                ups.append(update("INSERT", table_entry=self.info.table_entry(
                    L.TNA_RANK_BITS, {"hdr.aggd.rank": rank}, f"{L.PIPE}.rank_bit",
                    {"lo": (1 << rank) & 0xFFFFFFFF, "hi": (1 << rank) >> 32})))
        flood = sorted({p for _, p in self.hosts.values()})
        if flood:
            ups.append(update("INSERT", packet_replication_engine_entry=multicast_group(L.FLOOD_GROUP, flood)))
        self.client.write(ups)

    # -- jobs -----------------------------------------------------------------------------------------
    def check_strategies(self, entries) -> None:
        self._check_kinds(entries)

    def _check_kinds(self, entries: Iterable[TableEntry]) -> None:
        if self.target == "tofino":
            bad = sorted({proto.StrategyKind(e.kind).name.lower() for e in entries} -
                         {k.name.lower() for k in TOFINO_KINDS})
            if bad:
                raise P4Error(f"the Tofino program runs sync and quorum only, not {', '.join(bad)}")

    def _ports(self, members: Mapping[int, tuple[str, int]]) -> tuple[int, ...]:
        """Replication ports of a job's results: its members' hosts; every host port when a member's
        host is unknown (it still gets its results)."""
        ports = set()
        for rank, (ip, _) in members.items():
            host = self.hosts.get(ip)
            if host is None:
                log.warning("member %d at %s is not in the P4 host table: results flood every host port", rank, ip)
                return tuple(sorted({p for _, p in self.hosts.values()}))
            ports.add(host[1])
        return tuple(sorted(ports))

    def _job_params(self, j: _Job) -> dict:
        group_ip, group_port = j.group
        awaited = (1 << j.world) - 1 if j.awaited is None else j.awaited
        return {"world": j.world, "all_members": awaited, "n_slots": int(j.cfg.slots),
                "slot_base": j.base, "switch_slots": j.switch_slots, "max_chunks": int(j.cfg.max_chunks),
                "group_ip": ip_int(group_ip), "group_mac": multicast_mac(group_ip),
                "result_port": int(group_port), "mcast_grp": L.job_group(int(j.cfg.job))}

    def _member_entry(self, job: int, rank: int, addr: tuple[str, int], tag: int):
        return self.info.table_entry(L.MEMBERS, {"hdr.aggd.job": job, "hdr.aggd.rank": rank},
                                     f"{L.PIPE}.set_member",
                                     {"ip": ip_int(addr[0]), "port": int(addr[1]), "tag": check_tag(tag)})

    def _strategy_entry(self, job: int, seg: Segment, priority: int):
        lo, hi, e = seg
        return self.info.table_entry(L.STRATEGY, {"hdr.aggd.job": job, "meta.s_round": (lo, hi)},
                                     f"{L.PIPE}.set_strategy",
                                     {"version": e.version, "kind": e.kind, "param": e.param,
                                      "timeout_us": e.timeout_us}, priority=priority)

    def install_job(self, cfg) -> None:
        """Install (or replace) a job from a config with ``job, world, slots, max_chunks, members,
        group`` (optionally ``kernel_slots``: slots held by the switch, ``strategy``)."""
        job, world, switch_slots = checked_job(cfg, P4Error,
                                               "the P4 data plane multicasts results: the job needs a group")
        entries = [to_entry(getattr(cfg, "strategy", None) or SYNC, 0, 0)]
        self._check_kinds(entries)
        if self.target == "tofino" and int(cfg.slots) & (int(cfg.slots) - 1):
            raise P4Error(f"job {job}: the Tofino program maps chunks to slots with a mask: "
                          f"slots must be a power of two, not {cfg.slots}")
        self.remove_job(job)
        base = self.allocator.allocate(job, switch_slots) if switch_slots else 0
        members = {int(r): (str(a[0]), int(a[1])) for r, a in cfg.members.items()}
        j = _Job(cfg, world, base, switch_slots, (str(cfg.group[0]), int(cfg.group[1])), members,
                 strategy_segments(entries), self._ports(members),
                 tags={int(r): int(t) for r, t in (getattr(cfg, "tags", None) or {}).items() if int(r) in members})
        self._clear_slots(base, switch_slots)
        self.reset_stats(job)
        if self.target == "bmv2":
            self.registers.write(L.REG_MAX_ROUND, job, 0)
        # Everything the job needs first; the jobs entry last: the switch knows the job only when whole.
        ups = [update("INSERT", table_entry=self._member_entry(job, r, a, j.tags.get(r, 0)))
               for r, a in sorted(members.items())]
        ups += [update("INSERT", table_entry=self._strategy_entry(job, s, PRIO_SETTLED)) for s in j.segments]
        ups.append(update("INSERT", packet_replication_engine_entry=multicast_group(L.job_group(job), j.ports)))
        self.client.write(ups)
        self.client.write([update("INSERT", table_entry=self.info.table_entry(
            L.JOBS, {"hdr.aggd.job": job}, f"{L.PIPE}.set_job", self._job_params(j)))])
        self.jobs[job] = j
        log.info("installed job %d: world %d, %d slots (%d on the switch at %d)", job, world, cfg.slots,
                 switch_slots, base)

    def remove_job(self, job: int) -> None:
        j = self.jobs.pop(job, None)
        if j is None:
            return
        # The jobs entry first: from then on the job's packets are unknown_job, whatever is left.
        self.client.write([update("DELETE", table_entry=self.info.table_entry(L.JOBS, {"hdr.aggd.job": job}))])
        ups = [update("DELETE", table_entry=self.info.table_entry(L.MEMBERS, {"hdr.aggd.job": job, "hdr.aggd.rank": r}))
               for r in sorted(j.members)]
        ups += [update("DELETE", table_entry=self.info.table_entry(
            L.STRATEGY, {"hdr.aggd.job": job, "meta.s_round": (lo, hi)}, priority=PRIO_SETTLED))
            for lo, hi, _ in j.segments]
        ups.append(update("DELETE", packet_replication_engine_entry=multicast_group(L.job_group(job), ())))
        self.client.write(ups)
        freed = self.allocator.free(job)
        if freed:
            self._clear_slots(*freed)

    def active_jobs(self) -> list[int]:
        return sorted(self.jobs)

    def set_member(self, job: int, rank: int, addr: tuple[str, int] | None, tag: int = 0) -> None:
        """Register (None: clear) the address rank ``rank`` of ``job`` sends from and its tag."""
        j = self._job(job)
        if not 0 <= rank < j.world:
            raise P4Error(f"job {job}: rank {rank} outside 0..{j.world - 1}")
        old = j.members.get(rank)
        new = None if addr is None else (str(addr[0]), int(addr[1]))
        if old == new and (new is None or j.tags.get(rank, 0) == tag):
            return
        if new is None:
            ups = [update("DELETE", table_entry=self.info.table_entry(
                L.MEMBERS, {"hdr.aggd.job": job, "hdr.aggd.rank": rank}))]
            del j.members[rank]
            j.tags.pop(rank, None)
        else:
            ups = [update("MODIFY" if old else "INSERT", table_entry=self._member_entry(job, rank, new, tag))]
            j.members[rank] = new
            j.tags[rank] = tag
        ports = self._ports(j.members)
        if ports != j.ports:
            ups.append(update("MODIFY", packet_replication_engine_entry=multicast_group(L.job_group(job), ports)))
            j.ports = ports
        self.client.write(ups)

    def set_awaited(self, job: int, awaited: int) -> None:
        """The members a round of ``job`` waits for: the jobs entry's ``all_members``, which both
        programs' release tests read (sync: every awaited member's bit in the bank's bitmap), and
        their rule 0: a packet to a round that has them all releases it to the group."""
        j = self._job(job)
        try:
            j.awaited = check_awaited(awaited, j.world)
        except ValueError as exc:
            raise P4Error(f"job {job}: {exc}") from None
        self.client.write([update("MODIFY", table_entry=self.info.table_entry(
            L.JOBS, {"hdr.aggd.job": job}, f"{L.PIPE}.set_job", self._job_params(j)))])

    def set_strategy(self, job: int, entries) -> None:
        """Install a job's strategy table (``aggd.core.strategy.TableEntry`` rows, newest last; the
        newest STRATEGY_VERSIONS are kept, as in the XDP ring)."""
        j = self._job(job)
        entries = list(entries)[-proto.STRATEGY_VERSIONS:]
        from aggd.core.model import check_table
        try:
            check_table(entries)
        except ValueError as exc:
            raise P4Error(str(exc)) from None
        self._check_kinds(entries)
        new = strategy_segments(entries)
        for batch in strategy_plan(j.segments, new):
            self.client.write([update(kind, table_entry=self._strategy_entry(job, seg, prio) if kind == "INSERT"
                                      else self.info.table_entry(L.STRATEGY, {"hdr.aggd.job": job,
                                                                              "meta.s_round": seg[:2]},
                                                                 priority=prio))
                               for kind, seg, prio in batch])
        j.segments = new
        j.rows = entries

    def strategy_entries(self, job: int) -> list[TableEntry]:
        j = self._job(job)
        return sorted(getattr(j, "rows", None) or [s[2] for s in j.segments], key=lambda e: e.version)

    def _job(self, job: int) -> _Job:
        try:
            return self.jobs[job]
        except KeyError:
            raise P4Error(f"job {job} is not installed") from None

    # -- registers -----------------------------------------------------------------------------------
    def clear_rounds(self, job: int) -> None:
        self._clear_slots(*self.allocation(job))

    def _clear_slots(self, base: int, count: int) -> None:
        """Empty the banks of slots [base, base + count): state EMPTY, unlocked, no late memory (the
        other bank registers are written when a bank opens)."""
        if not count:
            return
        if self.target == "tofino":
            lo, hi = base * L.TNA_BANKS, (base + count) * L.TNA_BANKS
            self.registers.write_range(L.TNA_REG_BANK_ROUND, lo, hi, 0)
            self.registers.write_range(L.TNA_REG_BANK_RELEASED, lo, hi, 0)
            return
        self.registers.write_range(L.REG_SLOT_LOCK, base, base + count, 0)
        self.registers.write_range(L.REG_SLOT_PENDING, base, base + count, 0)
        self.registers.write_range(L.REG_SLOT_SHARED, base, base + count, 0)
        self.registers.write_range(L.REG_BANK_STATE, L.bank_index(base, 0), L.bank_index(base + count, 0), 0)
        self.registers.write_range(L.REG_LATE_ROUND, base * proto.MAX_MEMBERS, (base + count) * proto.MAX_MEMBERS, 0)

    def reset_stats(self, job: int | None) -> None:
        """Zero a job's counters (None: the no-job bucket)."""
        bucket = L.NO_JOB if job is None else job
        if self.target == "tofino":
            for c in range(L.COUNTER_STRIDE):
                self.registers.write_counter(L.TNA_CTR_EVENTS, L.counter_index(bucket, c), 0)
        else:
            self.registers.write_range(L.REG_JOB_COUNTERS, L.counter_index(bucket, 0),
                                       L.counter_index(bucket, L.COUNTER_STRIDE), 0)
        for r in range(L.DROP_STRIDE):
            self.registers.write_counter(L.CTR_DROPS, L.drop_index(bucket, r), 0)

    def job_stats(self, job: int | None) -> JobStats:
        """Counters of a job (None: the no-job bucket). On Tofino only the per-packet counters of
        TNA_COUNTED are kept: the others are absent (``untracked``)."""
        bucket = L.NO_JOB if job is None else job
        untracked = frozenset()
        if self.target == "tofino":
            counters = {c.name.lower(): self.registers.read_counter(L.TNA_CTR_EVENTS, L.counter_index(bucket, c))
                        for c in proto.Counter if c.name in L.TNA_COUNTED}
            untracked = frozenset(c.name.lower() for c in proto.Counter if c.name not in L.TNA_COUNTED)
        else:
            counters = {c.name.lower(): self.registers.read(L.REG_JOB_COUNTERS, L.counter_index(bucket, c))
                        for c in proto.Counter}
        drops = {r.name.lower(): self.registers.read_counter(L.CTR_DROPS, L.drop_index(bucket, r))
                 for r in proto.DropReason}
        return JobStats(counters, drops, untracked)

    def allocation(self, job: int) -> tuple[int, int]:
        """(first switch slot, switch slots) of an installed job; (0, 0) otherwise."""
        j = self.jobs.get(job)
        return (j.base, j.switch_slots) if j else (0, 0)

    def job_rounds(self, job: int) -> tuple[int | None, dict[int, int]]:
        """(highest round any switch slot of ``job`` holds, {rank: highest round it contributed
        to}), from the banks' registers (what aggd.dataplane.xdp.ops.job_rounds reads from the XDP maps)."""
        base, count = self.allocation(job)
        if self.target == "tofino":
            return None, {}                 # the TNA program keeps no per-bank bitmap of 64 bits
        banks = (L.bank_index(slot, b) for slot in range(base, base + count) for b in range(L.BANKS))
        read = self.registers.read
        return rounds_by_member((read(L.REG_BANK_ROUND, i), read(L.REG_BANK_BITMAP, i))
                                for i in banks if read(L.REG_BANK_STATE, i))

    def open_slots(self, job: int) -> int | None:
        """The job's slots with an open bank (BMv2; None on Tofino, whose banks keep only a round
        and a released flag)."""
        if self.target == "tofino":
            return None
        base, count = self.allocation(job)
        return sum(any(self.registers.read(L.REG_BANK_STATE, L.bank_index(s, b)) == L.BANK_OPEN
                       for b in range(L.BANKS)) for s in range(base, base + count))

    @property
    def attached(self) -> bool:
        """Connected to the switch's P4Runtime server (the gRPC channel not shut down)."""
        return self.client is not None and not getattr(self, "_closed", False)

    def describe(self) -> dict:
        return {"target": self.target, "program_slots": self.info.slots, "slots": self.total_slots,
                "hosts": len(self.hosts), "p4info": str(self.info.path) if self.info.path else None}

    def max_round(self, job: int) -> int | None:
        """The highest round any member of ``job`` has sent to the switch, or None (always None
        on Tofino, whose program does not keep it: the daemon's user-space rounds decide there)."""
        if self.target == "tofino":
            return None
        top = self.registers.read(L.REG_MAX_ROUND, job)
        return top - 1 if top else None

    def set_clock(self, ns: int) -> None:
        """Freeze the switch's clock at ``ns`` (kept in microseconds); 0 returns to real time."""
        if self.target == "tofino":
            raise P4Error("the Tofino program reads the MAC timestamp only: its clock cannot be frozen")
        self.registers.write(L.REG_CLOCK, 0, max(1, ns // 1000) if ns else 0)

    # -- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        for owned in reversed(getattr(self, "_owned", [])):
            try:
                owned.close()
            except Exception:  # noqa: BLE001
                log.exception("closing %s", owned)
        self._owned = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
