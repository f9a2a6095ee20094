#!/usr/bin/env bash
# `make p4`: compile the aggd P4 programs with whichever of their compilers is installed, writing
# their P4Info next to the source (aggd/dataplane/p4/programs/{v1model,tna}/aggd.p4info.txtpb):
#   p4c-bm2-ss (p4c, BMv2)  -> aggd/dataplane/p4/programs/v1model/build/aggd.json   (p4.device_config for BMv2)
#   bf-p4c (Tofino SDE)     -> aggd/dataplane/p4/programs/tna/build/                 (bf_switchd's conf, tofino.bin)
# With neither compiler it explains where they come from and fails: nothing is compiled. (The
# committed P4Info files are kept without a compiler by `make p4info`: aggd/dataplane/p4/p4info_gen.py.)
#   P4FLAGS="-DAGGD_ELEMENTS=128 -DAGGD_SLOTS=4096" make p4     # other sizes (docs/p4.md)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
P4FLAGS=${P4FLAGS:-}
say() { printf '\033[1m[p4]\033[0m %s\n' "$*"; }
compiled=0

if command -v p4c-bm2-ss >/dev/null 2>&1; then
  mkdir -p aggd/dataplane/p4/programs/v1model/build
  # shellcheck disable=SC2086
  p4c-bm2-ss --arch v1model --std p4-16 $P4FLAGS -o aggd/dataplane/p4/programs/v1model/build/aggd.json \
    --p4runtime-files aggd/dataplane/p4/programs/v1model/aggd.p4info.txtpb aggd/dataplane/p4/programs/v1model/aggd.p4
  say "BMv2: aggd/dataplane/p4/programs/v1model/build/aggd.json and aggd.p4info.txtpb written by p4c-bm2-ss"
  compiled=$((compiled + 1))
else
  say "p4c-bm2-ss not found: the BMv2 (v1model) program is not compiled"
fi

if command -v bf-p4c >/dev/null 2>&1; then
  mkdir -p aggd/dataplane/p4/programs/tna/build
  # shellcheck disable=SC2086
  bf-p4c --target tofino --arch tna -DAGGD_ELEMENTS=32 -DAGGD_LANES=32 $P4FLAGS -o aggd/dataplane/p4/programs/tna/build \
    --p4runtime-files aggd/dataplane/p4/programs/tna/aggd.p4info.txtpb aggd/dataplane/p4/programs/tna/aggd.p4
  say "Tofino: aggd/dataplane/p4/programs/tna/build (bfrt.json, context.json, tofino.bin) written by bf-p4c"
  compiled=$((compiled + 1))
else
  say "bf-p4c (Tofino SDE) not found: the TNA program is not compiled"
fi

if [ "$compiled" -eq 0 ]; then
  cat >&2 <<'MSG'
[p4] no P4 compiler found, so nothing was compiled. To build the programs:
  BMv2:   p4c (p4c-bm2-ss) from https://github.com/p4lang/p4c, with BMv2's simple_switch_grpc from
          https://github.com/p4lang/behavioral-model (configure --with-pi); neither is in Debian or
          PyPI: build them from source, or use the p4lang/p4c and p4lang/behavioral-model images.
  Tofino: bf-p4c from Intel's Tofino SDE (source the SDE's set_sde.bash first).
Then run `make p4` again; docs/p4.md has the steps. The committed P4Info files do not need a
compiler: `make p4info` rewrites them from the programs' declarations (aggd/dataplane/p4/p4info_gen.py).
MSG
  exit 1
fi
