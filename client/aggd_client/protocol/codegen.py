"""Generate the C (XDP) and P4 headers from ``definition``.

``python -m aggd_client.protocol.codegen --write`` rewrites them; ``--check`` exits 1 when either
drifts from the definition (the unit tests do the same).
"""
from __future__ import annotations

import argparse
import enum
import sys
from pathlib import Path

from . import definition as d
from .codec import HEADER_SIZE

ROOT = Path(__file__).resolve().parents[3]
C_HEADER = ROOT / "xdp" / "aggd_proto.h"
P4_HEADER = ROOT / "aggd" / "dataplane" / "p4" / "programs" / "aggd_proto.p4"

_BANNER = "GENERATED from client/aggd_client/protocol/definition.py by codegen.py: do not edit."
_C_TYPES = {"u8": "__u8", "u16": "__be16", "u32": "__be32", "u64": "__be64", "i16": "__be16"}
_P4_BITS = {"u8": 8, "u16": 16, "u32": 32, "u64": 64, "i16": 16}

_CONSTANTS = ("MAGIC", "VERSION", "DEFAULT_PORT", "DEFAULT_RESULT_PORT", "DEFAULT_ELEMENTS",
              "PAGE_MAX_ELEMENTS", "NATIVE_MAX_MTU", "NATIVE_MAX_ELEMENTS", "MAX_ELEMENTS", "MAX_MEMBERS", "MAX_JOBS", "STRATEGY_VERSIONS", "ZERO_EXPONENT", "SKIP_MAX",
              "RESULT_WINDOW", "INT8_MAX_CONTRIBUTIONS")
_ENUMS: tuple[type[enum.IntEnum], ...] = (d.MsgType, d.Flag, d.NackCode, d.Precision, d.StrategyKind,
                                          d.DropReason, d.Counter)


def _snake_upper(name: str) -> str:
    out = "".join("_" + c if c.isupper() and i else c for i, c in enumerate(name))
    return out.upper()


def render_c() -> str:
    lines = [f"/* {_BANNER} */", "#ifndef AGGD_PROTO_H", "#define AGGD_PROTO_H", ""]
    for name in _CONSTANTS:
        value = getattr(d, name)
        lines.append(f"#define AGGD_{name} {value:#x}" if name == "MAGIC" else f"#define AGGD_{name} {value}")
    lines.append(f"#define AGGD_HDR_SIZE {HEADER_SIZE}")
    lines.append("")
    for en in _ENUMS:
        prefix = "AGGD_" + _snake_upper(en.__name__)
        lines.append(f"enum aggd_{_snake_upper(en.__name__).lower()} {{")
        for member in en:
            lines.append(f"\t{prefix}_{member.name} = {int(member)},")
        if [int(m) for m in en] == list(range(len(en))):
            lines.append(f"\t{prefix}__COUNT = {len(en)},")
        lines.append("};")
        lines.append("")
    lines.append("/* Header fields are big-endian; the int32 payload that follows is little-endian. */")
    lines.append("struct aggd_hdr {")
    for f in d.HEADER:
        lines.append(f"\t{_C_TYPES[f.ctype]} {f.name};\t/* {f.doc} */")
    lines.append("} __attribute__((packed));")
    lines.append("")
    lines.append("#endif /* AGGD_PROTO_H */")
    return "\n".join(lines) + "\n"


def render_p4() -> str:
    lines = [f"/* {_BANNER} */", "#ifndef AGGD_PROTO_P4", "#define AGGD_PROTO_P4", ""]
    for name in _CONSTANTS:
        lines.append(f"const bit<32> AGGD_{name} = {getattr(d, name)};")
    lines.append(f"const bit<32> AGGD_HDR_SIZE = {HEADER_SIZE};")
    lines.append("")
    for en in _ENUMS:
        prefix = "AGGD_" + _snake_upper(en.__name__)
        for member in en:
            lines.append(f"const bit<8> {prefix}_{member.name} = {int(member)};")
        lines.append("")
    lines.append("header aggd_h {")
    for f in d.HEADER:
        lines.append(f"    bit<{_P4_BITS[f.ctype]}> {f.name};  // {f.doc}")
    lines.append("}")
    lines.append("")
    lines.append("#endif")
    return "\n".join(lines) + "\n"


GENERATED = {C_HEADER: render_c, P4_HEADER: render_p4}


def drifted() -> list[Path]:
    return [p for p, render in GENERATED.items() if not p.exists() or p.read_text() != render()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="rewrite the generated headers")
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated header drifted")
    args = ap.parse_args(argv)
    if args.write:
        for path, render in GENERATED.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render())
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    stale = drifted()
    for p in stale:
        print(f"{p.relative_to(ROOT)} drifted from the wire definition: run `make gen`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
