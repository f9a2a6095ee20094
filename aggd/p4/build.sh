#!/usr/bin/env bash
# `make p4`: compile the aggd P4 programs where their compilers are installed, and write their
# P4Info next to the source (aggd/p4/{v1model,tna}/aggd.p4info.txtpb). Without p4c, the hand-kept
# P4Info is rewritten from aggd/p4/p4info.py instead (the programs are then not compiled).
#   P4FLAGS="-DAGGD_ELEMENTS=128 -DAGGD_SLOTS=4096" make p4     # other sizes (docs/p4.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
P4FLAGS=${P4FLAGS:-}
say() { printf '\033[1m[p4]\033[0m %s\n' "$*"; }

if command -v p4c-bm2-ss >/dev/null 2>&1; then
  mkdir -p aggd/p4/v1model/build
  # shellcheck disable=SC2086
  p4c-bm2-ss --arch v1model --std p4-16 $P4FLAGS -o aggd/p4/v1model/build/aggd.json \
    --p4runtime-files aggd/p4/v1model/aggd.p4info.txtpb aggd/p4/v1model/aggd.p4
  say "BMv2: aggd/p4/v1model/build/aggd.json and aggd.p4info.txtpb written by p4c-bm2-ss"
else
  "$PY" -m aggd.p4.p4info --write >/dev/null
  say "p4c-bm2-ss not found: the v1model program is not compiled; its P4Info was rewritten from aggd/p4/p4info.py"
fi

if command -v bf-p4c >/dev/null 2>&1; then
  mkdir -p aggd/p4/tna/build
  # shellcheck disable=SC2086
  bf-p4c --target tofino --arch tna -DAGGD_ELEMENTS=32 -DAGGD_LANES=32 $P4FLAGS -o aggd/p4/tna/build \
    --p4runtime-files aggd/p4/tna/aggd.p4info.txtpb aggd/p4/tna/aggd.p4
  say "Tofino: aggd/p4/tna/build (bfrt.json, context.json, tofino.bin) written by bf-p4c"
else
  say "bf-p4c (Tofino SDE) not found: the TNA program is not compiled"
fi
