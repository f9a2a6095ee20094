#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 host of this kind: system packages, kernel headers
# for BCC, bpffs, and the project venv. Every step says what it does and skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

APT_PACKAGES=(python3-bpfcc libbpfcc bpftool linux-headers-amd64 iproute2 nftables ethtool
              python3-venv python3-dev prometheus)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # prometheus is only used by the observability tests; no service is started here.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  say "Debian packages present"
fi

# BCC compiles against kernel headers. This kernel ships none, so point its modules folder
# at Debian's split amd64/common header packages (BCC_KERNEL_SOURCE alone does not work).
kver=$(uname -r)
moddir=/lib/modules/$kver
if [ ! -e "$moddir/build/include/linux/kconfig.h" ] && [ ! -e "$moddir/build/include/generated/autoconf.h" ]; then
  hdr_amd64=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
  hdr_common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1)
  [ -n "$hdr_amd64" ] && [ -n "$hdr_common" ] || { echo "no Debian kernel headers found" >&2; exit 1; }
  say "linking $moddir/build -> $hdr_amd64 and source -> $hdr_common for BCC"
  mkdir -p "$moddir"
  ln -sfn "$hdr_amd64" "$moddir/build"
  ln -sfn "$hdr_common" "$moddir/source"
else
  say "kernel headers for $kver present"
fi

if ! mountpoint -q /sys/fs/bpf; then
  say "mounting bpffs at /sys/fs/bpf"
  mount -t bpf bpf /sys/fs/bpf
fi

VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  say "creating venv $VENV with Debian's python3 (bcc's bindings are built for it)"
  /usr/bin/python3 -m venv "$VENV"
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -e "$site/bcc" ]; then
  say "linking Debian's bcc bindings into the venv"
  ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
fi
stamp="$VENV/.installed-$(cat pyproject.toml client/pyproject.toml requirements-dev.txt | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  say "installing Python packages into $VENV (client, daemon, test tools)"
  "$VENV/bin/pip" install -q -e ./client -e . -r requirements-dev.txt
  rm -f "$VENV"/.installed-*; touch "$stamp"
else
  say "Python packages up to date"
fi
# numba caches compiled kernels beside their sources (__pycache__): compiled once here (about 25 s),
# loaded in about a second after, so neither a first daemon nor a first worker waits for a compiler
say "compiling the numba kernels of the client and of the daemon's user-space path (cached after the first time)"
"$VENV/bin/python" -c 'from aggd_client import _fast; _fast.warm_up()
from aggd.dataplane.userspace import fastpath, kernels; fastpath.warm_up(); kernels.warm_up()'
say "ready"
