"""The XDP program's instructions kept on disk between loads (and the map value sizes the daemon
probes before it loads the program).

bcc compiles ``aggd_xdp.c`` at every load, and clang's optimiser on the program's 6,500 instructions
costs 1.5-2.5 s of CPU: most of a daemon's start, and of its downtime at a restart. A load with an
entry compiled before for the same sources, build flags, bcc and kernel has bcc build only the maps
(the same source with ``-DAGGD_MAPS_ONLY``: the same declarations, so the same layouts, BTF and
pinning, in about a third of the time), puts those maps' fds into the instructions' map loads, and
loads them. An entry that does not parse, names a map the maps build lacks, or is refused by the
verifier is removed, and the program compiled in full as without a cache.

Where: ``$AGGD_XDP_CACHE`` (empty: no cache), else systemd's ``$CACHE_DIRECTORY``/xdp (the unit's
``CacheDirectory=aggd``), else /var/cache/aggd/xdp. Entries are named by a digest of everything
that shapes the instructions, so an entry is never used for another build; they are small (the
instructions, about 55 KB) and can be removed at any time.
"""
from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

#: bumped when an entry's content or meaning changes
FORMAT = 1
#: the cflag that leaves the program out of a build (xdp/aggd_xdp.c)
MAPS_ONLY = "-DAGGD_MAPS_ONLY"

_BPF_LD_IMM64 = 0x18        # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
_BPF_PSEUDO_MAP_FD = 1      # its src_reg when the immediate is a map's fd (include/uapi/linux/bpf.h)


def cache_dir() -> Path | None:
    """Where entries live, or None when caching is off (``AGGD_XDP_CACHE=""``)."""
    env = os.environ.get("AGGD_XDP_CACHE")
    if env is not None:
        return Path(env) if env else None
    systemd = os.environ.get("CACHE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0]) / "xdp"
    return Path("/var/cache/aggd/xdp")


def _libbcc_identity() -> str:
    from bcc import lib
    from bcc.version import __version__
    try:
        path = Path(os.path.realpath(lib._name)) if os.path.isabs(lib._name) else None
        if path is None:
            # resolved by the dynamic loader: its mapping in this process says which file
            maps = Path("/proc/self/maps").read_text().splitlines()
            path = next(Path(line.split()[-1]) for line in maps if "libbcc.so" in line)
        st = path.stat()
        return f"{__version__} {path} {st.st_size} {st.st_mtime_ns}"
    except (OSError, StopIteration):
        return __version__


def program_key(source_dir: Path, cflags: list[str]) -> str:
    """The digest naming a build: the contents of the sources in ``source_dir`` (every .c and .h),
    the flags that reach the compiler (the include directory and the pin directory aside: neither
    changes an instruction), bcc's identity and the kernel's release."""
    h = hashlib.sha256(f"aggd-xdp-program {FORMAT}\0".encode())
    for path in sorted(source_dir.glob("*.[ch]")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for flag in cflags:
        if flag.startswith("-I"):
            continue
        if flag.startswith("-DAGGD_PIN_DIR="):
            flag = "-DAGGD_PIN_DIR"
        h.update(flag.encode() + b"\0")
    h.update(_libbcc_identity().encode() + b"\0" + os.uname().release.encode())
    return h.hexdigest()[:32]


def map_loads(insns: bytes, fds: dict[int, str]) -> list[tuple[int, str]] | None:
    """Where the instructions load a map's fd, and which map's ((slot index, name) each), or None
    when one refers to anything else (an fd of no named map, a map value): such a program is not
    cached."""
    loads = []
    i, n = 0, len(insns) // 8
    while i < n:
        code, regs = insns[8 * i], insns[8 * i + 1]
        if code == _BPF_LD_IMM64:
            src = regs >> 4
            if src == _BPF_PSEUDO_MAP_FD:
                fd = int.from_bytes(insns[8 * i + 4:8 * i + 8], "little", signed=True)
                if fd not in fds:
                    return None
                loads.append((i, fds[fd]))
            elif src != 0:
                return None
            i += 2
        else:
            i += 1
    return loads


def with_map_fds(insns: bytes, loads: list[tuple[int, str]], fds: dict[str, int]) -> bytes:
    """The instructions with each map load's immediate set to that map's fd in ``fds``."""
    out = bytearray(insns)
    for i, name in loads:
        out[8 * i + 4:8 * i + 8] = fds[name].to_bytes(4, "little", signed=True)
    return bytes(out)


_tables_lib = None


def table_fds(bpf) -> dict[str, int]:
    """Every map a bcc module built, by name: its fd."""
    global _tables_lib
    if _tables_lib is None:
        from bcc import lib
        # bcc's Python binding declares none of these three; a handle of our own types them
        _tables_lib = ctypes.CDLL(lib._name)
        _tables_lib.bpf_num_tables.restype, _tables_lib.bpf_num_tables.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
        _tables_lib.bpf_table_name.restype = ctypes.c_char_p
        _tables_lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _tables_lib.bpf_table_fd_id.restype = ctypes.c_int
        _tables_lib.bpf_table_fd_id.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fds = {}
    for i in range(_tables_lib.bpf_num_tables(bpf.module)):
        fds[_tables_lib.bpf_table_name(bpf.module, i).decode()] = int(_tables_lib.bpf_table_fd_id(bpf.module, i))
    return fds


def _digest(insns: bytes, loads: list[tuple[int, str]], license: bytes) -> str:
    # an entry damaged on disk is compiled again, not loaded: a damaged program may still verify
    return hashlib.sha256(insns + json.dumps(loads).encode() + license).hexdigest()


def _value_digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


class ProgramCache:
    """Entries in ``directory`` (None: nothing is kept, every load compiles)."""

    def __init__(self, directory: Path | None):
        self.directory = directory

    @classmethod
    def configured(cls) -> "ProgramCache":
        """The cache where ``cache_dir`` says."""
        return cls(cache_dir())

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """A program kept by ``put``: its instructions, license, map loads and the maps they name
        (None: none, or damaged, then removed)."""
        def program(entry: dict) -> dict:
            got = {"insns": base64.b64decode(entry["insns"], validate=True), "license": entry["license"].encode(),
                   "loads": [(int(i), str(name)) for i, name in entry["loads"]]}
            if entry["digest"] != _digest(got["insns"], got["loads"], got["license"]):
                raise ValueError("its digest does not match its content")
            got["maps"] = sorted({name for _, name in got["loads"]})
            return got
        return self._read(key, program)

    def put(self, key: str, insns: bytes, loads: list[tuple[int, str]], license: bytes) -> None:
        self._write(key, {"format": FORMAT, "insns": base64.b64encode(insns).decode(), "license": license.decode(),
                          "loads": [[i, name] for i, name in loads], "digest": _digest(insns, loads, license)})

    def _write(self, key: str, entry: dict) -> None:
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # another process may be writing the same entry: each writes its own file, then renames
            with tempfile.NamedTemporaryFile("w", dir=self.directory, suffix=".tmp", delete=False) as f:
                try:
                    json.dump(entry, f)
                except BaseException:
                    os.unlink(f.name)
                    raise
            os.replace(f.name, self._path(key))
        except OSError as exc:
            log.warning("cannot keep the compiled XDP program in %s: %s", self.directory, exc)

    def get_value(self, key: str):
        """A small JSON value kept by ``put_value`` (None: none, or damaged, then removed)."""
        def value(entry: dict):
            if entry["digest"] != _value_digest(entry["value"]):
                raise ValueError("its digest does not match its content")
            return entry["value"]
        return self._read(key, value)

    def _read(self, key: str, decode):
        if self.directory is None:
            return None
        try:
            entry = json.loads(self._path(key).read_text())
            if entry.get("format") != FORMAT:
                raise ValueError(f"format {entry.get('format')}")
            return decode(entry)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("XDP program cache entry %s is unreadable (%s): building it again", self._path(key), exc)
            self.drop(key)
            return None

    def put_value(self, key: str, value) -> None:
        self._write(key, {"format": FORMAT, "value": value, "digest": _value_digest(value)})

    def drop(self, key: str) -> None:
        if self.directory is not None:
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError:
                pass


def license_of(bpf) -> bytes:
    from bcc import lib
    return lib.bpf_module_license(bpf.module) or b"GPL"


def function_insns(bpf, name: str) -> bytes | None:
    from bcc import lib
    start = lib.bpf_function_start(bpf.module, name.encode())
    if not start:
        return None
    return ctypes.string_at(start, lib.bpf_function_size(bpf.module, name.encode()))
