"""The P4Info in the repo, the P4 sources and the backend agree on every object the backend uses."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf import text_format

from aggd.dataplane.p4 import layout as L
from aggd.dataplane.p4 import p4info_gen as gen
from aggd.dataplane.p4.backend import P4DataPlane
from aggd.dataplane.p4.p4info import P4INFO, P4Info
from aggd.dataplane.p4.proto import p4info_pb2
from aggd_client import protocol as proto

P4_DIR = Path(L.__file__).resolve().parent / "programs"
V1MODEL = P4_DIR / "v1model" / "aggd.p4"
TNA = P4_DIR / "tna" / "aggd.p4"
COMMON = P4_DIR / "common"


def parsed() -> p4info_pb2.P4Info:
    return text_format.Parse(P4INFO.read_text(), p4info_pb2.P4Info())


def test_p4info_parses_and_has_what_the_backend_uses():
    msg = parsed()
    info = P4Info(msg)
    P4DataPlane.check_program(info)          # raises naming whatever is missing
    tables = {t.preamble.name: t for t in msg.tables}
    actions = {a.preamble.name: a for a in msg.actions}
    for use in L.TABLES.values():
        t = tables[use.name]
        fields = [(m.name, m.bitwidth, p4info_pb2.MatchField.MatchType.Name(m.match_type).lower())
                  for m in t.match_fields]
        assert fields == [(m.name, m.bitwidth, m.kind) for m in use.match], use.name
        assert [m.id for m in t.match_fields] == list(range(1, len(use.match) + 1))
        refs = {actions_by_id.preamble.name for actions_by_id in msg.actions
                if actions_by_id.preamble.id in {r.id for r in t.action_refs}}
        assert set(use.actions) <= refs, use.name
        for name, params in use.actions.items():
            got = [(p.id, p.name, p.bitwidth) for p in actions[name].params]
            assert got == [(i, p.name, p.bitwidth) for i, p in enumerate(params, 1)], name
    ranged = tables[L.STRATEGY]
    assert any(m.match_type == p4info_pb2.MatchField.RANGE for m in ranged.match_fields)
    regs = {r.preamble.name: r for r in msg.registers}
    for name, bits in L.REGISTERS.items():
        assert regs[name].type_spec.bitstring.bit.bitwidth == bits, name
    for name, bits in L.BANK_REGISTERS.items():
        assert regs[f"{L.PIPE}.{name}"].type_spec.bitstring.bit.bitwidth == bits, name
    ctrs = {c.preamble.name: c for c in msg.counters}
    for name, unit in L.COUNTERS.items():
        assert p4info_pb2.CounterSpec.Unit.Name(ctrs[name].spec.unit) == unit
    assert ctrs[L.CTR_DROPS].size == L.JOB_ROWS * L.DROP_STRIDE
    assert regs[L.REG_JOB_COUNTERS].size == L.JOB_ROWS * L.COUNTER_STRIDE
    assert len(proto.Counter) <= L.COUNTER_STRIDE and len(proto.DropReason) <= L.DROP_STRIDE


def test_program_sizes_read_from_the_p4info():
    info = P4Info()
    assert (info.lanes, info.passes, info.elements, info.slots) == (gen.LANES, gen.PASSES, gen.ELEMENTS, gen.SLOTS)
    assert info.elements == proto.DEFAULT_ELEMENTS


def test_ids_are_p4cs():
    """Ids as p4c assigns them: prefix << 24 | Jenkins hash of the name (NoAction is p4c's 21257015)."""
    msg = parsed()
    objs = [(gen.TABLE, o) for o in msg.tables] + [(gen.ACTION, o) for o in msg.actions] + \
           [(gen.COUNTER, o) for o in msg.counters] + [(gen.REGISTER, o) for o in msg.registers]
    ids = [o.preamble.id for _, o in objs]
    assert len(set(ids)) == len(ids)
    for prefix, o in objs:
        assert o.preamble.id >> 24 == prefix, o.preamble.name
        assert o.preamble.id & 0xFFFFFF == gen.jenkins(o.preamble.name) & 0xFFFFFF, o.preamble.name
        assert o.preamble.alias == o.preamble.name.rsplit(".", 1)[-1]
    assert {a.preamble.name: a.preamble.id for a in msg.actions}["NoAction"] == 21257015


@pytest.mark.parametrize("path,target", list(gen.FILES.items()), ids=list(gen.FILES.values()))
def test_the_committed_p4info_describes_the_program(path, target):
    """The committed P4Info (hand-kept, or p4c's after `make p4`) has every object of the program's
    description in aggd/dataplane/p4/p4info_gen.py, with the same id, fields, widths and sizes."""
    committed = text_format.Parse(path.read_text(), p4info_pb2.P4Info())
    wanted = gen.build(target)
    for kind in ("tables", "actions", "registers", "counters"):
        have = {o.preamble.name: o for o in getattr(committed, kind)}
        for o in getattr(wanted, kind):
            got = have.get(o.preamble.name)
            assert got is not None, f"{path.name}: no {kind[:-1]} {o.preamble.name}: run `make p4`"
            assert got.preamble.id == o.preamble.id, o.preamble.name
            for f in ("match_fields", "params", "size", "type_spec", "spec", "action_refs"):
                if f in {d.name for d in o.DESCRIPTOR.fields}:
                    assert getattr(got, f) == getattr(o, f), (o.preamble.name, f)
    if path.read_text().startswith("# P4Info of aggd/dataplane/p4/programs/"):     # the hand-kept file (a compiler's has no header)
        assert path.read_text() == gen.render(target), "run `python -m aggd.dataplane.p4.p4info_gen --write` (or `make p4`)"


# ---------------------------------------------------------------------------------------------
# The P4 sources declare the same objects (a light text check: p4c cannot run here).

def _defines() -> dict[str, int]:
    """Numeric #defines of layout.p4 and the constants of the generated aggd_proto.p4."""
    env: dict[str, int] = {}
    for line in (P4_DIR / "aggd_proto.p4").read_text().splitlines():
        m = re.match(r"const bit<\d+> (\w+) = (\d+);", line)
        if m:
            env[m.group(1)] = int(m.group(2))
    for line in (COMMON / "layout.p4").read_text().splitlines():
        m = re.match(r"#define (\w+) (.+?)\s*(/\*.*)?$", line)
        if m and re.fullmatch(r"[\w\s()*/+-]+", m.group(2)):
            try:
                env[m.group(1)] = int(eval(m.group(2), {}, dict(env)))  # noqa: S307 -- our own constants
            except NameError:
                pass
    return env


def _eval(expr: str, env: dict[str, int]) -> int:
    return int(eval(expr, {}, env))  # noqa: S307


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


def _control(text: str, name: str) -> str:
    start = text.index(f"control {name}(")
    depth, i = 0, text.index("{", start)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j + 1]
    raise AssertionError(f"control {name} not closed")


def test_layout_constants_match_the_backend():
    env = _defines()
    assert env["AGGD_COUNTER_STRIDE"] == L.COUNTER_STRIDE and env["AGGD_DROP_STRIDE"] == L.DROP_STRIDE
    assert env["AGGD_NO_JOB"] == L.NO_JOB == env["AGGD_MAX_JOBS"] and env["AGGD_JOB_ROWS"] == L.JOB_ROWS
    assert env["AGGD_FLOOD_GROUP"] == L.FLOOD_GROUP and env["AGGD_BANKS"] == L.BANKS
    assert (env["AGGD_ELEMENTS"], env["AGGD_LANES"], env["AGGD_SLOTS"]) == (gen.ELEMENTS, gen.LANES, gen.SLOTS)
    assert env["AGGD_PORT"] == proto.DEFAULT_PORT


@pytest.mark.parametrize("target", ["v1model", "tna"])
def test_source_declares_every_p4info_object(target):
    prog, p4info = (V1MODEL, P4INFO) if target == "v1model" else (TNA, gen.TNA_P4INFO)
    text = _strip_comments(prog.read_text())
    env = _defines() | {"TNA_CELLS": gen.SLOTS * L.TNA_BANKS}
    ingress, pipe = _control(text, "AggdIngress"), _control(text, "AggdPipeline")
    assert re.search(r"\bAggdPipeline\(\)\s+aggd\s*;", ingress), "the pipeline is instance `aggd` of AggdIngress"
    scopes = {L.PIPE: pipe, L.INGRESS: ingress}
    info = text_format.Parse(p4info.read_text(), p4info_pb2.P4Info())
    assert info.pkg_info.arch == target
    for t in info.tables:
        scope, alias = t.preamble.name.rsplit(".", 1)
        body = scopes[scope]
        m = re.search(rf"table {alias}\s*{{(.*?)\n    }}", body, re.S)
        assert m, f"table {t.preamble.name} not declared"
        decl = m.group(1)
        for mf in t.match_fields:
            kind = p4info_pb2.MatchField.MatchType.Name(mf.match_type).lower()
            assert re.search(rf"{re.escape(mf.name)}\s*:\s*{kind}\s*;", decl), (t.preamble.name, mf.name)
        size = re.search(r"size = ([^;]+);", decl).group(1)
        assert _eval(size, env) == t.size, (t.preamble.name, size)
        refs = {a.preamble.id: a.preamble.name.rsplit(".", 1)[-1] for a in info.actions}
        listed = re.search(r"actions = \{([^}]*)\}", decl).group(1)
        for r in t.action_refs:
            assert re.search(rf"\b{refs[r.id]}\b", listed), (t.preamble.name, refs[r.id])
    for a in info.actions:
        if a.preamble.name == "NoAction":
            continue
        scope, alias = a.preamble.name.rsplit(".", 1)
        m = re.search(rf"action {alias}\(([^)]*)\)", scopes[scope], re.S)
        assert m, f"action {a.preamble.name} not declared"
        params = [tuple(x.split()) for x in m.group(1).split(",") if x.strip()]
        assert [(f"bit<{p.bitwidth}>", p.name) for p in a.params] == params, a.preamble.name
    lanes = 0
    for r in info.registers:
        alias = r.preamble.name.rsplit(".", 1)[-1]
        bits = r.type_spec.bitstring.bit.bitwidth
        if alias.startswith("lane_"):
            lanes += 1
            decl = (r"#define AGGD_LANE_REGISTER\(i\) register<bit<(\d+)>>\((\w+)\) lane_##i;" if target == "v1model"
                    else r"#define TNA_LANE\(i\) \\\s*Register<bit<(\d+)>, bit<32>>\((\w+)\) lane_##i;")
            m = re.search(decl, text)
            assert m and int(m.group(1)) == bits and env[m.group(2)] == r.size, alias
            continue
        decl = (rf"register<bit<(\d+)>>\(([^)]*)\)\s+{alias}\s*;" if target == "v1model"
                else rf"Register<bit<(\d+)>, bit<32>>\(([^)]*)\)\s+{alias}\s*;")
        m = re.search(decl, pipe)
        assert m, f"register {r.preamble.name} not declared"
        assert int(m.group(1)) == bits and _eval(m.group(2), env) == r.size, (alias, m.groups())
    assert lanes == (gen.LANES if target == "v1model" else gen.TNA_LANES)
    assert ("AGGD_FOR_LANES(AGGD_LANE_REGISTER)" if target == "v1model" else "AGGD_FOR_LANES(TNA_LANE)") in pipe
    for c in info.counters:
        alias = c.preamble.name.rsplit(".", 1)[-1]
        decl = (rf"counter\(([^,]+),\s*CounterType\.packets\)\s+{alias}\s*;" if target == "v1model"
                else rf"Counter<bit<32>, bit<32>>\(([^,]+),\s*CounterType_t\.PACKETS\)\s+{alias}\s*;")
        m = re.search(decl, pipe)
        assert m and _eval(m.group(1), env) == c.size, alias


def test_tofino_p4info_has_what_the_tofino_backend_uses():
    info = P4Info(gen.TNA_P4INFO)
    P4DataPlane.check_program(info, "tofino")
    assert info.tofino and (info.lanes, info.passes, info.elements, info.slots) == (32, 1, 32, gen.SLOTS)


def test_one_parser_and_one_wire_header():
    """Both programs include the shared parser and the generated header; neither declares its own."""
    for prog in (V1MODEL, TNA):
        text = _strip_comments(prog.read_text())
        assert '#include "../common/parser.p4"' in text, prog
        assert "header aggd_h" not in text and "parser AggdCommonParser" not in text, prog
        assert "AggdCommonParser()" in text, prog
    assert '#include "../aggd_proto.p4"' in (COMMON / "headers.p4").read_text()
    assert "header aggd_h" not in (COMMON / "headers.p4").read_text()
    parser = _strip_comments((COMMON / "parser.p4").read_text())
    assert "pkt.extract(hdr.aggd);" in parser and "AGGD_PORT: parse_aggd;" in parser


@pytest.mark.parametrize("path", sorted(P4_DIR.rglob("*.p4")), ids=lambda p: str(p.relative_to(P4_DIR)))
def test_sources_are_balanced(path):
    """Braces and parentheses balance in every P4 source (what a text check can say without p4c)."""
    text = _strip_comments(path.read_text())
    for o, c in ("{}", "()", "[]"):
        assert text.count(o) == text.count(c), (path.name, o)


def test_make_p4_without_a_compiler_fails_saying_where_they_come_from(tmp_path):
    """`make p4` (aggd/dataplane/p4/programs/build.sh) with neither p4c-bm2-ss nor bf-p4c on the PATH: exit 1, nothing
    written, and the message names both compilers, where they come from, and `make p4info`."""
    import shutil
    import subprocess
    path = "/usr/sbin:/usr/bin:/sbin:/bin"
    if any(shutil.which(c, path=path) for c in ("p4c-bm2-ss", "bf-p4c")):
        pytest.skip("a P4 compiler is installed: build.sh would compile (tests/p4/test_bmv2.py does)")
    before = {p: p.read_bytes() for p in P4_DIR.rglob("*") if p.is_file()}
    res = subprocess.run(["bash", str(P4_DIR / "build.sh")], capture_output=True, text=True,
                         env={"PATH": path}, timeout=60)
    assert res.returncode == 1
    assert "p4c-bm2-ss not found" in res.stdout and "bf-p4c (Tofino SDE) not found" in res.stdout
    assert "no P4 compiler found" in res.stderr and "github.com/p4lang/p4c" in res.stderr
    assert "make p4info" in res.stderr
    assert {p: p.read_bytes() for p in P4_DIR.rglob("*") if p.is_file()} == before
