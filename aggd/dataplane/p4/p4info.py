"""The P4Info of the aggd programs, read: names to ids, table entries built and read by name, and
what the compiled program holds (lanes, passes, slots). Where the committed P4Info files come from
without a compiler: ``p4info_gen.py``."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from aggd.dataplane.p4 import P4Error, layout as L
from aggd.dataplane.p4.encoding import decode, encode

PROGRAMS = Path(__file__).resolve().parent / "programs"
P4INFO = PROGRAMS / "v1model" / "aggd.p4info.txtpb"
TNA_P4INFO = PROGRAMS / "tna" / "aggd.p4info.txtpb"


class P4Info:
    """A P4Info message with lookups by name (the backend never hard-codes an id)."""

    def __init__(self, source: str | Path | object = P4INFO) -> None:
        from google.protobuf import text_format

        from aggd.dataplane.p4.proto import p4info_pb2
        if isinstance(source, (str, Path)):
            try:
                self.msg = text_format.Parse(Path(source).read_text(), p4info_pb2.P4Info())
            except OSError as exc:
                raise P4Error(f"cannot read the P4Info {source}: {exc.strerror or exc}") from None
            except text_format.ParseError as exc:
                raise P4Error(f"{source} is not a P4Info in text format: {exc}") from None
            self.path = Path(source)
        else:
            self.msg, self.path = source, None
        self.tables = {t.preamble.name: t for t in self.msg.tables}
        self.actions = {a.preamble.name: a for a in self.msg.actions}
        self.registers = {r.preamble.name: r for r in self.msg.registers}
        self.counters = {c.preamble.name: c for c in self.msg.counters}
        self._by_id = {o.preamble.id: o for o in (*self.msg.tables, *self.msg.actions, *self.msg.registers,
                                                   *self.msg.counters)}

    def by_id(self, id_: int):
        return self._by_id[id_]

    def table(self, name: str):
        try:
            return self.tables[name]
        except KeyError:
            raise P4Error(f"the P4 program has no table {name}") from None

    def action(self, name: str):
        try:
            return self.actions[name]
        except KeyError:
            raise P4Error(f"the P4 program has no action {name}") from None

    def register_size(self, name: str) -> int:
        return int(self.registers[name].size) if name in self.registers else 0

    # -- what the compiled program holds (from register sizes: see aggd/dataplane/p4/programs/common/layout.p4) -----
    @property
    def tofino(self) -> bool:
        """The TNA program (two banks a slot, one pass) rather than the v1model one."""
        return L.REG_SLOT_LOCK not in self.registers and L.TNA_REG_BANK_RELEASED in self.registers

    @property
    def lanes(self) -> int:
        return sum(1 for n in self.registers if n.startswith(f"{L.PIPE}.lane_"))

    @property
    def slots(self) -> int:
        if self.tofino:
            return self.register_size(L.TNA_REG_BANK_ROUND) // L.TNA_BANKS
        return self.register_size(L.REG_SLOT_LOCK)

    @property
    def passes(self) -> int:
        slots = self.slots
        banks = L.TNA_BANKS if self.tofino else L.BANKS
        return self.register_size(L.REG_LANE0) // (slots * banks) if slots else 0

    @property
    def elements(self) -> int:
        return self.lanes * self.passes

    # -- entries ------------------------------------------------------------------------------------
    def table_entry(self, table: str, match: Mapping[str, object], action: str | None = None,
                    params: Mapping[str, int] | None = None, priority: int = 0):
        """A p4.v1.TableEntry. ``match`` values: an int (exact) or (low, high) (range; a range that
        covers the field is left out, as P4Runtime requires)."""
        from aggd.dataplane.p4.proto import p4info_pb2, p4runtime_pb2
        t = self.table(table)
        fields = {m.name: m for m in t.match_fields}
        entry = p4runtime_pb2.TableEntry(table_id=t.preamble.id, priority=priority)
        for name, value in match.items():
            mf = fields.get(name)
            if mf is None:
                raise P4Error(f"table {table} has no match field {name}")
            fm = p4runtime_pb2.FieldMatch(field_id=mf.id)
            if mf.match_type == p4info_pb2.MatchField.EXACT:
                fm.exact.value = encode(value, mf.bitwidth)
            elif mf.match_type == p4info_pb2.MatchField.RANGE:
                lo, hi = value
                if (lo, hi) == (0, (1 << mf.bitwidth) - 1):
                    continue
                fm.range.low, fm.range.high = encode(lo, mf.bitwidth), encode(hi, mf.bitwidth)
            else:
                raise P4Error(f"match type {mf.match_type} of {table}.{name} is not used by aggd")
            entry.match.append(fm)
        if action is not None:
            a = self.action(action)
            if a.preamble.id not in {r.id for r in t.action_refs}:
                raise P4Error(f"action {action} is not an action of table {table}")
            entry.action.action.action_id = a.preamble.id
            declared = {p.name: p for p in a.params}
            given = dict(params or {})
            if set(given) != set(declared):
                raise P4Error(f"action {action} takes {sorted(declared)}, not {sorted(given)}")
            for p in a.params:
                entry.action.action.params.add(param_id=p.id, value=encode(given[p.name], p.bitwidth))
        return entry

    def read_entry(self, entry) -> tuple[str, dict, str | None, dict, int]:
        """(table, {field: int or (low, high)}, action, {param: int}, priority) of a TableEntry;
        range fields left out read as the full range."""
        from aggd.dataplane.p4.proto import p4info_pb2
        t = self.by_id(entry.table_id)
        fields = {m.id: m for m in t.match_fields}
        match: dict = {}
        for fm in entry.match:
            mf = fields[fm.field_id]
            match[mf.name] = (decode(fm.range.low), decode(fm.range.high)) if fm.HasField("range") \
                else decode(fm.exact.value)
        for mf in t.match_fields:
            if mf.name not in match and mf.match_type == p4info_pb2.MatchField.RANGE:
                match[mf.name] = (0, (1 << mf.bitwidth) - 1)
        action, params = None, {}
        if entry.HasField("action"):
            a = self.by_id(entry.action.action.action_id)
            action = a.preamble.name
            names = {p.id: p.name for p in a.params}
            params = {names[p.param_id]: decode(p.value) for p in entry.action.action.params}
        return t.preamble.name, match, action, params, entry.priority
